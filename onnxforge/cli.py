"""The ``onnxforge`` command: serve, worker, optimize (local), passes, submit (remote), keys (API keys).

Exit codes: 0 success, 2 bad input (unknown pass, invalid config or model, bad arguments), 1 any other
failure. Errors print as ``error: CODE: message (pass NAME)`` on stderr.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import ErrorKind, InvalidInputError, OnnxforgeError

if TYPE_CHECKING:
    from core.settings import Settings

_INPUT_KINDS = {ErrorKind.INVALID_INPUT, ErrorKind.NOT_FOUND, ErrorKind.TOO_LARGE}

DESCRIPTION = """\
onnxforge: verified, measured ONNX graph optimization.

Run the service with `onnxforge serve` (embedded: API plus worker processes, nothing else needed), or
optimize a model locally with `onnxforge optimize model.onnx -o model.opt.onnx`. Settings come from
ONNXFORGE_<SECTION>__<FIELD> environment variables (see deploy/env.example).
"""


def _settings() -> Settings:
    from core.settings import get_settings

    return get_settings()


def _fail(exc: OnnxforgeError) -> int:
    where = f" (pass {exc.pass_name})" if exc.pass_name else ""
    print(f"error: {exc.code}: {exc.message}{where}", file=sys.stderr)
    return 2 if exc.kind in _INPUT_KINDS else 1


# -------------------------------------------------------------------------------------------- config


def build_config(args: argparse.Namespace) -> dict[str, Any]:
    """The job config from --config FILE, overridden by --preset / --passes / --target."""
    config: dict[str, Any] = {}
    if args.config:
        try:
            loaded = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidInputError(f"cannot read config {args.config}: {exc}", code="INVALID_CONFIG") from exc
        if not isinstance(loaded, dict):
            raise InvalidInputError("the config file must hold a JSON object", code="INVALID_CONFIG")
        config.update(loaded)
    if args.preset:
        config.pop("passes", None)
        config["preset"] = args.preset
    if args.passes:
        config.pop("preset", None)
        config["passes"] = [p.strip() for p in args.passes.split(",") if p.strip()]
    if getattr(args, "target", None):
        config["target"] = args.target
    return config


def _check_names(config: dict[str, Any]) -> Any:
    """Parse the config and resolve every pass and preset name before anything runs."""
    from core.config import JobConfig
    from passes.registry import build_passes, get_preset

    job_config = JobConfig.parse(config)
    specs = job_config.pass_specs()
    if specs is not None:
        build_passes(specs)
    elif job_config.preset is not None:
        get_preset(job_config.preset)
    return job_config


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("job configuration (same JSON as the API's config field)")
    group.add_argument("--config", metavar="FILE.json", help="job config file (JSON)")
    choice = group.add_mutually_exclusive_group()
    choice.add_argument("--preset", metavar="NAME", help="a preset (see `onnxforge passes`)")
    choice.add_argument("--passes", metavar="A,B", help="comma-separated pass names, run in this order")
    group.add_argument("--samples", metavar="F.npz", help="real inputs (npz, one array per graph input)")
    group.add_argument("--target", choices=["cpu", "cuda", "tensorrt"], help="device to optimize for")


# ------------------------------------------------------------------------------------------ commands


def cmd_serve(args: argparse.Namespace) -> int:
    from onnxforge.server import serve

    return serve(_settings(), host=args.host, port=args.port)


def worker_concurrency(settings: Settings, queues: Sequence[str] | None, requested: int | None) -> int | None:
    """The pool size of ``onnxforge worker``: on the gpu queue one job per visible GPU (workers/gpu.py), at most
    ``requested``; elsewhere ``requested`` (None: worker.concurrency)."""
    from workers.gpu import gpu_concurrency, visible_gpus

    chosen = list(queues or settings.worker.queues)
    return gpu_concurrency(requested, chosen, visible_gpus()) if "gpu" in chosen else requested


def cmd_worker(args: argparse.Namespace) -> int:
    from onnxforge.server import run_worker

    settings = _settings()
    queues = [q.strip() for q in args.queues.split(",") if q.strip()] if args.queues else None
    concurrency = worker_concurrency(settings, queues, args.concurrency)
    return run_worker(settings, queues=queues, concurrency=concurrency, loglevel=args.loglevel)


def cmd_migrate(args: argparse.Namespace) -> int:
    from core import migrations
    from core.store import JobStore

    settings = _settings()
    store = JobStore(settings.database_url, settings.database.schema_name)
    try:
        before = store.schema_revision()
        if args.check:
            store.check_schema()  # SCHEMA_OUT_OF_DATE: exit status 2
        elif args.revision == "head":
            store.create_schema()
        else:
            store.downgrade(args.revision)
        after = store.schema_revision()
    finally:
        store.close()
    backend = store.url.get_backend_name()
    print(f"job database ({backend}): revision {before or 'none'} -> {after} (head {migrations.head()})")
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    from core.objectstore import open_blob_store
    from core.retention import purge
    from core.store import JobStore

    settings = _settings()
    store = JobStore(settings.database_url, settings.database.schema_name)
    try:
        store.check_schema()
        stats = purge(store, open_blob_store(settings.storage), settings.retention, sweep=args.sweep)
    finally:
        store.close()
    if args.json:
        print(json.dumps(stats.as_dict(), sort_keys=True))
    else:
        expired = ", ".join(f"{kind} {count}" for kind, count in stats.files_expired.items())
        print(
            f"purged: {stats.jobs_deleted} jobs deleted; files expired: {expired}; {stats.blobs_deleted} files "
            f"({stats.bytes_freed} bytes) deleted; {stats.blobs_kept_in_grace} left for the next run (grace period)"
        )
    return 0


def cmd_passes(args: argparse.Namespace) -> int:
    from passes.registry import PRESETS, catalogue

    passes = catalogue()
    presets = [p.to_dict() for p in PRESETS.values()]
    if args.json:
        print(json.dumps({"passes": passes, "presets": presets}, indent=2, sort_keys=True))
        return 0
    width = max(len(p["name"]) for p in passes)
    print("passes:")
    for p in passes:
        print(f"  {p['name']:<{width}}  {'exact ' if p['exact'] else 'approx'}  {p['summary']}")
    print("presets:")
    for preset in presets:
        print(f"  {preset['name']}: {', '.join(preset['passes'])}")
        print(f"      {preset['summary']}")
    return 0


def _archive_format(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".zip"):
        return "zip"
    if name.endswith((".tar", ".tar.gz", ".tgz")):
        return "tar"
    return "onnx"


def _fmt_ms(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def print_summary(report: dict[str, Any]) -> None:
    rows = [("pass", "status", "nodes", "p50 ms before->after")]
    for p in report.get("passes") or []:
        rows.append(
            (
                str(p.get("name")),
                str(p.get("status")),
                f"{p.get('nodes_before')}->{p.get('nodes_after')}",
                f"{_fmt_ms(p.get('latency_ms_p50_before'))}->{_fmt_ms(p.get('latency_ms_p50_after'))}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    s = report.get("summary") or {}
    decision = report.get("decision") or {}
    speedup = s.get("speedup")
    print(
        f"nodes {s.get('nodes_before')}->{s.get('nodes_after')}, "
        f"p50 {_fmt_ms(s.get('p50_ms_before'))} -> {_fmt_ms(s.get('p50_ms_after'))} ms"
        + (f" (x{speedup:.2f})" if isinstance(speedup, (int, float)) else "")
        + (", original model kept" if decision.get("used_original") else "")
    )


def cmd_optimize(args: argparse.Namespace) -> int:
    from core.config import JobConfig

    model = Path(args.model)
    if not model.is_file():
        raise InvalidInputError(f"no such model file: {model}", code="INVALID_MODEL")
    config: JobConfig = _check_names(build_config(args))  # before the heavy imports: bad names fail fast

    from workers.gc_policy import imports_frozen
    from workers.pipeline import PipelineRequest, run_pipeline

    settings = _settings()
    out = Path(args.output)
    # Run from the process's own command line (main), the process exits after the job: the imports stay frozen.
    with imports_frozen(process_exits=args.process_exits), tempfile.TemporaryDirectory(prefix="onnxforge-") as tmp:
        work = Path(tmp)
        fmt = _archive_format(model)
        if fmt != "onnx":
            from workers.archive import extract_archive  # archives only

            (work / "input").mkdir()
            model = extract_archive(model, work / "input", fmt, max_total_bytes=settings.api.max_upload_bytes)
        output_dir = work / "output"
        output_dir.mkdir()
        last_stage: list[str] = []

        def progress(stage: str | None = None, *_: Any, **__: Any) -> None:
            if stage and (not last_stage or last_stage[-1] != stage):
                last_stage.append(stage)
                print(f"... {stage}", file=sys.stderr)

        result = run_pipeline(
            PipelineRequest(
                model_path=model,
                output_dir=output_dir,
                config=config,
                settings=settings.pipeline,
                samples_path=Path(args.samples) if args.samples else None,
                progress=progress,
            )
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        data = [Path(p) for p in result.external_data]
        side = [Path(p) for p in result.side_files]  # model.onnx_adapter: OUT.onnx_adapter beside OUT.onnx
        if out.name.endswith(".zip"):
            from workers.runner import deterministic_zip  # zip output only (it brings the runner's logging)

            deterministic_zip(out, [Path(result.model_path), *data, *side])
        else:
            shutil.copyfile(result.model_path, out)
            for path in data:
                shutil.copyfile(path, out.parent / path.name)
            for path in side:
                shutil.copyfile(path, out.with_suffix(path.suffix))
        if args.report:
            shutil.copyfile(result.report_json_path, args.report)
        if args.html:
            shutil.copyfile(result.report_html_path, args.html)
        print_summary(result.report)
    print(f"wrote {out}" + (f" (+{len(data)} external data file(s))" if data and not out.name.endswith(".zip") else ""))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from onnxforge.client import Client, ProgressBar

    config = build_config(args)
    show = ProgressBar(sys.stderr)

    with Client(args.server, token=args.token) as client:
        job = client.submit(args.model, config=config or None, samples=args.samples)
        print(job["id"])
        if not (args.wait or args.output or args.report):
            return 0
        job = client.wait(job["id"], progress=show, timeout=args.timeout)
        if job["state"] != "succeeded":
            error = job.get("error") or {}
            where = f" (pass {error['pass']})" if error.get("pass") else ""
            print(
                f"error: {error.get('code', job['state'].upper())}: {error.get('message', '')}{where}",
                file=sys.stderr,
            )
            return 1
        if args.output:
            client.download_artifact(job["id"], args.output)
            print(f"wrote {args.output}", file=sys.stderr)
        if args.report:
            client.download_report(job["id"], args.report)
    return 0


def cmd_adapters_convert(args: argparse.Namespace) -> int:
    from core.adapters import ADAPTER_SUFFIX, convert_peft

    model, out = Path(args.model), Path(args.output)
    if not model.is_file():
        raise InvalidInputError(f"no such model file: {model}", code="INVALID_MODEL")
    if not out.name.endswith(ADAPTER_SUFFIX):
        raise InvalidInputError(f"-o must name a {ADAPTER_SUFFIX} file, got {out.name}", code="INVALID_ARGUMENT")
    report = convert_peft(Path(args.peft_dir), model, out)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    for pair in report["pairs"]:
        print(f"  {pair['module']}  rank {pair['rank']}  A{pair['a_shape']} B{pair['b_shape']}  {pair['bytes']} bytes")
    if report["slots_at_base"]:
        print(f"  (no weights for {len(report['slots_at_base'])} slot(s): they run as the base)")
    print(f"wrote {out} ({len(report['pairs'])} pair(s), {report['bytes']} bytes)")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    import getpass

    from core.keys import hash_key, new_key

    if args.action == "new":
        key = new_key()
        print(f"key     {key}\nsha256  {hash_key(key)}")
        print("Give the key to the team once; configure only the sha256 (auth.keys_file).", file=sys.stderr)
        return 0
    key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\r\n")
    if not key:
        raise InvalidInputError("no key given on standard input", code="KEY_MISSING")
    print(hash_key(key))
    return 0


# ------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnxforge", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from onnxforge import __version__

    parser.add_argument("--version", action="version", version=f"onnxforge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "serve",
        help="run the HTTP API (embedded mode also starts worker processes)",
        description="Run the HTTP API with uvicorn. Without ONNXFORGE_BROKER__URL (embedded mode) it also "
        "starts ONNXFORGE_WORKER__EMBEDDED_WORKERS worker processes fed by a filesystem queue under the "
        "data directory; with a broker URL it serves the API only.",
    )
    p.add_argument("--host", help="address to bind (default: api.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default: api.port, 8000)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "worker",
        help="run a Celery worker that executes optimization jobs",
        description="Run a Celery worker (prefork pool) consuming the given queues. Each job attempt runs in "
        "a separate, resource-limited child process (a fresh interpreter, exec'd). On the gpu queue the pool "
        "runs one job per visible GPU (CUDA_VISIBLE_DEVICES, else nvidia-smi) and pins each job's child to "
        "its GPU.",
    )
    p.add_argument("--queues", metavar="cpu,gpu", help="queues to consume (default: worker.queues)")
    p.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="jobs at once (default: worker.concurrency; on the gpu queue the GPU count, and never above it)",
    )
    p.add_argument("--loglevel", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser(
        "migrate",
        help="create or upgrade the job database's schema (Alembic)",
        description="Bring the job table (database.url, database.schema_name) to the schema revision this "
        "version needs, creating it when missing; safe to run while other processes start. A database made "
        "before migrations existed is adopted. With database.auto_migrate=false the API and workers refuse an "
        "old schema, and this runs as a deploy step.",
    )
    p.add_argument("--check", action="store_true", help="only check: exit status 2 unless the schema is current")
    p.add_argument(
        "--revision",
        default="head",
        metavar="REV",
        help="downgrade to this older revision (default: head, i.e. upgrade); for rolling back a release",
    )
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser(
        "purge",
        help="delete what the retention settings say is due (run it from cron)",
        description="Apply the retention settings once: delete the uploads, optimized models and reports of jobs "
        "finished longer ago than retention.uploads_days / artifacts_days / reports_days, and whole jobs "
        "(row and files) past retention.jobs_days (each per team in retention.teams; 0 keeps forever), plus "
        "jobs a DELETE left to be removed. A file another job still uses is kept. Safe to run while the "
        "service runs.",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also delete every stored file that no job names (older than retention.blob_grace_seconds)",
    )
    p.add_argument("--json", action="store_true", help="print the counts as JSON")
    p.set_defaults(func=cmd_purge)

    p = sub.add_parser(
        "optimize",
        help="optimize a model locally (same pipeline as the service)",
        description="Optimize MODEL (.onnx, or .zip/.tar holding a model and its external data) in this "
        "process with the service's pipeline: passes, verification, benchmark, report. Prints a per-pass "
        "summary. Exit status 0 on success, 2 on bad input, 1 on failure.",
    )
    p.add_argument("model", metavar="MODEL", help="the model: .onnx, .zip or .tar")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT",
        help="optimized model path; external data files go next to it (OUT.zip bundles them)",
    )
    _add_config_options(p)
    p.add_argument("--report", metavar="R.json", help="write the JSON report here")
    p.add_argument("--html", metavar="R.html", help="write the HTML report here")
    p.set_defaults(func=cmd_optimize)

    p = sub.add_parser(
        "passes",
        help="list passes and presets",
        description="List the registered passes (with option schemas in --json) and presets.",
    )
    p.add_argument("--json", action="store_true", help="print JSON: {passes: [...], presets: [...]}")
    p.set_defaults(func=cmd_passes)

    p = sub.add_parser(
        "submit",
        help="submit a model to a running onnxforge server",
        description="Upload MODEL to the server as a new job. Prints the job id; with --wait (implied by -o "
        "and --report) follows its progress on stderr and downloads the results.",
    )
    p.add_argument("model", metavar="MODEL", help="the model: .onnx, .zip or .tar")
    p.add_argument("--server", required=True, metavar="URL", help="base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--token", help="bearer token, if the server requires one")
    _add_config_options(p)
    p.add_argument("--wait", action="store_true", help="wait until the job finishes")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="give up waiting after this long")
    p.add_argument("-o", "--output", metavar="OUT", help="download the optimized model here")
    p.add_argument("--report", metavar="R.json", help="download the JSON report here")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser(
        "keys",
        help="make an API key, or hash one, for auth.keys_file",
        description="`keys new` prints a fresh random API key and its SHA-256; `keys hash` reads a key from "
        "standard input (never from the command line, which other users can see) and prints its SHA-256. The "
        "server is configured with hashes only (auth.keys_file or ONNXFORGE_AUTH__KEYS).",
    )
    p.add_argument("action", choices=["new", "hash"], help="new: make a key; hash: hash the key on stdin")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser(
        "adapters",
        help="LoRA adapters for models optimized with extract_adapters",
        description="`adapters convert PEFT_DIR --model OUT.onnx -o NAME.onnx_adapter` turns a peft adapter "
        "directory (adapter_config.json + adapter_model.safetensors) trained on the same base into an ONNX "
        "Runtime adapter for a model whose LoRA pairs extract_adapters moved out. Refuses (exit status 2, "
        "error code ADAPTER_*) adapters whose target modules, shapes or ranks the model has no slot for.",
    )
    adapters = p.add_subparsers(dest="adapters_command", metavar="ACTION", required=True)
    c = adapters.add_parser("convert", help="convert a peft adapter directory to .onnx_adapter")
    c.add_argument("peft_dir", metavar="PEFT_DIR", help="adapter_config.json + adapter_model.safetensors")
    c.add_argument("--model", required=True, metavar="OUT.onnx", help="the model extract_adapters produced")
    c.add_argument("-o", "--output", required=True, metavar="NAME.onnx_adapter", help="adapter file to write")
    c.add_argument("--json", action="store_true", help="print the conversion report as JSON")
    c.set_defaults(func=cmd_adapters_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, usage errors
        return int(exit_.code or 0)
    # No argv: this process's own command line (the console script, python -m), which exits when main returns;
    # an in-process caller (tests) passes argv and goes on afterwards (optimize restores what it changed).
    args.process_exits = argv is None
    try:
        return int(args.func(args))
    except OnnxforgeError as exc:
        return _fail(exc)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
