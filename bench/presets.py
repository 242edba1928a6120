"""Benchmark of the presets (issue 5): onnxforge ``fast`` and ``int8`` against what users reach for today.

Run ``python -m bench.presets [--models NAME ...] [--threads N ...] [--quick] [--no-write]``.

Every bench model (``bench/models.py``) at batch 1, sequence 128, no padding (``bert_mlm_loss``: every label
valid, the model as exported, loss and logits), in ONE process run, as these variants:

=================  =====================================================================================
ort_default        the export under ORT's default level (``ORT_ENABLE_ALL``): the baseline of every ratio
ort_transformers   ``onnxruntime.transformers.optimizer.optimize_model`` with its defaults for the family
                   (model_type from ``passes.fusion._fusion_families``; heads and hidden size from the graph)
onnxsim            ``onnxsim.simplify`` with its defaults
ort_int8           ORT ``quantize_dynamic`` with its defaults on ort_transformers' output: the int8 baseline
fast, int8         the onnxforge preset's passes applied in order (``passes.registry.build_passes``, as
                   ``bench/seed_passes.py`` does) with the benchmark feeds as ``PassContext(samples=...)``;
                   a ``tune_session`` recipe in the result is applied to its session as
                   ``core.runtime.load`` applies it (``workers.verify.make_session(recipe=...)``)
=================  =====================================================================================

**Verified**: each variant's session (as timed) runs the benchmark feeds; every float output is compared with
the original under ``ORT_DISABLE_ALL``: max abs error, plus relative L2 error and cosine for the lossy ones,
and the ``EXACT_TOLERANCE`` check for the exact ones.

**Timed** as ``workers.benchmark.compare`` times two models, widened to all six: every session alive in one
process, ``--warmup`` untimed runs each, then blocks of one run of each variant whose order rotates by one
each block (every variant in every position equally often, never twice in a row), at least
``--min-blocks`` blocks and more while ``--max-seconds`` lasts. A speedup is median(baseline) /
median(variant); the paired speedup is the median of the per-block ratios with its bootstrap 95% interval
(``workers.benchmark.slower_beyond_noise``, whose verdict also says "slower beyond noise"). Intra-op
threads per model (``DEFAULT_THREADS``) unless ``--threads`` gives them; inter-op 1.

The tables are printed and written into ``bench/README.md`` between the ``presets-table`` markers
(``--no-write`` to skip); raw timings and errors go to ``bench/out/presets/results.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402
import onnx_ir as ir  # noqa: E402

from bench._report import unmarked, write_blocks  # noqa: E402
from bench.models import BENCH_MODELS, ensure_bench_model, make_inputs  # noqa: E402
from core.config import EXACT_TOLERANCE  # noqa: E402
from core.recipe import read_recipe  # noqa: E402
from core.verdict import LatencyStats, slower_beyond_noise  # noqa: E402
from passes._infra import PassContext  # noqa: E402
from passes.fusion import _fusion_families as fam  # noqa: E402
from passes.precision._accuracy import compare_arrays  # noqa: E402
from passes.registry import build_passes, get_preset  # noqa: E402
from workers.benchmark import host_info  # noqa: E402
from workers.sessions import make_session  # noqa: E402
from workers.verify import compare_output  # noqa: E402

OUT = REPO / "bench" / "out" / "presets"
TABLE_START = "<!-- presets-table:start -->"
TABLE_END = "<!-- presets-table:end -->"
BATCH, SEQ = 1, 128
VARIANTS = ("ort_default", "ort_transformers", "onnxsim", "fast", "ort_int8", "int8")
LOSSY = frozenset({"ort_int8", "int8"})
QUICK_MODELS = ("minilm", "bert_base")
# Measured on the 2-CPU bench machine: MiniLM (hidden 384) at batch 1 is faster on one thread (its GEMMs
# are too small to split), the hidden-768 models on two.
DEFAULT_THREADS = {"minilm": 1}


@dataclasses.dataclass
class Variant:
    key: str
    path: Path
    build_seconds: float = 0.0
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def recipe(self) -> dict[str, Any] | None:
        return read_recipe(self.path)


# ---------------------------------------------------------------------------------------- building


def _ort_transformers(src: Path, dst: Path) -> dict[str, Any]:
    from onnxruntime.transformers.optimizer import optimize_model

    model = ir.load(src)
    family, evidence = fam.detect_family(model)
    heads, hidden = fam.detect_sizes(model)
    if not (heads and hidden):  # ORT asserts both given or both 0 (it then detects them itself)
        heads = hidden = 0
    del model
    model_type = fam.ORT_MODEL_TYPE.get(family, "bert")
    optimized = optimize_model(str(src), model_type=model_type, num_heads=heads, hidden_size=hidden)
    optimized.save_model_to_file(str(dst))
    fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
    return {"family": family, "evidence": evidence, "model_type": model_type, "fused": fused}


def _onnxsim(src: Path, dst: Path) -> dict[str, Any]:
    import onnxsim

    simplified, ok = onnxsim.simplify(onnx.load(str(src)))
    onnx.save(simplified, str(dst))
    return {"check_ok": bool(ok), "nodes": len(simplified.graph.node)}


def _ort_int8(src: Path, dst: Path) -> dict[str, Any]:
    from onnxruntime.quantization import quantize_dynamic

    notes: dict[str, Any] = {"op_types": "ORT defaults", "weight_type": "QInt8"}
    try:
        quantize_dynamic(src, dst)  # ORT's defaults: QInt8 weights, every op type it knows, per tensor
    except RuntimeError as exc:
        # GPT-2 after the transformers optimizer: "Unable to find data type for weight_name=..."; ORT's message
        # names the fix, which is what a user would do next.
        notes["defaults_failed"] = str(exc)[:300]
        notes["extra_options"] = {"DefaultTensorType": "FLOAT"}
        quantize_dynamic(src, dst, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    return notes


_KEPT_NOTES = ("decision", "chosen", "achieved", "missing", "attention_mode", "accuracy", "excluded", "budget")


def _preset(name: str, src: Path, dst: Path, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    """Apply the preset's passes in order (specs with their options), as bench/seed_passes.py does."""
    model = ir.serde.deserialize_model(onnx.load(str(src)))
    ctx = PassContext(samples=[feeds], target="cpu")
    log = []
    for p in build_passes(get_preset(name).specs):
        start = time.perf_counter()
        result = p(model, ctx)
        model = result.model
        entry = {"pass": p.name, "modified": result.modified, "seconds": round(time.perf_counter() - start, 2)}
        entry["counts"] = {k: v for k, v in result.counts.items() if v}
        entry["notes"] = {k: v for k, v in result.notes.items() if k in _KEPT_NOTES}
        log.append(entry)
    ir.save(model, dst)
    return {"passes": log}


