"""Wall time of a ``fast`` job against its peer: ORT's transformers optimizer plus one benchmark of the original.

Run ``python -m bench.job_time [--model bert_mlm_loss corpus:bert/dynamo ...] [--before REV] [--after REV]
[--rounds N] [--no-write]``.

Issue 17 asks that a ``fast`` job take at most 3x the time of ORT's transformers optimizer plus one benchmark
of the original. Each side runs as a fresh process, as a user would run it, on each bench-size model: a bench
model (``bench/models.py``) or a corpus model ``corpus:ARCH/EXPORTER`` (``tests/models/corpus.py`` at bench
size); either is built on first use (building needs the ``dev`` extra):

=============  ==========================================================================================
peer           ``onnxruntime.transformers.optimizer.optimize_model(model, model_type, num_heads,
               hidden_size)`` and ``save_model_to_file`` (model type "bert" for the bench models, the corpus
               architecture's otherwise; none where ORT has no type for it), then one benchmark of the
               original: an ORT_ENABLE_ALL session, 5 warm-up runs and 30 timed runs at batch 1 / sequence
               128 (vision and audio models at their fixed size)
job (after)    ``python -m onnxforge.cli optimize MODEL -o OUT --preset fast --report R.json`` from this
               checkout, with the default pipeline settings
job (before)   with ``--before REV``: the same command from revision REV's tree (``git archive``, extracted
               into a temporary directory; the repository itself is only read), in the same run
job (after)    with ``--after REV``: revision REV's tree in place of the checkout, so that a before/after
               compares two commits and not other engineers' uncommitted work in a shared checkout
=============  ==========================================================================================

The summary also gives each side *warm*: without process start-up and imports, as a service's worker (a
process that has imported everything already) runs a job: the peer's optimize + benchmark seconds, measured
inside its process after its imports, against the job's pipeline duration (the report's ``duration_s``).

``--rounds N`` times the peer and each job N times per model, the jobs' order reversed every other round so that
the host's drift hits both; the table shows the median round of each (its ratio: the median of the rounds' job /
that round's peer), and a line below it every round's wall time and ratio to that round's peer.

The figures depend on the machine's load: the load average is read before and after and printed beside
them. The report's ``timings`` of each job give the stage breakdown. Written into bench/README.md between
the ``job-time-table`` markers (``--no-write`` to skip).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # bench scripts may run as files rather than with python -m
    sys.path.insert(0, str(REPO))

from bench._report import machine_line, write_blocks  # noqa: E402
from bench.models import ensure_bench_model, make_inputs, model_info  # noqa: E402
from workers.benchmark import host_info  # noqa: E402

START, END = "<!-- job-time-table:start -->", "<!-- job-time-table:end -->"
HEADING = "### Job time: `python -m bench.job_time`"
TARGET_RATIO = 3.0  # issue 17: a fast job takes at most 3x the peer's time
PEER_BATCH, PEER_SEQ, PEER_WARMUP, PEER_RUNS = 1, 128, 5, 30

# The peer, in a process of its own: ORT's transformers optimizer, then one benchmark of the original.
PEER = """
import time
import numpy as np
import onnxruntime as ort
from onnxruntime.transformers.optimizer import optimize_model

