"""Job time against depth: the corpus's tiny architectures rebuilt at real checkpoints' layer counts.

Run ``python -m bench.depth_scaling [--layers 2 12 24] [--only bart t5 ...] [--exporters ts_eager dynamo]
[--out DIR] [--timeout S]``.

The corpus (``tests/models/corpus.py``) has 2 layers (tiny) or 4 (bench); checkpoints teams upload have 12-32.
A pass whose work grows faster than the graph does not show on the corpus: fuse_gqa's head-Reshape fold walked
the residual stream once per branch of every Add (2^layers), 0.1 s on the tiny GPT-2 and over 8 minutes at 4
layers. This script builds each architecture at the tiny dims with each layer count (``--out``, default
``bench/out/depth``; reused when present), runs ``onnxforge optimize MODEL --preset fast`` on each as a user does
(no samples; ``ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS=1`` so the timing stays small beside the passes) and
prints, per model and depth: the job's wall seconds, its passes' seconds and the slowest pass, then the growth
of the passes' time from one depth to the next against the growth of the node count (about 1 where the passes
are linear in the graph). Writes nothing into the repository but the built models under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import machine_line  # noqa: E402
from bench.coverage import run_job as run_coverage_job  # noqa: E402
from workers.benchmark import host_info  # noqa: E402

DEFAULT_ARCHS = ("bert", "gpt2", "llama", "t5", "bart", "whisper_encoder", "wav2vec2", "mpnet", "deberta_v2")


def build(arch: str, exporter: str, layers: int, out: Path) -> dict[str, Any]:
    """The tiny build of ``arch`` at ``layers`` layers (a child process: the corpus dims are patched there)."""
    target = out / f"L{layers}"
    code = (
        "import dataclasses, json, sys; from pathlib import Path; import tests.models._corpus_specs as s; "
        f"s.DIMS['tiny'] = dataclasses.replace(s.DIMS['tiny'], layers={layers}); "
        "from tests.models import corpus; "
        f"args = ({arch!r}, {exporter!r}, 'tiny', Path({str(target)!r})); "
        "info = corpus.cached(*args) or {**corpus.build(*args), **(corpus.cached(*args) or {})}; "
        "print(json.dumps({k: info.get(k) for k in ('ok', 'error', 'path')}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"ok": False, "error": (proc.stderr.strip().splitlines() or ["build failed"])[-1][:200]}
    return json.loads(lines[-1])


def run_job(path: Path, timeout: float) -> dict[str, Any]:
    """``bench.coverage.run_job`` (the CLI in a child, 1 s benchmarks), then the stage times from its report."""
    work = path.parent / f"{path.stem}.job"
    work.mkdir(exist_ok=True)
    job = run_coverage_job(path, work, 1.0, timeout)
    if not job["ok"]:
        return job
    rep = json.loads((work / "report.json").read_text())
    slowest = max(rep["timings"]["passes"], key=lambda p: p["total_s"])
    return {
        **job,
        "passes_s": rep["timings"]["passes_s"],
        "slowest": f"{slowest['name']} {slowest['total_s']:.1f}",
        "nodes": rep["summary"]["nodes_before"],
        "result": rep["decision"]["result"],
    }


@dataclasses.dataclass
class Row:
    arch: str
    exporter: str
    layers: int
    job: dict[str, Any]


def growth(rows: list[Row]) -> str:
    """Passes-time growth over node-count growth between consecutive depths of one model."""
    done = [r for r in rows if r.job.get("ok")]
    parts = []
    for a, b in itertools.pairwise(done):
        time_ratio = b.job["passes_s"] / max(a.job["passes_s"], 1e-9)
        node_ratio = b.job["nodes"] / max(a.job["nodes"], 1)
        parts.append(f"L{a.layers}->L{b.layers}: {time_ratio:.2f}x time / {node_ratio:.2f}x nodes")
    return "; ".join(parts) or "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.depth_scaling", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 12, 24])
    parser.add_argument("--only", nargs="+", default=list(DEFAULT_ARCHS), help="corpus architectures")
    parser.add_argument("--exporters", nargs="+", default=["ts_eager", "dynamo"])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "depth")
    parser.add_argument("--timeout", type=float, default=600.0, help="per job, seconds")
    args = parser.parse_args(argv)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(machine_line(host_info(target="cpu", intra_op_threads=0), load=load))
    print("| model | exporter | layers | nodes | job | job s | passes s | slowest pass (s) |")
    print("|---|---|---|---|---|---|---|---|")
    summary = []
    for arch in args.only:
        for exporter in args.exporters:
            rows = []
            for layers in sorted(args.layers):
                built = build(arch, exporter, layers, args.out)
                if not built.get("ok"):
                    print(f"| {arch} | {exporter} | {layers} | - | build failed: {built.get('error')} | - | - | - |")
                    continue
                job = run_job(Path(built["path"]), args.timeout)
                rows.append(Row(arch, exporter, layers, job))
                if job["ok"]:
                    print(
                        f"| {arch} | {exporter} | {layers} | {job['nodes']} | {job['result']} | {job['wall_s']:.1f} "
                        f"| {job['passes_s']:.1f} | {job['slowest']} |",
                        flush=True,
                    )
                else:
                    print(f"| {arch} | {exporter} | {layers} | - | {job['error']} | {job['wall_s']:.1f} | - | - |")
            summary.append(f"* {arch} / {exporter}: {growth(rows)}")
    print()
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
