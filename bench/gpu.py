"""GPU figures (issue 7): ORT default vs the onnxforge presets on the CUDA EP: ``python -m bench.gpu``.

For each bench model (bench/models.py) at one batch x sequence size:

* **ORT default (fp32)**: the model as built, ORT_ENABLE_ALL, CUDA EP: what a user gets without onnxforge;
* **onnxforge fast (fp32)** and **onnxforge fp16**: the service pipeline (``workers.pipeline.run_pipeline``,
  target ``cuda``: passes, per-pass ledger, verification on the CUDA EP) with that preset; its artifact is
  then timed against the original by ``workers.benchmark.compare`` with the artifact's session recipe.

Every timed run uses I/O binding (inputs copied to the GPU once, outputs left there, ``synchronize_outputs``),
and the candidate is tried as a CUDA graph where its input shapes are static (bench models have dynamic
batch and sequence, so the table says why not). Speedups are paired medians from interleaved runs.

The table is printed and written into ``bench/README.md`` between the ``gpu-table`` markers (that block
only; the file is read and written in one go), raw results into ``bench/out/gpu/results.json``. On a
machine without an NVIDIA GPU and onnxruntime-gpu the script says so, exits 2 and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # bench scripts may run as files rather than with python -m
    sys.path.insert(0, str(REPO))

from bench._report import unmarked, write_blocks  # noqa: E402

OUT = REPO / "bench" / "out" / "gpu"
TABLE_START = "<!-- gpu-table:start -->"
TABLE_END = "<!-- gpu-table:end -->"
PRESETS = ("fast", "fp16")
EXIT_NO_GPU = 2


def gpu_problem() -> str | None:
    """None when this machine can run the benchmark, else what is missing (without creating a CUDA context)."""
    import onnxruntime as ort

    from workers.gpu import visible_gpus

    providers = ort.get_available_providers()
    if "CUDAExecutionProvider" not in providers:
        return (
            f"bench.gpu needs the CUDA execution provider; onnxruntime {ort.__version__} here offers "
            f"{', '.join(providers)} (install onnxruntime-gpu on a machine with an NVIDIA GPU)"
        )
    if not visible_gpus():
        return "bench.gpu found no NVIDIA GPU (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them all)"
    return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from bench.models import BENCH_MODELS

    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=None, choices=BENCH_MODELS, help="default: all")
    parser.add_argument("--presets", nargs="*", default=list(PRESETS), choices=PRESETS, help="default: %(default)s")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="two models, shorter timing")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--min-runs", type=int, default=50)
    parser.add_argument("--max-seconds", type=float, default=None, help="timing budget per case (default 20, quick 5)")
    parser.add_argument("--no-write", action="store_true", help="do not write bench/README.md")
    parser.add_argument("--json", type=Path, default=OUT / "results.json", help="raw results (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.models is None:
        args.models = ["bert_encoder", "gpt2"] if args.quick else list(BENCH_MODELS)
    if args.max_seconds is None:
        args.max_seconds = 5.0 if args.quick else 20.0
    if args.batch < 1 or args.seq < 1:
        parser.error("--batch and --seq must be positive")
    return args


def _optimize(model: Path, preset: str, out_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from core.config import JobConfig
    from core.settings import PipelineSettings
    from workers.pipeline import PipelineRequest, run_pipeline

    out_dir.mkdir(parents=True, exist_ok=True)
    config = {"preset": preset, "target": "cuda", "benchmark": False, "shapes": [_shapes(model, args)]}
    started = time.perf_counter()
    result = run_pipeline(
        PipelineRequest(
            model_path=model,
            output_dir=out_dir,
            config=JobConfig.parse(config),
            settings=PipelineSettings(verify_shape_sets=1),
        )
    )
    worst = [o for o in result.report["verification"]["outputs"] if o.get("max_abs") is not None]
    return {
        "artifact": result.model_path,
        "used_original": result.used_original,
        "verified": result.report["verification"]["ok"],
        "max_abs": max((o["max_abs"] for o in worst), default=None),
        "optimize_s": time.perf_counter() - started,
    }


def _shapes(model: Path, args: argparse.Namespace) -> dict[str, list[int]]:
    import onnx

    from core.inputs import graph_inputs

    return {spec.name: [args.batch, args.seq] for spec in graph_inputs(onnx.load(str(model), load_external_data=False))}


def run_model(name: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    from bench.models import ensure_bench_model, make_inputs
    from core.inputs import InputSet
    from core.recipe import read_recipe
    from workers.benchmark import BenchmarkParams, compare

    model = ensure_bench_model(name)
    feeds = make_inputs(name, args.batch, args.seq, pad_fraction=0.25)
    sets = [InputSet(f"batch={args.batch},seq={args.seq}", feeds)]
    params = BenchmarkParams(
        warmup=args.warmup,
        min_runs=args.min_runs,
        max_seconds=args.max_seconds,
        max_runs=max(args.min_runs, 20 * args.min_runs),
        target="cuda",
        io_binding=True,
    )
    rows: list[dict[str, Any]] = []
    baseline_ms: float | None = None
    for preset in args.presets:
        opt = _optimize(model, preset, work / name / preset, args)
        comparison = compare(model, opt["artifact"], sets, params, recipe_b=read_recipe(opt["artifact"]))
        shape = comparison.shapes[0]
        if baseline_ms is None:
            baseline_ms = shape.a.p50_ms
            rows.append(
                {"model": name, "variant": "ORT default", "precision": "fp32", "p50_ms": shape.a.p50_ms,
                 "p90_ms": shape.a.p90_ms, "speedup": 1.0, "cuda_graph": "-", "max_abs": 0.0, "verified": True}
            )  # fmt: skip
        graph = comparison.cuda_graph
        rows.append(
            {
                "model": name,
                "variant": f"onnxforge {preset}" + (" (original kept)" if opt["used_original"] else ""),
                "precision": "fp16" if preset == "fp16" and not opt["used_original"] else "fp32",
                "p50_ms": shape.b.p50_ms,
                "p90_ms": shape.b.p90_ms,
                "speedup": 1.0 / shape.verdict.paired_ratio if shape.verdict.paired_ratio > 0 else None,
                "cuda_graph": "used" if graph.used else f"no: {graph.reason}",
                "max_abs": opt["max_abs"],
                "verified": opt["verified"],
                "optimize_s": opt["optimize_s"],
                "execution": comparison.execution,
            }
        )
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def render(rows: Sequence[dict[str, Any]], command: str, info: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        TABLE_START,
        f"Command: `{command}`; {info['gpu']}, onnxruntime {info['onnxruntime']}, {info['date']}. "
        f"Inputs batch {args.batch} x seq {args.seq}, 25% padding; I/O binding on every run; speedup is the "
        "paired median against ORT default (interleaved runs).",
        "",
        "| Model | Variant | Precision | p50 ms | p90 ms | Speedup | Max abs error | CUDA graph |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['precision']} | {_fmt(r['p50_ms'], '.3f')} | "
            f"{_fmt(r['p90_ms'], '.3f')} | {_fmt(r['speedup'], '.2f')}x | {_fmt(r['max_abs'], '.2g')} | "
            f"{str(r['cuda_graph']).replace('|', '/')[:80]} |"
        )
    lines.append(TABLE_END)
    return "\n".join(lines)


def write_readme(block: str) -> None:
    """Replace only the gpu-table block (others own other blocks)."""
    write_blocks({(TABLE_START, TABLE_END): unmarked(block, TABLE_START, TABLE_END)})


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problem = gpu_problem()
    if problem is not None:
        print(f"error: {problem}; nothing measured or written", file=sys.stderr)
        return EXIT_NO_GPU
    import onnxruntime as ort

    from core.hardware import _gpus

    info = {
        "gpu": ", ".join(_gpus()) or "unknown GPU",
        "onnxruntime": ort.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="onnxforge-bench-gpu-") as tmp:
        for name in args.models:
            print(f"== {name}", flush=True)
            rows.extend(run_model(name, args, Path(tmp)))
    command = "python -m bench.gpu " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    block = render(rows, command.strip(), info, args)
    print(block)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=2, default=str), encoding="utf-8")
    if not args.no_write:
        write_readme(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