started = time.perf_counter()
if {model_type!r} is not None:
    try:
        optimized = optimize_model({model!r}, model_type={model_type!r}, num_heads={heads}, hidden_size={hidden})
        optimized.save_model_to_file({out!r})
    except Exception as exc:  # the optimizer's refusal is part of the peer's time; the benchmark still runs
        print("PEER-OPTIMIZER-FAILED", type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
optimize_s = time.perf_counter() - started
started = time.perf_counter()
options = ort.SessionOptions()
options.log_severity_level = 3
session = ort.InferenceSession({model!r}, options, providers=["CPUExecutionProvider"])
names = [i.name for i in session.get_inputs()]
feeds = {{k: v for k, v in np.load({feeds!r}).items() if k in names}}
for _ in range({warmup}):
    session.run(None, feeds)
times = []
for _ in range({runs}):
    t = time.perf_counter()
    session.run(None, feeds)
    times.append(time.perf_counter() - t)
print("PEER", optimize_s, time.perf_counter() - started, 1000 * float(np.median(times)))
"""


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


@dataclasses.dataclass
class Subject:
    """A model the jobs and the peer run on: its file, what the peer's optimizer is told, the peer's feeds."""

    name: str
    path: Path
    model_type: str | None  # None: ORT's transformers optimizer has no type for it; the peer only benchmarks
    heads: int
    hidden: int
    feeds: dict[str, np.ndarray]
    size_mb: float
    nodes: int


def subject(name: str) -> Subject:
    """A bench model by name, or ``corpus:ARCH/EXPORTER`` from the corpus at bench size (built on demand)."""
    if not name.startswith("corpus:"):
        path = ensure_bench_model(name)
        info = model_info(name) or {}
        feeds = make_inputs(name, PEER_BATCH, PEER_SEQ)
        dims = info["dims"]
        return Subject(name, path, "bert", dims["heads"], dims["hidden"], feeds, info["bytes"] / 1e6, info["nodes"])
    from tests.models import corpus  # deferred: only corpus runs need it

    arch, exporter = name.removeprefix("corpus:").split("/")
    info = corpus.cached(arch, exporter, "bench")
    if info is None:
        cmd = [sys.executable, "-m", "tests.models.corpus", "--size", "bench", "--reuse", "--only", arch]
        subprocess.run([*cmd, "--exporters", exporter], cwd=REPO, check=True)
        info = corpus.cached(arch, exporter, "bench")
    if info is None or not info.get("ok"):
        raise RuntimeError(f"{name}: no bench-size build ({(info or {}).get('error')})")
    dims = corpus.DIMS["bench"]
    feeds = corpus.feeds(arch, "bench", PEER_BATCH, PEER_SEQ, seed=1)
    model_type = corpus.ARCHS[arch].ort_model_type
    return Subject(
        name, Path(info["path"]), model_type, dims.heads, dims.hidden, feeds, info["bytes"] / 1e6, info["nodes"]
    )


def run_peer(model: Subject, out: Path) -> dict[str, Any]:
    feeds = out / "peer_feeds.npz"
    np.savez(feeds, **model.feeds)
    code = PEER.format(
        model=str(model.path),
        out=str(out / "peer.onnx"),
        model_type=model.model_type,
        heads=model.heads,
        hidden=model.hidden,
        feeds=str(feeds),
        warmup=PEER_WARMUP,
        runs=PEER_RUNS,
    )
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    line = next(x for x in done.stdout.splitlines() if x.startswith("PEER "))
    optimize_s, benchmark_s, p50_ms = (float(v) for v in line.split()[1:])
    failed = next((x.split(" ", 1)[1] for x in done.stdout.splitlines() if x.startswith("PEER-OPTIMIZER-FAILED")), None)
    peer: dict[str, Any] = {"wall_s": wall, "optimize_s": optimize_s, "benchmark_s": benchmark_s, "p50_ms": p50_ms}
    return {**peer, "optimizer_failed": failed} if failed else peer


_COMPILED: set[Path] = set()


def compile_tree(tree: Path) -> None:
    """Byte-compile the project's packages in ``tree`` once, as an installed wheel or the image has them: where
    ``PYTHONDONTWRITEBYTECODE`` is set (these machines set it) every job process would otherwise compile ~120
    modules from source, a cost the peer, whose packages were compiled at install, never pays."""
    if tree in _COMPILED:
        return
    packages = [
        str(tree / name) for name in ("app", "core", "workers", "passes", "onnxforge") if (tree / name).is_dir()
    ]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *packages], check=True, capture_output=True)
    _COMPILED.add(tree)


def run_job(model: Path, out: Path, tree: Path) -> dict[str, Any]:
    """``onnxforge optimize --preset fast`` from the checkout at ``tree`` in a fresh process; its wall time."""
    compile_tree(tree)
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report.json"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    where = subprocess.run(
        [sys.executable, "-c", "import workers; print(workers.__file__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the job would run the pipeline at {where}, not the one in {tree}")
    command = [sys.executable, "-m", "onnxforge.cli", "optimize", str(model), "-o", str(out / "model.onnx")]
    command += ["--preset", "fast", "--report", str(report)]
    started = time.perf_counter()
    done = subprocess.run(command, check=False, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the job failed ({done.returncode}): {done.stderr[-2000:]}")
    data = json.loads(report.read_text())
    return {
        "wall_s": wall,
        "duration_s": data["duration_s"],
        "timings": data.get("timings"),
        "speedup": data["summary"]["speedup"],
        "applied": data["summary"]["passes_applied"],
        "passes": len(data["passes"]),
        "result": data["decision"]["result"]
        + (" (tie)" if data["decision"]["gate"].get("tie") else "")
        + (" (same program)" if data["decision"]["gate"].get("same_program") else ""),
    }


def extract(rev: str, into: Path) -> Path:
    """Revision ``rev``'s tree under ``into`` (``git archive``: reads the repository, changes nothing in it)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=True).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _stages(job: dict[str, Any]) -> str:
    timings = job.get("timings")
    if not timings:
        return "not recorded (no `timings` in that revision's report)"
    names = ("load", "inputs", "baseline", "passes", "finalize", "gate", "artifact", "decoder", "report")
    parts = [f"{n} {timings[f'{n}_s']:.1f}" for n in names if timings.get(f"{n}_s") is not None]
    steps: dict[str, float] = {}
    for entry in timings.get("passes") or []:
        for key in ("load_s", "transform_s", "write_s", "verify_s", "benchmark_s"):
            steps[key] = steps.get(key, 0.0) + entry[key]
    inside = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in steps.items())
    sessions = timings.get("sessions") or {}
    return (
        f"{'; '.join(parts)} s (passes: {inside} s; benchmark sessions built {sessions.get('built')}, "
        f"reused {sessions.get('reused')})"
    )