def build(name: str, src: Path, feeds: dict[str, np.ndarray], reuse: bool) -> dict[str, Variant]:
    """Every variant's file (in OUT/<name>/), rebuilt unless ``reuse`` and it was built from this source."""
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    source = f"{src.stat().st_size}:{src.stat().st_mtime_ns}"
    variants = {"ort_default": Variant("ort_default", src)}
    steps = {
        "ort_transformers": lambda dst: _ort_transformers(src, dst),
        "onnxsim": lambda dst: _onnxsim(src, dst),
        "ort_int8": lambda dst: _ort_int8(variants["ort_transformers"].path, dst),
        "fast": lambda dst: _preset("fast", src, dst, feeds),
        "int8": lambda dst: _preset("int8", src, dst, feeds),
    }
    for key, step in steps.items():
        dst = folder / f"{key}.onnx"
        stamp = folder / f"{key}.json"
        if reuse and dst.exists() and stamp.exists():
            saved = json.loads(stamp.read_text())
            if saved.get("source") == source:
                variants[key] = Variant(key, dst, saved["build_seconds"], saved["notes"])
                continue
        print(f"   building {key} ...", flush=True)
        start = time.perf_counter()
        notes = step(dst)
        seconds = round(time.perf_counter() - start, 1)
        stamp.write_text(json.dumps({"source": source, "build_seconds": seconds, "notes": notes}, default=str))
        variants[key] = Variant(key, dst, seconds, notes)
        gc.collect()
    return variants


