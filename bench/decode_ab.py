"""One decode step of several decoder artifacts timed against each other in one process (issue 19's A/Bs).

Run ``python -m bench.decode_ab MODEL.onnx [MODEL.onnx ...] [--threads 1] [--past 128] [--blocks 40] [--calls 20]
[--copies 3] [--profile]``. Each model is fed one token (id 17) at position ``--past`` after a random cache of
``--past`` positions (inputs by name: ``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.*``;
the builder's graphs have no position ids); one block runs ``--calls`` calls of every model, the order rotated per
block and reversed every other block; printed: median and quartiles of the per-call ms over the blocks, the median
and quartiles of each block's ratio to the first model's figure in that block, and the load average. Each model runs
as ``--copies`` sessions, loaded round-robin in a rotated order after one never timed, block ``b`` using copy ``b
mod --copies`` (``bench._copies``: sessions of one file in one process decode 10-15% apart on the shared host;
before that was found this script timed one session per model).
``--profile`` instead runs ORT's profiler on every model, interleaved the same way, and prints kernel time per
op type per step (the mean, and the sum of its nodes' medians) and the median step (profiling inflates every
figure: compare within one run only).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench._copies import load_copies, pick, rotated

_KV_HEADS, _HEAD_DIM = 2, 64  # bench.decoders_genai's size


def _feeds(sess: ort.InferenceSession, past: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    for value in sess.get_inputs():
        name = value.name
        if name == "input_ids":
            feeds[name] = np.array([[17]], np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((1, past + 1), np.int64)
        elif name == "position_ids":
            feeds[name] = np.array([[past]], np.int64)
        else:
            dims = value.shape
            kv = dims[1] if isinstance(dims[1], int) else _KV_HEADS
            dim = dims[3] if isinstance(dims[3], int) else _HEAD_DIM
            feeds[name] = rng.standard_normal((1, kv, past, dim)).astype(np.float32)
    return feeds


def _session(path: str, threads: int, profile_prefix: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    if profile_prefix:
        options.enable_profiling, options.profile_file_prefix = True, profile_prefix
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def profile(paths: list[str], threads: int, past: int, blocks: int, calls: int) -> None:
    """Kernel time per op type and step of each model, the models' runs interleaved as in the timing (a block
    runs ``calls`` steps of each, the order rotated): on a shared host each model's profile then sees the same
    load, and the op-type figures compare across models, not only within one. Two figures per op type: the
    mean per step, and the sum over its nodes of each node's median over the steps, which a load spike on a
    few steps does not move (the warm-up steps of the first block left out)."""
    sessions = [_session(p, threads, f"/tmp/decode_ab_{os.getpid()}_{i}") for i, p in enumerate(paths)]
    feeds = [_feeds(s, past) for s in sessions]
    for block in range(blocks):
        order = list(range(len(sessions)))
        order = order[block % len(order) :] + order[: block % len(order)]
        for k in order[::-1] if block % 2 else order:
            for _ in range(calls):
                sessions[k].run(None, feeds[k])
    steps = blocks * calls
    for path, sess in zip(paths, sessions, strict=True):
        events = json.loads(Path(sess.end_profiling()).read_text())
        spent: collections.Counter = collections.Counter()
        per_node: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        runs = [e["dur"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
        for event in events:
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                spent[event["args"]["op_name"]] += event["dur"]
                per_node[event["args"]["op_name"], event["name"]].append(event["dur"])
        medians: collections.Counter = collections.Counter()
        nodes: collections.Counter = collections.Counter()
        for (op, _), durations in per_node.items():
            medians[op] += float(np.median(durations[calls:] or durations))
            nodes[op] += 1
        run_ms = f", run {np.median(runs) / 1e3:.3f} ms (median)" if runs else ""
        print(
            f"{path}: kernel time per step {sum(spent.values()) / steps / 1e3:.3f} ms (per-node medians "
            f"{sum(medians.values()) / 1e3:.3f} ms){run_ms}"
        )
        for op, us in spent.most_common():
            print(f"  {op:36s} {us / steps / 1e3:7.3f} ms (medians {medians[op] / 1e3:7.3f} ms)  {nodes[op]} nodes")
    print("load average", " / ".join(f"{x:.2f}" for x in os.getloadavg()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--copies", type=int, default=3, help="sessions per model, used in turn (not --profile)")
    args = parser.parse_args(argv)
    if args.profile:
        profile(args.models, args.threads, args.past, args.blocks, args.calls)
        return 0
    # ``--copies`` sessions per model, used in turn, after one never timed (bench._copies says why).
    ballast, sessions = load_copies(args.models, args.copies, lambda path: _session(path, args.threads))
    feeds = [_feeds(s[0], args.past) for s in sessions]
    for copies_of, feed in zip(sessions, feeds, strict=True):
        for sess in copies_of:
            for _ in range(5):
                sess.run(None, feed)
    times: list[list[float]] = [[] for _ in sessions]
    for block in range(args.blocks):
        order = rotated(range(len(sessions)), block)
        for k in order[::-1] if block % 2 else order:
            sess = pick(sessions[k], block)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                sess.run(None, feeds[k])
            times[k].append((time.perf_counter() - t0) / args.calls * 1e3)
    for path, ms in zip(args.models, times, strict=True):
        q1, med, q3 = np.percentile(ms, [25, 50, 75])
        # Each block times every model within a second or so: the ratio of a block's figures cancels the
        # host's drift between blocks, which moves the medians of a loaded host more than the models differ.
        r1, ratio, r3 = np.percentile(np.asarray(ms) / np.asarray(times[0]), [25, 50, 75])
        print(
            f"{args.threads}t past {args.past}: {med:7.3f} ms (quartiles {q1:.3f} / {q3:.3f}); per block vs the "
            f"first {ratio:.3f} ({r1:.3f} / {r3:.3f})  {path}"
        )
    del ballast
    print("load average", " / ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
