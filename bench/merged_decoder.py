"""An Optimum merged decoder (``decoder_model_merged.onnx``) against its ``fast`` artifact, both branches, in one
process, interleaved (issue 19: merged decoders, ``passes._subgraphs``).

Run ``python -m bench.merged_decoder ORIGINAL.onnx ARTIFACT.onnx --arch bart [--size bench] [--threads 1 2]
[--past 64] [--enc 64] [--prompt 4] [--blocks 20] [--calls 10]``. Each model runs as one session per thread
count under ONNX Runtime's default level (``ORT_ENABLE_ALL``: what a user's session runs, its own fusions
included), fed as Optimum's runtime feeds the file (``tests.models.build_seq2seq.merged_feeds``, batch 1):

``first``: ``use_cache_branch=False``, the no-cache branch, ``--prompt`` decoder tokens on ``--enc`` encoder
    states (the first generation step, dummy caches of 1);
``decode``: ``use_cache_branch=True``, the cache branch, one token after a self-attention cache of ``--past``
    and a cross-attention cache of ``--enc``.

One block runs ``--calls`` calls of each (model, call), the models' order reversed every other block; printed:
median ms per call over all calls, the ratio original / artifact of the medians, the range of the per-block
ratios, and the load average before and after. The artifact is checked against the original on each call's
feeds first (atol 1e-4).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from bench._decoder_ab import session
from tests.models.build_seq2seq import ARCHS, BENCH, merged_feeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.merged_decoder", description=__doc__.split("\n")[0])
    parser.add_argument("original", type=Path)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--arch", choices=sorted(ARCHS), required=True)
    parser.add_argument("--size", choices=("tiny", "bench"), default="bench")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--past", type=int, default=64)
    parser.add_argument("--enc", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args(argv)
    arch = (BENCH if args.size == "bench" else ARCHS)[args.arch]
    calls = {
        "first": merged_feeds(arch, False, 1, dec=args.prompt, enc=args.enc, seed=1),
        "decode": merged_feeds(arch, True, 1, dec=1, past=args.past, enc=args.enc, seed=2),
    }
    print(f"load average before: {os.getloadavg()}")
    for threads in args.threads:
        models = {"original": session(args.original, threads), "artifact": session(args.artifact, threads)}
        for name, feeds in calls.items():
            want, got = (models[m].run(None, feeds) for m in ("original", "artifact"))
            for a, b in zip(want, got, strict=True):
                np.testing.assert_allclose(b, a, atol=1e-4, rtol=0, err_msg=f"{name}")
            for sess in models.values():  # warm-up
                for _ in range(3):
                    sess.run(None, feeds)
        times: dict[tuple[str, str], list[float]] = {(m, c): [] for m in models for c in calls}
        ratios: dict[str, list[float]] = {c: [] for c in calls}
        for block in range(args.blocks):
            order = list(models) if block % 2 == 0 else list(reversed(models))
            block_times: dict[tuple[str, str], list[float]] = {}
            for call, feeds in calls.items():
                for model in order:
                    sess = models[model]
                    spent = []
                    for _ in range(args.calls):
                        t0 = time.perf_counter()
                        sess.run(None, feeds)
                        spent.append((time.perf_counter() - t0) * 1e3)
                    times[(model, call)] += spent
                    block_times[(model, call)] = spent
            for call in calls:
                ratios[call].append(
                    statistics.median(block_times[("original", call)])
                    / statistics.median(block_times[("artifact", call)])
                )
        for call in calls:
            orig, art = (statistics.median(times[(m, call)]) for m in ("original", "artifact"))
            low, high = min(ratios[call]), max(ratios[call])
            print(
                f"{args.arch} {args.size} {call:6s} threads {threads}: original {orig:.3f} ms, artifact {art:.3f} ms, "
                f"ratio {orig / art:.2f}x (blocks {low:.2f}-{high:.2f})"
            )
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