# ---------------------------------------------------------------------------------------- checking


def verify(src: Path, sessions: dict[str, Any], feeds: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """Per variant and float output: max abs error against the original under ORT_DISABLE_ALL (plus rel L2
    and cosine), and whether it is exact within ``EXACT_TOLERANCE``."""
    reference = make_session(src, optimize=False)
    names = [o.name for o in reference.get_outputs()]
    expected = dict(zip(names, reference.run(None, _feeds_for(reference, feeds)), strict=True))
    del reference
    found: dict[str, dict[str, Any]] = {}
    for key, session in sessions.items():
        names_got = [o.name for o in session.get_outputs()]
        got = dict(zip(names_got, session.run(None, _feeds_for(session, feeds)), strict=True))
        outputs, exact = {}, True
        for name, ref in expected.items():
            if name not in got or np.asarray(ref).dtype.kind != "f":
                continue
            acc = compare_arrays(np.asarray(ref), np.asarray(got[name]))
            ok = compare_output("b1 s128", name, ref, got[name], EXACT_TOLERANCE).ok
            exact = exact and ok
            outputs[name] = {"max_abs": acc.max_abs, "rel_l2": acc.rel_l2, "cosine": acc.cosine, "exact": ok}
        found[key] = {"outputs": outputs, "exact": exact}
    return found


def _feeds_for(session: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {i.name: feeds[i.name] for i in session.get_inputs()}


# ------------------------------------------------------------------------------------------ timing


def interleave(sessions: dict[str, Any], feeds: dict[str, np.ndarray], args: argparse.Namespace) -> dict[str, list]:
    """Blocks of one run per variant; returns ms per variant per block.

    The order rotates by one each block, so every variant runs in every position equally often and no variant
    ever runs twice in a row (with six variants, alternating forward/reverse would run the two end variants
    back to back at every block boundary, with their caches and thread pool warm)."""
    keys = list(sessions)
    per = {k: _feeds_for(s, feeds) for k, s in sessions.items()}
    for _ in range(args.warmup):
        for k in keys:
            sessions[k].run(None, per[k])
    times: dict[str, list[float]] = {k: [] for k in keys}
    start, block = time.perf_counter(), 0
    while True:
        shift = block % len(keys)
        for k in keys[shift:] + keys[:shift]:
            t0 = time.perf_counter_ns()
            sessions[k].run(None, per[k])
            times[k].append((time.perf_counter_ns() - t0) / 1e6)
        block += 1
        if block >= args.max_blocks or (block >= args.min_blocks and time.perf_counter() - start >= args.max_seconds):
            return times


def _ratio(base_ms: Sequence[float], ms: Sequence[float]) -> dict[str, Any]:
    """Speedup of ``ms`` over ``base_ms``: medians, paired median with its bootstrap interval, the verdict."""
    v = slower_beyond_noise(base_ms, ms)
    return {
        "speedup": v.speedup,
        "paired": 1.0 / v.paired_ratio,
        "ci95": [1.0 / v.ci95[1], 1.0 / v.ci95[0]],
        "slower": v.slower,
        "faster": v.faster,
        "margin": v.margin,
    }


def run_model(name: str, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    src = ensure_bench_model(name)
    feeds = make_inputs(name, BATCH, SEQ, seed=args.seed)
    variants = build(name, src, feeds, args.reuse)
    sessions = {
        k: make_session(v.path, intra_op_threads=threads, optimize=True, recipe=v.recipe) for k, v in variants.items()
    }
    check = verify(src, sessions, feeds)
    times = interleave(sessions, feeds, args)
    del sessions
    gc.collect()
    base = times["ort_default"]
    row: dict[str, Any] = {
        "model": name,
        "threads": threads,
        "blocks": len(base),
        "stats": {k: LatencyStats.from_samples(t).to_dict() for k, t in times.items()},
        "vs_default": {k: _ratio(base, t) for k, t in times.items() if k != "ort_default"},
        "fast_vs_ort_transformers": _ratio(times["ort_transformers"], times["fast"]),
        "int8_vs_ort_int8": _ratio(times["ort_int8"], times["int8"]),
        "verification": check,
        "recipes": {k: v.recipe for k, v in variants.items() if v.recipe},
        "build": {k: {"seconds": v.build_seconds, "notes": v.notes} for k, v in variants.items()},
        "times_ms": times,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    fast = row["vs_default"]["fast"]
    row["fast_holds"] = not fast["slower"] and not row["fast_vs_ort_transformers"]["slower"] and check["fast"]["exact"]
    return row


# ----------------------------------------------------------------------------------------- reporting


def _cell(r: dict[str, Any]) -> str:
    lo, hi = r["ci95"]
    mark = " (slower)" if r["slower"] else ""
    return f"{r['speedup']:.2f}x; {r['paired']:.2f}x [{lo:.2f}, {hi:.2f}]{mark}"


def _geomean(values: Sequence[float]) -> float:
    return float(np.exp(np.mean(np.log(values)))) if values else float("nan")


def latency_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| model | threads | blocks | ORT default p50 ms | ORT transformers | onnxsim | **fast** | ORT int8 "
        "| **int8** | fast vs ORT transformers | int8 vs ORT int8 |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        v = r["vs_default"]
        lines.append(
            f"| {r['model']} | {r['threads']} | {r['blocks']} | {r['stats']['ort_default']['p50_ms']:.1f} "
            f"| {_cell(v['ort_transformers'])} | {_cell(v['onnxsim'])} | **{_cell(v['fast'])}** "
            f"| {_cell(v['ort_int8'])} | **{_cell(v['int8'])}** | {_cell(r['fast_vs_ort_transformers'])} "
            f"| {_cell(r['int8_vs_ort_int8'])} |"
        )
    geo = {k: _geomean([r["vs_default"][k]["speedup"] for r in rows]) for k in VARIANTS[1:]}
    lines.append(
        f"| **geometric mean** | | | | {geo['ort_transformers']:.2f}x | {geo['onnxsim']:.2f}x "
        f"| **{geo['fast']:.2f}x** | {geo['ort_int8']:.2f}x | **{geo['int8']:.2f}x** "
        f"| {_geomean([r['fast_vs_ort_transformers']['speedup'] for r in rows]):.2f}x "
        f"| {_geomean([r['int8_vs_ort_int8']['speedup'] for r in rows]):.2f}x |"
    )
    return head + "\n".join(lines) + "\n"


def _err(o: dict[str, Any], lossy: bool) -> str:
    if lossy:
        return f"{o['max_abs']:.1e}, rel L2 {o['rel_l2']:.1e}, cos {o['cosine']:.5f}"
    return f"{o['max_abs']:.1e}" + ("" if o["exact"] else " **not exact**")


def accuracy_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| model | output | ORT default | ORT transformers | onnxsim | fast | ORT int8 | int8 |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        check = r["verification"]
        for output in check["ort_default"]["outputs"]:
            cells = [_err(check[k]["outputs"][output], k in LOSSY) for k in VARIANTS]
            lines.append(f"| {r['model']} | {output} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def verdicts(rows: Sequence[dict[str, Any]]) -> str:
    fast = _geomean([r["vs_default"]["fast"]["speedup"] for r in rows])
    losing = [r["model"] for r in rows if not r["fast_holds"]]
    int8_rows = [r for r in rows if r["model"] in QUICK_MODELS]
    int8 = [
        f"{r['model']} {r['int8_vs_ort_int8']['speedup']:.2f}x"
        + (
            " (faster beyond noise)"
            if r["int8_vs_ort_int8"]["faster"]
            else " (slower beyond noise)"
            if r["int8_vs_ort_int8"]["slower"]
            else " (within noise)"
        )
        for r in int8_rows
    ]
    return (
        f"* fast: geometric mean {fast:.2f}x over ORT default (target 1.10x); never slower beyond noise than ORT "
        f"default nor ORT transformers, and exact: {'yes' if not losing else 'no, on ' + ', '.join(losing)}.\n"
        f"* int8 vs ORT int8 (quantize_dynamic on the transformers optimizer's output): "
        f"{'; '.join(int8) or 'not measured'}.\n"
    )


def _loads(rows: Sequence[dict[str, Any]]) -> str:
    return ", ".join(f"{r['model']} {r['load_average']}" for r in rows)


def render(rows: Sequence[dict[str, Any]], command: str, info: dict[str, Any], args: argparse.Namespace) -> str:
    return (
        f"{TABLE_START}\n"
        f"Command: `{command}`\n\n"
        f"Machine: {info['cpu_model']}, {info['cpus_available']} CPUs available (shared), "
        f"{info['memory_total_mb'] // 1024} GiB; {info['platform']}; Python {info['python']}; "
        f"onnxruntime {info['onnxruntime_version']} (CPU EP), onnx {info['onnx_version']}. Load average "
        f"(1, 5, 15 min) at the start: {args.load_start}, per model: "
        f"{_loads(rows)}. Batch {BATCH}, sequence {SEQ}, no "
        f"padding. Timing: warmup {args.warmup}, at least {args.min_blocks} and at most {args.max_blocks} "
        f"interleaved blocks, {args.max_seconds:g} s per model. Written {time.strftime('%Y-%m-%d %H:%M %Z')}.\n\n"
        "Latency: each cell is speedup over ORT default (median / median); paired speedup (median of per-block "
        'ratios) [bootstrap 95% interval]; "(slower)" marks slower beyond noise.\n\n'
        f"{latency_table(rows)}\n"
        "Max abs error per output against the original with ORT optimizations off (int8 columns: also relative "
        "L2 error and cosine):\n\n"
        f"{accuracy_table(rows)}\n"
        f"{verdicts(rows)}"
        f"{TABLE_END}"
    )


def write_readme(block: str) -> None:
    """Replace this script's marked block in bench/README.md (or append it); other blocks stay as they are."""
    write_blocks({(TABLE_START, TABLE_END): unmarked(block, TABLE_START, TABLE_END)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.presets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=None, help="bench model names (default: all)")
    parser.add_argument(
        "--threads", type=int, nargs="+", default=None, help="intra-op threads, one row each (default: per model)"
    )
    parser.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)} only, shorter timing")
    parser.add_argument("--reuse", action="store_true", help="reuse variant files built from the same source")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--min-blocks", type=int, default=10)
    parser.add_argument("--max-blocks", type=int, default=300)
    parser.add_argument("--max-seconds", type=float, default=None, help="timing per model (default 75, quick 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="do not write bench/README.md")
    parser.add_argument("--json", type=Path, default=OUT / "results.json", help="raw results (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.max_seconds is None:
        args.max_seconds = 20.0 if args.quick else 75.0
    models = list(args.models or (QUICK_MODELS if args.quick else BENCH_MODELS))
    unknown = [m for m in models if m not in BENCH_MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(BENCH_MODELS)}")
    args.load_start = [round(x, 2) for x in os.getloadavg()]
    command = "python -m bench.presets" + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:]))
    rows = []
    for name in models:
        for threads in args.threads or [DEFAULT_THREADS.get(name, 2)]:
            print(f"== {name}, {threads} thread(s) ...", flush=True)
            row = run_model(name, threads, args)
            rows.append(row)
            v = row["vs_default"]
            print(
                f"   ORT default {row['stats']['ort_default']['p50_ms']:.1f} ms; "
                + "; ".join(f"{k} {v[k]['speedup']:.2f}x" for k in VARIANTS[1:])
                + f"; int8 vs ORT int8 {row['int8_vs_ort_int8']['speedup']:.2f}x ({row['seconds']:.0f} s)",
                flush=True,
            )
    info = host_info(target="cpu", intra_op_threads=0)
    block = render(rows, command, info, args)
    print()
    print(block)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"command": command, "machine": info, "rows": rows}, indent=1, default=str))
    if not args.no_write:
        write_readme(block)
    return 0 if all(r["verification"]["fast"]["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
