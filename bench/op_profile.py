"""Where an artifact's time goes against its upload's: ORT's own profile, summed per op type.

Run ``python -m bench.op_profile ORIGINAL.onnx ARTIFACT.onnx [--batch 1 4] [--runs 20]``.

Each model gets an ORT_ENABLE_ALL session with ``SessionOptions.enable_profiling`` (CPU EP, what the gate
times), the job's kind of generated inputs (``core.inputs``, the first input set's shapes with the batch
axis set to each ``--batch``), 3 untimed runs, then ``--runs`` profiled ones; the profile's ``*_kernel_time``
events are summed per op type and printed in ms per run, side by side, largest first. Then both models run
``--runs`` times interleaved (A then B, one process) for the median paired ratio b/a, the load average beside
it: the two profiles are taken one after the other and a shared host's load moves them; the op types' shares
are what to read, the interleaved ratio is what to compare.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from core.inputs import generate_input_sets  # noqa: E402


def _session(path: Path, *, profile_dir: str | None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if profile_dir is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(profile_dir) / "profile")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _with_batch(feed: dict[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
    """The feed with its leading axis resized to ``batch`` (rows repeated): the gate's batch-1/2/4 sets."""
    return {k: np.repeat(v[:1], batch, axis=0) if v.ndim else v for k, v in feed.items()}


def op_totals(path: Path, feed: dict[str, np.ndarray], runs: int) -> collections.Counter[str]:
    """Kernel time per op type, microseconds summed over ``runs`` profiled runs."""
    with tempfile.TemporaryDirectory(prefix="op-profile-") as tmp:
        session = _session(path, profile_dir=tmp)
        for _ in range(3):
            session.run(None, feed)
        for _ in range(runs):
            session.run(None, feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    totals: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            totals[event["args"]["op_name"]] += event["dur"]
    return totals


def interleaved(a: Path, b: Path, feed: dict[str, np.ndarray], runs: int) -> tuple[float, float, float]:
    """Median ms of A and B and the median paired ratio b/a over ``runs`` blocks, the order alternating."""
    sa, sb = _session(a, profile_dir=None), _session(b, profile_dir=None)
    for _ in range(3):
        sa.run(None, feed), sb.run(None, feed)
    times = np.zeros((runs, 2))
    for block in range(runs):
        for k in (0, 1) if block % 2 == 0 else (1, 0):
            session = (sa, sb)[k]
            start = time.perf_counter()
            session.run(None, feed)
            times[block, k] = (time.perf_counter() - start) * 1000
    return float(np.median(times[:, 0])), float(np.median(times[:, 1])), float(np.median(times[:, 1] / times[:, 0]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.op_profile", description=__doc__.splitlines()[0])
    parser.add_argument("original", type=Path)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args(argv)
    base = generate_input_sets(onnx.load(str(args.original), load_external_data=False), 1)[0].feeds
    for batch in args.batch:
        feed = _with_batch(base, batch)
        totals = [op_totals(path, feed, args.runs) for path in (args.original, args.artifact)]
        shape = " x ".join("x".join(map(str, v.shape)) for v in feed.values())
        print(f"batch {batch} ({shape}): kernel ms per run, original | artifact; load {os.getloadavg()[0]:.1f}")
        ops = sorted(set(totals[0]) | set(totals[1]), key=lambda op: -(totals[0][op] + totals[1][op]))
        for op in ops:
            print(f"  {op:32s} {totals[0][op] / args.runs / 1000:9.2f} {totals[1][op] / args.runs / 1000:9.2f}")
        sums = [sum(t.values()) / args.runs / 1000 for t in totals]
        print(f"  {'total':32s} {sums[0]:9.2f} {sums[1]:9.2f}")
        a_ms, b_ms, ratio = interleaved(args.original, args.artifact, feed, args.runs)
        print(f"  interleaved: p50 {a_ms:.1f} | {b_ms:.1f} ms, median b/a {ratio:.3f}; load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