def _speedup(job: dict[str, Any]) -> str:
    """The summary's speedup; none when the gate proved the artifact the same program and timed nothing."""
    return "untimed" if job["speedup"] is None else f"{job['speedup']:.3f}"


def _median_run(runs: list[dict[str, Any]], peers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Of several rounds, the one of median wall time (its breakdown with it); a failed round if any failed.
    With the rounds' ``peers``, its ``ratio`` is the median of each round's job / that round's peer (the host's
    load moves both within a round), not the median job over the median peer."""
    failed = [r for r in runs if "failed" in r]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    middle = dict(ordered[(len(ordered) - 1) // 2])
    if peers is not None and len(runs) > 1:
        middle["ratio"] = float(np.median([r["wall_s"] / p["wall_s"] for r, p in zip(runs, peers, strict=True)]))
    return middle


def _rounds_line(peers: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> str:
    """Each round's wall time per job and its ratio to that round's peer."""
    parts = []
    for label, done in runs.items():
        cells = [
            "failed" if "failed" in job else f"{job['wall_s']:.1f} s ({job['wall_s'] / peer['wall_s']:.2f}x)"
            for peer, job in zip(peers, done, strict=True)
        ]
        parts.append(f"{label}: {', '.join(cells)}")
    peer_s = ", ".join(f"{p['wall_s']:.1f}" for p in peers)
    return f"Rounds (the median round above): peer {peer_s} s; " + "; ".join(parts) + "."


def render_model(
    model: Subject,
    *,
    peer: dict[str, Any],
    jobs: dict[str, dict[str, Any]],
    rounds: tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]] | None = None,
) -> str:
    budget = peer["wall_s"]
    shape = " x ".join("x".join(map(str, v.shape)) for v in model.feeds.values())
    optimizer = f"ORT transformers optimizer ({model.model_type})" if model.model_type else "no ORT model type"
    if peer.get("optimizer_failed"):
        optimizer += f", which failed ({str(peer['optimizer_failed']).replace('|', '/')})"
    rows = [
        f"| peer: {optimizer} + one benchmark of the original | {peer['wall_s']:.1f} | 1.00x | "
        f"optimize {peer['optimize_s']:.1f} s, benchmark {peer['benchmark_s']:.1f} s "
        f"(p50 {peer['p50_ms']:.1f} ms at {shape}) |"
    ]
    for label, job in jobs.items():
        if "failed" in job:
            reason = " ".join(job["failed"].split())[-300:].replace("|", "/")
            rows.append(f"| `fast` job, {label} | - | failed | {reason} |")
            continue
        ratio = job.get("ratio", job["wall_s"] / budget)
        mark = "within" if ratio <= TARGET_RATIO else "over"
        rows.append(
            f"| `fast` job, {label} | {job['wall_s']:.1f} | **{ratio:.2f}x** ({mark} {TARGET_RATIO:g}x) | "
            f"{job['passes']} passes, {job['applied']} applied, speedup {_speedup(job)}; {_stages(job)} |"
        )
    return "\n".join(
        [
            f"Model: `{model.name}` bench size ({model.size_mb:.0f} MB, {model.nodes} nodes).",
            "",
            "| what | wall s | / peer | breakdown |",
            "|---|---|---|---|",
            *rows,
            *(["", _rounds_line(*rounds)] if rounds is not None else []),
        ]
    )


SUMMARY_HEAD = [
    "| model | peer s | `fast` job s | / peer | warm: peer s | warm: job s | warm: / peer | gate s | handed back "
    "| speedup |",
    "|---|---|---|---|---|---|---|---|---|---|",
]


def warm_ratio(peer: dict[str, Any], job: dict[str, Any]) -> tuple[float, float, float]:
    """(peer s, job s, ratio) without process start-up and imports on either side, as a service's worker runs a
    job in a process that has them already: the peer's optimize + benchmark, the job's pipeline duration."""
    peer_s = peer["optimize_s"] + peer["benchmark_s"]
    return peer_s, job["duration_s"], job["duration_s"] / peer_s


def _summary_row(model: Subject, peer: dict[str, Any], job: dict[str, Any]) -> str:
    """One line of the summary table: this checkout's job against the peer."""
    if "failed" in job:
        return f"| `{model.name}` | {peer['wall_s']:.1f} | - | failed | - | - | failed | - | - | - |"
    ratio = job.get("ratio", job["wall_s"] / peer["wall_s"])
    mark = f"**{ratio:.2f}x**" if ratio > TARGET_RATIO else f"{ratio:.2f}x"
    warm_peer, warm_job, warm = warm_ratio(peer, job)
    warm_mark = f"*{warm:.2f}x*" if warm > TARGET_RATIO else f"{warm:.2f}x"
    gate = (job.get("timings") or {}).get("gate_s")
    gate_s = f"{gate:.1f}" if gate is not None else "-"
    return (
        f"| `{model.name}` | {peer['wall_s']:.1f} | {job['wall_s']:.1f} | {mark} | {warm_peer:.1f} | {warm_job:.1f} "
        f"| {warm_mark} | {gate_s} | {job.get('result', '-')} | {_speedup(job)} |"
    )


