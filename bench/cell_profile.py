"""One coverage cell, profiled interleaved: where ``fast`` and ORT default spend their time (issue 17).

Run ``python -m bench.cell_profile ARCH EXPORTER --fast PATH [--size tiny|bench] [--shape 8x256] [--runs 60]``
(``PATH``: an artifact kept by ``python -m bench.coverage_ab ARCH EXPORTER --keep PATH``).

``bench.coverage_ab --profile`` and ``bench.op_profile`` profile the two models one after the other, so the
load of a shared host moves one profile and not the other: ops the two graphs share (DeBERTa's
GatherElements and Expand) read up to 1.9x apart there. Here both sessions profile at once and run
alternately (upload first on even runs, the artifact first on odd ones) on the corpus's feeds at one shape,
1 thread, ORT_ENABLE_ALL, the artifact under its session recipe; after 3 runs each is dropped, each node's
kernel time is its median over the rest, summed per op type. ``model_run`` medians stand beside the sums (the
gap is the work between kernels); ``--nodes MS`` also lists each node of at least MS ms with its input
shapes. Per-node times under the profiler are only meaningful where kernels take tens of microseconds or
more: at batch 1 / seq 64 on the tiny models the profiler's own cost dominates.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnxruntime as ort  # noqa: E402

from bench.coverage_ab import _upload, profiled_session  # noqa: E402
from core.recipe import read_recipe  # noqa: E402
from tests.models import corpus  # noqa: E402

SKIP = 3  # first runs allocate


def _session(path: Path, prefix: str, with_recipe: bool) -> ort.InferenceSession:
    return profiled_session(path, read_recipe(path) if with_recipe else None, prefix)


def _totals(profile: str, nodes: float | None) -> tuple[float, dict[str, float]]:
    events = json.loads(Path(profile).read_text())
    runs = [e["dur"] / 1000.0 for e in events if e.get("name") == "model_run"][SKIP:]
    per_node: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    shapes: dict[tuple[str, str], list] = {}
    for ev in events:
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
            key = (ev["args"]["op_name"], ev["name"].removesuffix("_kernel_time"))
            per_node[key].append(ev["dur"] / 1000.0)
            shapes[key] = [next(iter(t.values())) for t in ev["args"].get("input_type_shape", [])]
    totals: dict[str, float] = collections.defaultdict(float)
    for (op, name), durs in sorted(per_node.items(), key=lambda kv: kv[0][1]):
        ms = float(np.median(durs[SKIP:] or durs))
        totals[op] += ms
        if nodes is not None and ms >= nodes:
            print(f"    {ms:7.3f}  {op:20s} {name[:60]:60s} inputs {shapes[(op, name)]}")
    return float(np.median(runs)), dict(totals)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cell_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("arch", choices=sorted(corpus.ARCHS))
    parser.add_argument("exporter", choices=corpus.EXPORTERS)
    parser.add_argument("--fast", type=Path, required=True, help="the cell's fast artifact")
    parser.add_argument("--size", choices=corpus.SIZES, default="tiny")
    parser.add_argument("--shape", default="8x256", help="BATCHxSEQ (default 8x256)")
    parser.add_argument("--runs", type=int, default=60, help="profiled runs per model (default 60)")
    parser.add_argument("--nodes", type=float, help="also list each node taking at least this many ms per run")
    args = parser.parse_args(argv)
    print("command: python -m bench.cell_profile " + shlex.join(argv if argv is not None else sys.argv[1:]))
    batch, seq = (int(v) for v in args.shape.split("x"))
    paths = {"ort_default": _upload(args.arch, args.exporter, args.size), "fast": args.fast}
    with tempfile.TemporaryDirectory(prefix="cell-profile-") as tmp:
        sessions = {k: _session(p, str(Path(tmp) / k), k == "fast") for k, p in paths.items()}
        feeds = corpus.feeds(args.arch, args.size, batch, seq, seed=1)
        per = {k: {i.name: feeds[i.name] for i in s.get_inputs()} for k, s in sessions.items()}
        keys = list(sessions)
        load = os.getloadavg()[0]
        for i in range(args.runs + SKIP):
            for k in keys if i % 2 == 0 else keys[::-1]:
                sessions[k].run(None, per[k])
        print(
            f"{args.arch}/{args.exporter} b{batch}/s{seq}, {args.runs} runs each, load {load:.2f} -> "
            f"{os.getloadavg()[0]:.2f}"
        )
        found = {}
        for k, s in sessions.items():
            if args.nodes is not None:
                print(f"  {k}: nodes of at least {args.nodes} ms (median per run), by name")
            found[k] = _totals(s.end_profiling(), args.nodes)
    (wall_a, a), (wall_b, b) = found["ort_default"], found["fast"]
    print(f"  {'op (ms per run, sum of node medians)':40s} {'ort_default':>11s} {'fast':>8s}")
    for op in sorted(set(a) | set(b), key=lambda o: -max(a.get(o, 0.0), b.get(o, 0.0))):
        if max(a.get(op, 0.0), b.get(op, 0.0)) >= 0.005:
            print(f"  {op:40s} {a.get(op, 0.0):11.3f} {b.get(op, 0.0):8.3f}")
    print(f"  {'kernels':40s} {sum(a.values()):11.3f} {sum(b.values()):8.3f}")
    print(f"  {'model_run (median)':40s} {wall_a:11.3f} {wall_b:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
