"""The gate's timing of one artifact against its upload, counted: timed blocks and untimed runs per input set.

Run ``python -m bench.gate_count UPLOAD ARTIFACT [--reps 2] [--tree DIR]``. Builds the upload's session as the
job's baseline does (``SessionPool``: one cold run per set), then runs ``workers.benchmark.compare`` with the
parameters of a ``fast`` job's gate (the full benchmark settings, pooled and tie stops on) on the job's three
generated input sets, and prints the seconds it took, the timed blocks per set and the untimed (warm-up) runs of
each model per set: the runs each session made on the set, less its build run and its timed runs. The counts
do not depend on the host's load the way seconds do. ``--tree DIR``: import ``workers`` and ``core`` from DIR
(an earlier revision's tree, e.g. ``git archive REV | tar -x -C DIR``) instead of this checkout, so that two
trees' gates can be counted in alternation on the same two models.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("upload", type=Path)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--tree", type=Path, default=REPO, help="the tree whose workers/ and core/ are timed")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.tree.resolve()))
    import onnx

    from core.inputs import generate_input_sets
    from core.settings import get_settings
    from workers import benchmark

    sets = generate_input_sets(onnx.load(str(args.upload), load_external_data=False), 3)
    feeds = [s.feeds for s in sets]
    full = benchmark.BenchmarkParams.from_settings(get_settings().pipeline, target="cpu")
    params = dataclasses.replace(full, pooled_stop=True, tie_stop=True)
    print(f"{benchmark.__file__}; load {_load()}")
    for rep in range(args.reps):
        pool = benchmark.SessionPool()
        runs_a = pool.runs(args.upload, feeds, params)[0]  # the baseline's build
        started = time.perf_counter()
        comparison = benchmark.compare(args.upload, args.artifact, sets, params, pool=pool)
        seconds = time.perf_counter() - started
        runs_b = pool.runs(args.artifact, feeds, params)[0]
        shapes = comparison.shapes
        untimed = [(runs_a.ran[i] - 1 - s.a.runs, runs_b.ran[i] - 1 - s.b.runs) for i, s in enumerate(shapes)]
        ratios = [round(s.verdict.paired_ratio, 3) for s in shapes]
        print(
            f"rep {rep}: compare {seconds:.1f} s; timed blocks {[s.a.runs for s in shapes]}; untimed runs (upload, "
            f"artifact) per set {untimed}, {sum(a + b for a, b in untimed)} in all; slower {comparison.slower}, "
            f"tie {comparison.tie}; paired ratios {ratios}; load {_load()}",
            flush=True,
        )
        pool.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