def render(sections: list[str], *, loads: list[str], cmd: str, summary: list[str] | None = None) -> str:
    env = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("ONNXFORGE_PIPELINE__"))
    settings = f"pipeline settings from the environment: {', '.join(env)}" if env else "default pipeline settings"
    return "\n".join(
        [
            f"Command: `{cmd}`",
            "",
            machine_line(host_info(target="cpu", intra_op_threads=0), load=loads[0]),
            f"Load average after the run: {loads[-1]}.",
            "",
            f"No samples, target cpu, {settings}. Wall time of each process, start-up and imports included "
            "(the job's packages byte-compiled beforehand, as installed); each "
            f"model's peer, jobs in the order shown, one after the other. Issue 17's target: at most "
            f"{TARGET_RATIO:g}x the peer.",
            "",
            *(_summary(summary) if summary and len(summary) > 1 else []),
            "\n\n".join(sections),
        ]
    )


def _summary(rows: list[str]) -> list[str]:
    over = sum("**" in row or "| failed |" in row for row in rows)
    warm_over = sum(row.split("|")[7].strip().startswith("*") or "| failed |" in row for row in rows)
    return [
        f"Summary: {len(rows) - over} of {len(rows)} within {TARGET_RATIO:g}x as fresh processes (over in bold; a "
        f"failed job counts as over); {len(rows) - warm_over} of {len(rows)} within {TARGET_RATIO:g}x warm (over "
        "in italics), i.e. without process start-up and imports on either side, as a service's worker runs a job: "
        "the peer's optimize + benchmark against the job's pipeline duration (the report's `duration_s`).",
        "",
        *SUMMARY_HEAD,
        *rows,
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.job_time", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        nargs="+",
        default=["bert_mlm_loss"],
        help="bench models (bench/models.py) or corpus:ARCH/EXPORTER (tests/models/corpus.py, bench size)",
    )
    parser.add_argument("--before", metavar="REV", help="also time the job of this git revision (before figures)")
    parser.add_argument(
        "--after",
        metavar="REV",
        help="time this git revision's job as the after figures instead of the working tree (which holds other "
        "engineers' uncommitted changes on a shared checkout)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time the peer and each job this many times per model, the jobs' order alternating round by round; "
        "the table shows medians, and each round's ratio below it",
    )
    parser.add_argument("--no-write", action="store_true", help="print the table, leave bench/README.md alone")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="copy each job's report.json here")
    args = parser.parse_args(argv)
    cmd = "python -m bench.job_time " + shlex.join(argv if argv is not None else sys.argv[1:])
    models = [subject(name) for name in args.model]
    loads = [_load()]
    sections: list[str] = []
    summary: list[str] = []
    with tempfile.TemporaryDirectory(prefix="job-time-") as tmp:
        root = Path(tmp)
        trees: dict[str, Path] = {}
        if args.before:
            trees[f"before (`{args.before}`)"] = extract(args.before, root / "before")
        after = f"after (`{args.after}`)" if args.after else "after (this checkout)"
        trees[after] = extract(args.after, root / "after") if args.after else REPO
        for n, model in enumerate(models):
            peers: list[dict[str, Any]] = []
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
            for round_ in range(args.rounds):
                work = root / f"m{n}-r{round_}"
                work.mkdir()
                print(f"load {_load()}; {model.name}: peer ...", flush=True)
                peers.append(run_peer(model, work))
                order = list(trees) if round_ % 2 == 0 else list(reversed(trees))  # alternate: drift hits both
                for label in order:
                    print(f"load {_load()}; {model.name}: job {label} ...", flush=True)
                    slug = label.split(" ")[0]
                    try:
                        runs[label].append(run_job(model.path, work / f"out-{slug}", trees[label]))
                    except RuntimeError as exc:  # one failed job is a row of the table, not the end of a long run
                        runs[label].append({"failed": str(exc)})
                if args.keep:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    name = model.name.replace(":", "_").replace("/", "_")
                    suffix = f".r{round_}" if args.rounds > 1 else ""
                    for out in work.glob("out-*"):
                        if not (out / "report.json").exists():  # a failed job may have written none
                            continue
                        target = args.keep / f"{name}.{out.name.removeprefix('out-')}{suffix}.report.json"
                        shutil.copyfile(out / "report.json", target)
            peer, jobs = _median_run(peers), {label: _median_run(done, peers) for label, done in runs.items()}
            sections.append(
                render_model(model, peer=peer, jobs=jobs, rounds=(peers, runs) if args.rounds > 1 else None)
            )
            summary.append(_summary_row(model, peer, jobs[after]))
            print(sections[-1], flush=True)
        loads.append(_load())
    text = render(sections, loads=loads, cmd=cmd.strip(), summary=summary)
    print(text)
    if not args.no_write:
        write_blocks({(START, END): text}, heading=HEADING)
    return 0


if __name__ == "__main__":
    sys.exit(main())
