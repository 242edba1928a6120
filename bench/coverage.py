"""Coverage of the corpus under ``fast`` (issue 17 item 3): regenerates ``docs/coverage.md``.

Run ``python -m bench.coverage [--size tiny|bench] [--only ARCH ...] [--exporters E ...] [--max-seconds S]
[--job-benchmark-seconds S] [--no-write]``.

For every corpus model (``tests/models/corpus.py``: 27 models per exporter, built on demand into
``bench/out/corpus/<size>/`` and cached; the committed tiny subset is read from ``tests/models/corpus/``) and
exporter, it does what a new user does: ``onnxforge optimize MODEL -o OUT --preset fast`` in its own process,
no samples, no other option, the service's settings (``--job-benchmark-seconds`` lowers only the operator
setting ``ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS``, and the doc says so). From the job's report and files:

* job ok (exit status 0), exact (the final verification against the original, worst max abs diff), the passes
  applied, and the job's pipeline time;
* fusions expected/found, from the structure of the upload and of the returned model: attention (Softmax
  nodes before; ``Attention``/``MultiHeadAttention``/``GroupQueryAttention`` after), residual + norm (norms
  before: ``LayerNormalization`` plus RMS norms, ``ReduceMean`` of ``Pow(x, 2)``; ``SkipLayerNormalization``/
  ``SkipSimplifiedLayerNormalization`` after) and GELU (``Erf``/``Tanh`` before; ``Gelu``/``BiasGelu``/
  ``FastGelu`` after); ``fuse_transformer``'s own reason for each group it expected and missed;
* speedups of the returned model over ORT default (the upload under ``ORT_ENABLE_ALL``) and over ORT's
  transformers optimizer (``optimize_model`` with the corpus model type, heads and hidden size; none for
  decoders of the Llama kind, wav2vec2 and conv nets: it has no model type for them) at batch 1 / seq 64
  and batch 8 / seq 256 (``corpus.feeds``: vision and Whisper at their fixed size, wav2vec2 at 320 samples
  per step), timed in one process with 1 intra-op thread, interleaved blocks of one run of each variant in
  rotating order, ``--max-seconds`` per shape (at least ``--min-blocks`` blocks).

Results go to ``bench/out/coverage/<size>.json`` (merged by model: a subset run updates its rows) and the
table of each size that has results is rendered into ``docs/coverage.md``. Each row keeps the settings it was
timed with: the doc states those of most rows and lists the rows run otherwise (a subset re-timed for longer to
confirm a cell, say) on a line of their own, as it lists rows measured on another host. Where that file is
absent (it is not committed), a subset run reads the other rows back from ``docs/coverage.md`` and leaves them
as they were.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # bench scripts may run as files rather than with python -m
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402

from core.recipe import read_recipe  # noqa: E402
from core.verdict import slower_beyond_noise  # noqa: E402
from tests.models import corpus  # noqa: E402
from workers.benchmark import host_info  # noqa: E402
from workers.sessions import make_session  # noqa: E402

OUT = REPO / "bench" / "out" / "coverage"
DOC = REPO / "docs" / "coverage.md"
SHAPES = (("b1s64", 1, 64), ("b8s256", 8, 256))
VARIANTS = ("ort_default", "ort_transformers", "fast")
ATTENTION_OPS = ("Attention", "MultiHeadAttention", "GroupQueryAttention")
SKIP_NORM_OPS = ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization")
GELU_OPS = ("Gelu", "BiasGelu", "FastGelu", "QuickGelu", "GemmFastGelu")


# ------------------------------------------------------------------------------------------ structure


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def _rms_norms(model: onnx.ModelProto) -> int:
    """ReduceMean nodes whose input is Pow(x, 2) or Mul(x, x): the RMS norms of T5 and Llama-style models."""
    producer = {out: n for n in model.graph.node for out in n.output}
    found = 0
    for node in model.graph.node:
        if node.op_type != "ReduceMean" or not node.input:
            continue
        src = producer.get(node.input[0])
        if src is not None and (src.op_type == "Pow" or (src.op_type == "Mul" and src.input[0] == src.input[-1])):
            found += 1
    return found


def fusion_counts(original: onnx.ModelProto, returned: onnx.ModelProto) -> dict[str, dict[str, int]]:
    """Per group: ``expected`` (what the upload holds) and ``found`` (fused ops in the returned model)."""
    before, after = _ops(original), _ops(returned)
    return {
        "attention": {"expected": before["Softmax"], "found": sum(after[o] for o in ATTENTION_OPS)},
        "skip_norm": {
            "expected": before["LayerNormalization"] + _rms_norms(original),
            "found": sum(after[o] for o in SKIP_NORM_OPS),
        },
        "gelu": {"expected": before["Erf"] + before["Tanh"], "found": sum(after[o] for o in GELU_OPS)},
    }


# ------------------------------------------------------------------------------------------- building


def ensure_built(archs: list[str], exporters: list[str], size: str) -> dict[tuple[str, str], dict[str, Any]]:
    """The build record of every (arch, exporter): committed tiny files as they are, others from the cache,
    building what is missing in one child process (torch stays out of this one, which times)."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    missing: set[str] = set()
    for arch in archs:
        for exporter in exporters:
            if size == "tiny" and arch in corpus.COMMITTED:
                info = corpus.cached(arch, exporter, size, corpus.COMMITTED_DIR)
                if info is not None:
                    found[arch, exporter] = info
                    continue
            info = corpus.cached(arch, exporter, size)
            if info is None:
                missing.add(arch)
            else:
                found[arch, exporter] = info
    if missing:
        cmd = [sys.executable, "-m", "tests.models.corpus", "--size", size, "--reuse", "--only", *sorted(missing)]
        cmd += ["--exporters", *exporters]
        print("building:", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
        for arch in missing:
            for exporter in exporters:
                info = corpus.cached(arch, exporter, size)
                if info is None:
                    raise RuntimeError(f"the corpus builder left no record for {arch}/{exporter} ({size})")
                found[arch, exporter] = info
    return found


def _ort_transformers(arch: str, size: str, src: Path, dst: Path) -> dict[str, Any]:
    spec, dims = corpus.ARCHS[arch], corpus.DIMS[size]
    if spec.ort_model_type is None:
        return {"model_type": None, "error": "no model type for this architecture"}
    from onnxruntime.transformers.optimizer import optimize_model

    try:
        optimized = optimize_model(
            str(src), model_type=spec.ort_model_type, num_heads=dims.heads, hidden_size=dims.hidden
        )
        optimized.save_model_to_file(str(dst))
        fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
    except Exception as exc:  # its failure on an export is a finding of the table
        return {"model_type": spec.ort_model_type, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return {"model_type": spec.ort_model_type, "fused": fused, "path": str(dst)}


# ------------------------------------------------------------------------------------------------ jobs


def run_job(src: Path, work: Path, benchmark_seconds: float | None, timeout: float) -> dict[str, Any]:
    """``onnxforge optimize SRC --preset fast`` in a child process, as a user runs it."""
    out, report = work / "fast.onnx", work / "report.json"
    env = dict(os.environ)
    if benchmark_seconds is not None:
        env["ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS"] = str(benchmark_seconds)
    cmd = [sys.executable, "-c", "import sys; from onnxforge.cli import main; sys.exit(main())"]
    cmd += ["optimize", str(src), "-o", str(out), "--preset", "fast", "--report", str(report)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "wall_s": timeout}
    wall = time.perf_counter() - started
    if proc.returncode != 0 or not report.exists():
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
        return {"ok": False, "error": (lines[-1] if lines else f"exit {proc.returncode}")[:400], "wall_s": wall}
    rep = json.loads(report.read_text())
    verification = rep.get("verification") or {}
    worst = max((o.get("max_abs") or 0.0 for o in verification.get("outputs", [])), default=0.0)
    applied = []
    for p in rep["passes"]:
        if p["status"] == "applied" and p["name"] not in applied:
            applied.append(p["name"])
    fuse = next((p for p in rep["passes"] if p["name"] == "fuse_transformer"), None)
    notes = (fuse or {}).get("notes") or {}
    return {
        "ok": True,
        "path": str(out),
        "exact": bool(verification.get("ok")),
        "max_abs": worst,
        "applied": applied,
        "failed_passes": [f"{p['name']}: {p['reason']}" for p in rep["passes"] if p["status"] == "failed"],
        "decision": rep["decision"]["result"],
        "decision_reason": rep["decision"]["reason"],
        "gate_speedup": rep["decision"]["gate"].get("speedup"),
        "fuse_transformer": {
            "status": (fuse or {}).get("status"),
            "family": notes.get("family"),
            "expected": notes.get("expected"),
            "achieved": notes.get("achieved"),
            "missing": notes.get("missing"),
            "reason": (fuse or {}).get("reason"),
        },
        "input_sets": [s["name"] for s in rep.get("input_sets", [])],
        "job_s": rep["duration_s"],
        "wall_s": wall,
    }


# ---------------------------------------------------------------------------------------------- timing


def interleave(sessions: dict[str, Any], feeds: dict[str, np.ndarray], max_seconds: float, min_blocks: int) -> dict:
    """ms per variant per block; the order rotates by one each block so no variant always runs first."""
    keys = list(sessions)
    per = {k: {i.name: feeds[i.name] for i in s.get_inputs()} for k, s in sessions.items()}
    for k in keys:  # warm up: first runs allocate
        sessions[k].run(None, per[k])
    times: dict[str, list[float]] = {k: [] for k in keys}
    start, block = time.perf_counter(), 0
    while block < min_blocks or time.perf_counter() - start < max_seconds:
        shift = block % len(keys)
        for k in keys[shift:] + keys[:shift]:
            t0 = time.perf_counter_ns()
            sessions[k].run(None, per[k])
            times[k].append((time.perf_counter_ns() - t0) / 1e6)
        block += 1
    return times


def time_variants(
    arch: str, size: str, paths: dict[str, Path], max_seconds: float, min_blocks: int
) -> dict[str, dict[str, Any]]:
    sessions = {
        k: make_session(p, intra_op_threads=1, optimize=True, recipe=read_recipe(p) if k == "fast" else None)
        for k, p in paths.items()
    }
    found: dict[str, dict[str, Any]] = {}
    for label, batch, seq in SHAPES:
        times = interleave(sessions, corpus.feeds(arch, size, batch, seq, seed=1), max_seconds, min_blocks)
        entry: dict[str, Any] = {"blocks": len(times["ort_default"])}
        entry["p50_ms"] = {k: float(np.median(t)) for k, t in times.items()}
        for base in ("ort_default", "ort_transformers"):
            if base in times and "fast" in times:
                v = slower_beyond_noise(times[base], times["fast"])
                entry[f"fast_vs_{base}"] = {"speedup": v.speedup, "slower": v.slower, "faster": v.faster}
        if "ort_transformers" in times:
            v = slower_beyond_noise(times["ort_default"], times["ort_transformers"])
            entry["ort_transformers_vs_ort_default"] = {"speedup": v.speedup}
        found[label] = entry
    return found


def run_row(arch: str, exporter: str, size: str, build: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"arch": arch, "exporter": exporter, "size": size}
    row["build"] = {
        k: build.get(k) for k in ("ok", "error", "nodes", "bytes", "max_abs_vs_torch", "attn_implementation")
    }
    if not build.get("ok"):
        return row
    src = Path(build["path"])
    with tempfile.TemporaryDirectory(prefix="coverage-") as tmp:
        work = Path(tmp)
        job = run_job(src, work, args.job_benchmark_seconds, args.job_timeout)
        row["job"] = {k: v for k, v in job.items() if k != "path"}
        if not job["ok"]:
            return row
        returned = Path(job["path"])
        row["fusions"] = fusion_counts(onnx.load(str(src)), onnx.load(str(returned)))
        tr = _ort_transformers(arch, size, src, work / "ort_transformers.onnx")
        row["ort_transformers"] = {k: v for k, v in tr.items() if k != "path"}
        paths = {"ort_default": src, "fast": returned}
        if "path" in tr:
            paths = {"ort_default": src, "ort_transformers": Path(tr["path"]), "fast": returned}
        try:
            row["timing"] = time_variants(arch, size, paths, args.max_seconds, args.min_blocks)
        except Exception as exc:  # a variant that cannot run at the benchmark shapes is a finding
            row["timing_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


# ------------------------------------------------------------------------------------------- rendering


def _fmt_speed(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "-"
    mark = " (slower)" if entry.get("slower") else ""
    return f"{entry['speedup']:.2f}x{mark}"


def _frac(group: dict[str, int]) -> str:
    if not group["expected"]:
        return str(group["found"]) if group["found"] else "-"
    return f"{group['found']}/{group['expected']}"


def _geomean(values: list[float]) -> float | None:
    return float(np.exp(np.mean(np.log(values)))) if values else None


def _row_cells(r: dict[str, Any]) -> list[str]:
    if "cells" in r:  # a row read back from docs/coverage.md (``rows_from_doc``): rendered as it was
        return list(r["cells"])
    build, job = r["build"], r.get("job")
    cells = [r["arch"], r["exporter"]]
    if not build.get("ok"):
        return [*cells, "export failed (below)", *["-"] * 10]
    if not job or not job["ok"]:
        return [*cells, "**failed** (below)", *["-"] * 10]
    exact = f"yes ({job['max_abs']:.0e})" if job["exact"] else f"**no** ({job['max_abs']:.1e})"
    kept = "" if job["decision"] == "optimized" else f" ({job['decision']} returned)"
    applied = ", ".join(job["applied"]) or "none"
    f = r["fusions"]
    timing = r.get("timing") or {}
    speeds = []
    for label, *_ in SHAPES:
        t = timing.get(label) or {}
        speeds += [_fmt_speed(t.get("fast_vs_ort_default")), _fmt_speed(t.get("fast_vs_ort_transformers"))]
    return [
        *cells,
        "ok" + kept,
        exact,
        applied,
        _frac(f["attention"]),
        _frac(f["skip_norm"]),
        _frac(f["gelu"]),
        *speeds,
        f"{job['job_s']:.0f}",
    ]


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | exporter | job | exact (max abs) | passes applied | attention | skip+norm | gelu "
        "| vs ORT default b1/s64 | vs ORT transformers b1/s64 | vs ORT default b8/s256 "
        "| vs ORT transformers b8/s256 | job s |\n" + "|---" * 13 + "|\n"
    )
    return head + "\n".join("| " + " | ".join(_row_cells(r)) + " |" for r in rows) + "\n"


def _summary(rows: list[dict[str, Any]]) -> str:
    built = [r for r in rows if r["build"].get("ok")]
    done = [r for r in built if (r.get("job") or {}).get("ok")]
    exact = [r for r in done if r["job"]["exact"]]
    transformers = [r for r in done if r["fusions"]["attention"]["expected"]]
    fused = [r for r in transformers if r["fusions"]["attention"]["found"]]
    lines = [
        f"* {len(rows)} model x exporter pairs; {len(built)} exported and checked against torch; "
        f"{len(done)} `fast` jobs completed, {len(exact)} exact.",
        f"* Attention fused in {len(fused)} of the {len(transformers)} completed jobs with attention "
        f"({sum(r['fusions']['attention']['found'] for r in done)} of "
        f"{sum(r['fusions']['attention']['expected'] for r in done)} Softmax blocks).",
    ]
    for label, *_ in SHAPES:
        for base in ("ort_default", "ort_transformers"):
            # The cells as the table shows them (2 decimals): the doc read back on a fresh checkout, whose
            # results are not committed, gives the same mean (a mean of unrounded ones read 1.37x, back 1.38x).
            vals = [
                round(r["timing"][label][f"fast_vs_{base}"]["speedup"], 2)
                for r in done
                if r.get("timing") and f"fast_vs_{base}" in r["timing"].get(label, {})
            ]
            slower = sum(
                1
                for r in done
                if r.get("timing") and r["timing"].get(label, {}).get(f"fast_vs_{base}", {}).get("slower")
            )
            g = _geomean(vals)
            if g is not None:
                what = "ORT default" if base == "ort_default" else "ORT's transformers optimizer"
                lines.append(
                    f"* {label}: `fast` over {what}: geometric mean {g:.2f}x over {len(vals)} models, slower "
                    f"beyond noise on {slower}."
                )
    return "\n".join(lines) + "\n"


def _findings(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        if "findings" in r:  # read back from the doc with its row
            out += r["findings"]
            continue
        name = f"`{r['arch']}` / `{r['exporter']}`"
        if not r["build"].get("ok"):
            out.append(f"* {name}: export not made: {' '.join(str(r['build']['error']).split())[:400]}")
            continue
        job = r.get("job") or {}
        if not job.get("ok"):
            out.append(f"* {name}: job failed: {' '.join(str(job.get('error')).split())[:400]}")
            continue
        for failure in job.get("failed_passes") or []:
            out.append(f"* {name}: pass failed (rolled back, the job went on): {' '.join(failure.split())[:300]}")
        if r.get("timing_error"):
            out.append(f"* {name}: not timed: {r['timing_error']}")
        tr = r.get("ort_transformers") or {}
        if tr.get("error") and tr.get("model_type"):
            out.append(f"* {name}: ORT transformers optimizer ({tr['model_type']}) failed: {tr['error']}")
        missing = (job.get("fuse_transformer") or {}).get("missing") or {}
        if "attention" in missing and r["fusions"]["attention"]["expected"]:
            reason = " ".join(str(missing["attention"]).split())[:300]
            out.append(f"* {name}: attention not fused: {reason}")
        elif r["fusions"]["attention"]["expected"] and not r["fusions"]["attention"]["found"]:
            ft = job.get("fuse_transformer") or {}
            # the gate's hand-back of the upload explains a fusion absent from the returned model; the pass's
            # own reason then says only that it applied
            returned = job.get("decision") not in (None, "optimized") and job.get("decision_reason")
            why = (f"the job returned the upload: {returned}" if returned else None) or ft.get("reason")
            why = why or "no reason recorded"
            out.append(f"* {name}: attention not in the returned model: {' '.join(str(why).split())[:600]}")
    return "\n".join(out) + "\n" if out else "None.\n"


def _settings(data: dict[str, Any]) -> str:
    """The job and timing settings of a run, as the doc states them (and ``rows_from_doc`` reads them back)."""
    bench_s = data.get("job_benchmark_seconds")
    jobs = (
        "service defaults"
        if bench_s is None
        else f"service defaults except `ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS={bench_s:g}`"
    )
    return (
        f"Jobs: {jobs}. Timing: 1 intra-op thread, {data['max_seconds']:g} s per shape, at least "
        f"{data['min_blocks']} interleaved blocks"
    )


def _section(size: str, data: dict[str, Any]) -> str:
    rows = [data["rows"][k] for k in sorted(data["rows"], key=_order)]
    m = data["machine"]
    purpose = (
        "pass coverage: the models are tiny, so the speed columns say little"
        if size == "tiny"
        else "speed at realistic (small) sizes"
    )
    commands = "; ".join(f"`{c}`" for c in data["commands"])
    absent = [f"{a}/{e}" for a in corpus.ARCHS for e in corpus.EXPORTERS if f"{a}/{e}" not in data["rows"]]
    not_run = f"Not run in this table ({len(absent)}): {', '.join(absent)}.\n\n" if absent else ""
    # rows read back from the doc may have been measured on another host: the Machine line names the host of
    # most rows, and a line per other host lists its rows
    current = _machine(m)
    hosts: dict[str, list[str]] = {}
    for r in rows:
        hosts.setdefault(r.get("machine") or current, []).append(f"{r['arch']}/{r['exporter']}")
    machine = max(hosts, key=lambda d: (len(hosts[d]), d == current), default=current)
    others = "".join(f"Measured on {d}: {', '.join(keys)}.\n\n" for d, keys in hosts.items() if d != machine)
    # likewise the settings: a subset re-timed longer (a cell to confirm) says so instead of lending the whole
    # table its settings; only timed rows count (the others have no speed to qualify)
    ran = _settings(data)
    runs: dict[str, list[str]] = {}
    for r in rows:
        if r.get("timing"):
            runs.setdefault(r.get("settings") or ran, []).append(f"{r['arch']}/{r['exporter']}")
    settings = max(runs, key=lambda d: (len(runs[d]), d == ran), default=ran)
    others += "".join(
        f"Run with other settings ({d}): {', '.join(keys)}.\n\n" for d, keys in runs.items() if d != settings
    )
    return (
        f"## {size} ({purpose})\n\n"
        f"Command(s): {commands}\n\n"
        f"Machine: {machine}; corpus built with "
        f"{', '.join(f'{k} {v}' for k, v in data['build_versions'].items())}. {settings}. "
        f"Written {data['written']}.\n\n"
        f"{others}"
        f"{_table(rows)}\n"
        f"{_summary(rows)}\n"
        f"{not_run}"
        f"### Findings ({size})\n\n{_findings(rows)}\n"
    )


def _machine(m: dict[str, Any]) -> str:
    return (
        f"{m['cpu_model']}, {m['cpus_available']} CPUs (shared with other work), {m['memory_total_mb'] // 1024} GiB; "
        f"{m['platform']}; Python {m['python']}; onnxruntime {m['onnxruntime_version']} (CPU EP), onnx "
        f"{m['onnx_version']}"
    )


def _order(key: str) -> tuple[int, int]:
    arch, exporter = key.split("/")
    return list(corpus.ARCHS).index(arch), corpus.EXPORTERS.index(exporter)


HEADER = """# Corpus coverage under `fast`

Generated by `bench/coverage.py` (do not edit by hand): every model of the corpus (`tests/models/corpus.py`:
27 models per exporter from 25 transformers architectures (CLIP's towers, DeBERTa-v2 and -v3 apart), built from
config objects with random, perturbed weights) exported three ways (TorchScript with eager attention,
TorchScript with SDPA, the dynamo exporter), each sent through `onnxforge optimize MODEL --preset fast` as a new
user does (no samples, no options). Columns: the job's outcome (and whether the upload came back), exact
(final verification against the original, worst max abs difference), the passes applied, fused/expected
counts in the returned model (attention: fused attention ops / Softmax nodes of the upload; skip+norm:
`Skip*LayerNormalization` / LayerNorm and RMS norms of the upload; gelu: fused GELU ops / `Erf` and `Tanh`
nodes), the returned model's speedup over the upload under ORT's default level and over ORT's transformers
optimizer (`-` where it has no model type for the architecture), and the job's pipeline seconds. On CPU
`fast` ends with `unfuse_skip_layernorm`, which undoes residual + norm fusions the session runs slower, so
skip+norm may read 0 by design. The tiny subset in `tests/models/corpus/` is re-run by
`tests/test_coverage.py`, which fails if a fusion counted here stops firing. One cell is one short interleaved
timing on a shared host: on these tiny models a second session of the same file runs up to 5% apart, and 1 s
per shape under load has read 0.59x and 4.63x for cells that re-time at about 1.2x; re-time a cell with
`python -m bench.coverage_ab ARCH EXPORTER` (bench/README.md) before reading it as a regression.

"""


def _doc_section(size: str, text: str) -> str | None:
    """The ``size`` section of the doc as it stands, from its heading to the next size's (or the end)."""
    start = text.find(f"\n## {size} ")
    if start < 0:
        return None
    end = text.find("\n## ", start + 1)
    return text[start + 1 : end + 1 if end > 0 else None]


def render() -> str:
    """The doc: each size with saved results rendered from them; a size without (its results are not committed,
    and a run of the other size must not drop it) kept as the doc has it."""
    current = DOC.read_text() if DOC.exists() else ""
    sections = []
    for size in corpus.SIZES:
        path = OUT / f"{size}.json"
        if path.exists():
            sections.append(_section(size, json.loads(path.read_text())).rstrip("\n") + "\n")  # as a kept one
        elif (kept := _doc_section(size, current)) is not None:
            sections.append(kept.rstrip("\n") + "\n")
    return HEADER + "\n".join(sections)


# ------------------------------------------------------------------------------------- the doc as a seed


def _speed_cell(cell: str) -> dict[str, Any] | None:
    if not cell.endswith("x") and not cell.endswith("(slower)"):
        return None
    return {"speedup": float(cell.split("x", maxsplit=1)[0]), "slower": cell.endswith("(slower)")}


def _fraction_cell(cell: str) -> dict[str, int]:
    if "/" in cell:
        found, expected = cell.split("/")
        return {"found": int(found), "expected": int(expected)}
    return {"found": int(cell) if cell.isdigit() else 0, "expected": 0}


def rows_from_doc(size: str, text: str) -> dict[str, Any] | None:
    """The ``size`` section of docs/coverage.md read back as saved results: each row keeps its rendered cells
    and findings, with the outcome, fusion counts and speedups the summary needs (speedups as rounded in the
    doc). A subset run (``--only``) on a checkout without ``bench/out/coverage/<size>.json`` (it is not
    committed) merges into these instead of rendering a table of the subset alone; None without a section."""
    start = text.find(f"\n## {size} ")
    if start < 0:
        return None
    end = text.find("\n## ", start + 1)
    section = text[start : end if end > 0 else None]
    commands: list[str] = []
    machine = ""
    hosts: dict[str, str] = {}  # row -> the host it was measured on, where not the Machine line's
    settings = ""
    run_with: dict[str, str] = {}  # row -> its job and timing settings, where not the Machine line's
    rows: dict[str, Any] = {}
    findings: dict[str, list[str]] = {}
    for line in section.splitlines():
        if line.startswith("Command(s): "):
            commands = [c[1:-1] for c in line[len("Command(s): ") :].split("; ")]
        elif line.startswith("Machine: ") and "; corpus built with" in line:
            machine = line[len("Machine: ") : line.index("; corpus built with")]
            if ". Jobs: " in line and ". Written " in line:
                settings = line[line.index(". Jobs: ") + 2 : line.rindex(". Written ")]
        elif line.startswith("Measured on ") and line.endswith("."):
            desc, keys = line[len("Measured on ") : -1].rsplit(": ", 1)
            hosts.update(dict.fromkeys(keys.split(", "), desc))
        elif line.startswith("Run with other settings (") and line.endswith("."):
            desc, keys = line[len("Run with other settings (") : -1].rsplit("): ", 1)
            run_with.update(dict.fromkeys(keys.split(", "), desc))
        elif line.startswith("* `") and "` / `" in line:
            arch, rest = line[3:].split("` / `", 1)
            findings.setdefault(f"{arch}/{rest.split('`', 1)[0]}", []).append(line)
        elif line.startswith("| ") and not line.startswith("| model "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) != 13 or cells[0] not in corpus.ARCHS or cells[1] not in corpus.EXPORTERS:
                continue
            row: dict[str, Any] = {"arch": cells[0], "exporter": cells[1], "size": size, "cells": cells}
            row["findings"] = []
            row["build"] = {"ok": cells[2] != "export failed (below)"}
            if cells[2].startswith("ok"):
                row["job"] = {"ok": True, "exact": cells[3].startswith("yes")}
                row["fusions"] = {g: _fraction_cell(cells[i]) for g, i in (("attention", 5), ("skip_norm", 6))}
                row["fusions"]["gelu"] = _fraction_cell(cells[7])
                row["timing"] = {}
                for j, (label, *_) in enumerate(SHAPES):
                    entry = {}
                    for k, base in enumerate(("ort_default", "ort_transformers")):
                        speed = _speed_cell(cells[8 + 2 * j + k])
                        if speed is not None:
                            entry[f"fast_vs_{base}"] = speed
                    row["timing"][label] = entry
            elif row["build"]["ok"]:
                row["job"] = {"ok": False}
            rows[f"{cells[0]}/{cells[1]}"] = row
    for key, lines in findings.items():
        if key in rows:
            rows[key]["findings"] = lines
    for key, row in rows.items():  # where they were measured: a subset run on another host says so
        row["machine"] = hosts.get(key, machine)
        if settings and row.get("timing"):
            row["settings"] = run_with.get(key, settings)
    return {"rows": rows, "commands": commands} if rows else None


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.coverage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=corpus.SIZES, default="tiny")
    parser.add_argument("--only", nargs="+", choices=sorted(corpus.ARCHS), help="architectures (default: all)")
    parser.add_argument("--exporters", nargs="+", choices=corpus.EXPORTERS, default=list(corpus.EXPORTERS))
    parser.add_argument("--max-seconds", type=float, default=2.0, help="timing per model and shape (default 2)")
    parser.add_argument("--min-blocks", type=int, default=5)
    parser.add_argument(
        "--job-benchmark-seconds",
        type=float,
        default=None,
        help="ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS for the jobs (default: the service's setting)",
    )
    parser.add_argument("--job-timeout", type=float, default=1800.0)
    parser.add_argument("--no-write", action="store_true", help="do not write docs/coverage.md")
    parser.add_argument("--render", action="store_true", help="only rewrite docs/coverage.md from saved results")
    args = parser.parse_args(argv)
    archs = args.only or list(corpus.ARCHS)
    command = "python -m bench.coverage" + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:]))
    if args.render:
        DOC.write_text(render())
        print(f"wrote {DOC}")
        return 0
    if args.size == "tiny":  # the committed subset first: its rows are what tests/test_coverage.py holds to
        archs = [a for a in archs if a in corpus.COMMITTED] + [a for a in archs if a not in corpus.COMMITTED]

    path = OUT / f"{args.size}.json"
    full_run = not args.only and len(args.exporters) == len(corpus.EXPORTERS)
    data: dict[str, Any] = {"rows": {}, "commands": []}
    if path.exists() and not full_run:
        data = json.loads(path.read_text())
    elif not full_run and DOC.exists():  # a fresh checkout: the doc is the only record of the other rows
        data = rows_from_doc(args.size, DOC.read_text()) or data
    data["commands"] = [*[c for c in data["commands"] if c != command], command]
    if "max_seconds" in data:  # rows saved before this run keep the settings they were timed with
        for row in data["rows"].values():
            if row.get("timing"):
                row.setdefault("settings", _settings(data))
    data["machine"] = host_info(target="cpu", intra_op_threads=1)
    data.update(max_seconds=args.max_seconds, min_blocks=args.min_blocks)
    data["job_benchmark_seconds"] = args.job_benchmark_seconds
    path.parent.mkdir(parents=True, exist_ok=True)
    for arch in archs:
        builds = ensure_built([arch], args.exporters, args.size)  # one arch at a time: rows appear early
        for exporter in args.exporters:
            build = builds[arch, exporter]
            data["build_versions"] = {k: v for k, v in build["versions"].items() if k in ("torch", "transformers")}
            t0 = time.perf_counter()
            row = run_row(arch, exporter, args.size, build, args)
            row["machine"] = _machine(data["machine"])
            if row.get("timing"):
                row["settings"] = _settings(data)
            data["rows"][f"{arch}/{exporter}"] = row
            data["written"] = time.strftime("%Y-%m-%d %H:%M %Z")
            path.write_text(json.dumps(data, indent=1, default=str))  # a long run keeps what it measured
            print(f"{arch:16s} {exporter:9s} {time.perf_counter() - t0:6.1f}s  " + " | ".join(_row_cells(row)[2:]))
    if not args.no_write:
        DOC.write_text(render())
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
