"""``common_subexpression_elimination``'s ``shapes_by_dims`` on and off, on corpus models (issue 17).

Run ``python -m bench.shape_cse ARCH:EXPORTER [...] [--preset safe|fast] [--size-algebra] [--time BxS]
[--seconds 20]``.

For each committed tiny export (``tests.models.corpus``) the preset's passes run in process twice, once with
the option off, once on (nothing else differs; no job, no rollback), and it prints the node counts after the
preset (all nodes, Shape, Expand) and what CSE merged; ``--size-algebra`` turns ``size_algebra`` on as well in
the ``on`` run. Both artifacts are compared with the upload under
``ORT_DISABLE_ALL`` at four shapes other than the export's (the last row padded). ``--time BxS`` then times
them interleaved in one process at that shape, one intra-op thread, ``ORT_ENABLE_ALL``: blocks of five runs of
``off``, ``on`` and ``off_copy`` (a second session of ``off``, the A/A control) in rotating order, per-run
thread CPU time and wall time, and the medians of the per-block ratios ``on/off``, ``on/off_copy`` and
``off_copy/off``: a change is real only where both ``on`` ratios clear the A/A one.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from core.config import PassSpec  # noqa: E402
from passes import registry  # noqa: E402
from passes._infra import PassContext, op_histogram  # noqa: E402
from tests.models import corpus  # noqa: E402

_CSE = "common_subexpression_elimination"
_CHECK_SHAPES = ((1, 5), (3, 17), (2, 40), (4, 9))


def optimize(
    arch: str, exporter: str, preset: str, shapes_by_dims: bool, size_algebra: bool = False
) -> tuple[ir.Model, list[tuple[int, int]]]:
    """The preset's result, and per CSE run (nodes merged, of which Shapes merged by their dims)."""
    model = ir.load(corpus.committed_path(arch, exporter))
    ctx = PassContext(samples=[corpus.feeds(arch, "tiny", b, s, seed=1) for b, s in ((1, 5), (2, 17))])
    specs = [
        PassSpec(name=s.name, options={**s.options, "shapes_by_dims": shapes_by_dims, "size_algebra": size_algebra})
        if s.name == _CSE
        else s
        for s in registry.PRESETS[preset].specs
    ]
    cse = []
    for pass_ in registry.build_passes(specs):
        result = pass_(model, ctx)
        model = result.model
        if pass_.name == _CSE:
            cse.append((result.counts["nodes_merged"], result.notes.get("shapes_merged_by_dims", 0)))
    return model, cse


def _session(path: Path, level: ort.GraphOptimizationLevel) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def max_diff(arch: str, exporter: str, artifact: Path) -> float:
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    reference, candidate = _session(corpus.committed_path(arch, exporter), off), _session(artifact, off)
    worst = 0.0
    for batch, seq in _CHECK_SHAPES:
        feeds = corpus.feeds(arch, "tiny", batch, seq, seed=batch * seq, pad=True)
        for want, got in zip(reference.run(None, feeds), candidate.run(None, feeds), strict=True):
            assert want.shape == got.shape, (want.shape, got.shape)
            worst = max(worst, float(np.max(np.abs(want - got))))
    return worst


def interleave(paths: dict[str, Path], feeds: dict, seconds: float) -> dict[str, dict[str, list[float]]]:
    level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sessions = {name: _session(path, level) for name, path in paths.items()}
    for s in sessions.values():
        s.run(None, feeds)
    times: dict[str, dict[str, list[float]]] = {n: {"cpu": [], "wall": []} for n in sessions}
    order, block, end = list(sessions), 0, time.monotonic() + seconds
    while time.monotonic() < end or block < 6:
        for name in order[block % 3 :] + order[: block % 3]:
            cpu, wall = time.thread_time(), time.perf_counter()
            for _ in range(5):
                sessions[name].run(None, feeds)
            times[name]["cpu"].append((time.thread_time() - cpu) / 5)
            times[name]["wall"].append((time.perf_counter() - wall) / 5)
        block += 1
    return times


def _ratio(times: dict, a: str, b: str, kind: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a][kind], times[b][kind], strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="ARCH:EXPORTER, e.g. deberta_v3:ts_eager")
    parser.add_argument("--preset", choices=["safe", "fast"], default="safe")
    parser.add_argument("--size-algebra", action="store_true", help="size_algebra on in the 'on' run")
    parser.add_argument("--time", default=None, help="BxS: also time off/on/off_copy at this shape")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="shape-cse-") as scratch:
        for entry in args.models:
            arch, exporter = entry.rsplit(":", 1)
            paths, counts = {}, {}
            for name, flag in (("off", False), ("on", True)):
                model, cse = optimize(arch, exporter, args.preset, flag, flag and args.size_algebra)
                paths[name] = Path(scratch) / f"{arch}_{exporter}_{name}.onnx"
                ir.save(model, paths[name])
                ops = op_histogram(model)
                counts[name] = (sum(ops.values()), ops.get("Shape", 0), ops.get("Expand", 0), cse)
            (n0, s0, e0, c0), (n1, s1, e1, c1) = counts["off"], counts["on"]
            diff_off, diff_on = (max_diff(arch, exporter, paths[name]) for name in ("off", "on"))
            print(
                f"{arch}:{exporter} {args.preset}{' +size_algebra' if args.size_algebra else ''}: "
                f"nodes {n0} -> {n1}, Shape {s0} -> {s1}, Expand {e0} -> {e1}; "
                f"CSE (merged, shapes by dims) off {c0} on {c1}; max |diff| vs upload: off {diff_off:.2g} "
                f"on {diff_on:.2g}",
                flush=True,
            )
            if args.time:
                batch, seq = (int(v) for v in args.time.split("x"))
                paths["off_copy"] = paths["off"]
                times = interleave(paths, corpus.feeds(arch, "tiny", batch, seq, seed=1), args.seconds)
                medians = {n: 1e3 * statistics.median(t["cpu"]) for n, t in times.items()}
                print(
                    f"  {args.time}: {len(times['on']['cpu'])} blocks; cpu ms/run "
                    + ", ".join(f"{n} {m:.3f}" for n, m in medians.items())
                    + f"; on/off cpu {_ratio(times, 'on', 'off', 'cpu'):.3f} "
                    f"wall {_ratio(times, 'on', 'off', 'wall'):.3f}"
                    f"; on/off_copy cpu {_ratio(times, 'on', 'off_copy', 'cpu'):.3f}"
                    f"; A/A off_copy/off cpu {_ratio(times, 'off_copy', 'off', 'cpu'):.3f} "
                    f"wall {_ratio(times, 'off_copy', 'off', 'wall'):.3f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
