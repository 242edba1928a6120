"""One decoder call (a decode step or a prefill) of several artifacts, timed or profiled against each other in
one process, interleaved (issue 19's fp32 A/Bs against onnxruntime-genai's builder).

Run ``python -m bench.step_ab MODEL.onnx [MODEL.onnx ...] [--threads 1] [--past 128] [--tokens 1]
[--blocks 40] [--calls 20] [--copies 3] [--cpu] [--profile] [--optimized DIR]``. Each model is fed
``--tokens`` tokens at positions ``--past``.. after a random cache of ``--past`` positions (``--past 0
--tokens 128``: a prefill; inputs by name as ``bench.decode_ab`` feeds them: ``input_ids``,
``attention_mask``, ``position_ids``, ``past_key_values.*``; the builder's graphs have no position ids).
One block runs ``--calls`` calls of every model, the order rotated per block and reversed every other block;
printed: median and quartiles of the per-call ms, and the load average.

Unlike ``bench.decode_ab``, each model runs as ``--copies`` sessions, loaded round-robin (the order rotated
per round) after one session that is never timed, used in turn (``bench._copies``, shared with
``bench.decoders_genai``): sessions of one file in one process decode
10-15% apart on the shared host (6 sessions of one ``fast`` artifact: 6.14 to 7.00 ms at 1 thread), and
the first one loaded was the slow one in 3 of 4 runs, so one session per model lets its placement pass for
the graph's cost (loaded round-robin without the rotation, the model listed first still measured 3-5%
slower; give ``--copies`` at least the number of models). ``--cpu`` (1 thread) times the calling thread's
CPU time instead of wall time: ORT runs every kernel on that thread, so the time other processes hold the
CPU is left out (their cache and memory traffic is not).

``--profile`` runs ORT's profiler on every model, the models interleaved call by call (so a load spike hits
all of them alike), and prints the median over blocks of each op type's kernel time per call; profiling
inflates every figure, compare within one run; ``--markdown`` adds the figures as one table, op types by
models, with each op's share of its model's kernel time (shares move less with the host's load).
``--optimized DIR`` also writes each model as ORT leaves it after its session optimizations
(``ORT_ENABLE_ALL``, what the session runs) into DIR, and prints its nodes per op type: the graphs compared
are the ones that run, not the ones on disk.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from bench._copies import load_copies, pick, rotated
from core.inputs import index_ranges

_KV_HEADS, _HEAD_DIM = 2, 64  # bench.decoders_genai's size


def vocabulary(paths: list[str]) -> int:
    """The token ids every compared model takes: below the smallest embedding table among them (read from the
    graph, as the service's input synthesis does), 1000 where none says."""
    sizes = [index_ranges(onnx.load(p, load_external_data=False)).get("input_ids") for p in paths]
    return min([n for n in sizes if n] or [1000])


def feeds_for(sess: ort.InferenceSession, past: int, tokens: int, vocab: int = 1000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    for value in sess.get_inputs():
        name = value.name
        if name == "input_ids":
            feeds[name] = rng.integers(min(3, vocab - 1), vocab, (1, tokens), dtype=np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((1, past + tokens), np.int64)
        elif name == "position_ids":
            feeds[name] = np.arange(past, past + tokens, dtype=np.int64)[None, :]
        else:
            dims = value.shape
            kv = dims[1] if isinstance(dims[1], int) else _KV_HEADS
            dim = dims[3] if isinstance(dims[3], int) else _HEAD_DIM
            feeds[name] = rng.standard_normal((1, kv, past, dim)).astype(np.float32)
    return feeds


@dataclass(frozen=True)
class Call:
    """What one timed call runs: threads, cached positions, new tokens; and how often."""

    threads: int
    past: int
    tokens: int
    blocks: int
    calls: int


def session(path: str, threads: int, profile_prefix: str | None = None, optimized: str | None = None):
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    if profile_prefix:
        options.enable_profiling, options.profile_file_prefix = True, profile_prefix
    if optimized:
        options.optimized_model_filepath = optimized
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", Path(optimized).name + ".data"
        )
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def write_optimized(paths: list[str], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for index, path in enumerate(paths):
        out = folder / f"{index}_{Path(path).parent.name}.onnx"
        session(path, 1, optimized=str(out))
        graph = onnx.load(str(out), load_external_data=False).graph
        ops = collections.Counter(f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in graph.node)
        print(f"{path}: {len(graph.node)} nodes after ORT_ENABLE_ALL -> {out}")
        print("  " + ", ".join(f"{op} {count}" for op, count in sorted(ops.items())))


def profile(paths: list[str], call: Call, markdown: bool = False) -> None:
    blocks, calls = call.blocks, call.calls
    prefix = f"/tmp/step_ab_{os.getpid()}"
    sessions = [session(p, call.threads, f"{prefix}_{i}") for i, p in enumerate(paths)]
    vocab = vocabulary(paths)
    feeds = [feeds_for(s, call.past, call.tokens, vocab) for s in sessions]
    for sess, feed in zip(sessions, feeds, strict=True):
        for _ in range(3):
            sess.run(None, feed)
    per_block: list[list[collections.Counter]] = [[] for _ in paths]
    tables: list[tuple[float, dict[str, tuple[float, int]]]] = []
    for block in range(blocks):
        spent = [collections.Counter() for _ in paths]
        for _ in range(calls):
            order = list(range(len(paths)))
            for k in order[::-1] if block % 2 else order:
                before = time.perf_counter_ns()
                sessions[k].run(None, feeds[k])
                spent[k]["(wall)"] += (time.perf_counter_ns() - before) // 1000
        for k in range(len(paths)):
            per_block[k].append(spent[k])
    # Kernel events come from the profile file at the end; split them into calls by the model_run events.
    for k, sess in enumerate(sessions):
        events = json.loads(Path(sess.end_profiling()).read_text())
        runs: list[collections.Counter] = []
        current: collections.Counter = collections.Counter()
        nodes: collections.Counter = collections.Counter()
        for event in events:
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                current[event["args"]["op_name"]] += event["dur"]
                if not runs:
                    nodes[event["args"]["op_name"]] += 1
            elif event.get("cat") == "Session" and event["name"] == "model_run":
                runs.append(current)
                current = collections.Counter()
        runs = runs[3:]  # the warm-up calls
        ops = sorted({op for run in runs for op in run}, key=lambda op: -sum(r[op] for r in runs))
        chunks = [runs[i : i + calls] for i in range(0, len(runs), calls)]
        total = statistics.median(sum(sum(r.values()) for r in c) / len(c) for c in chunks)
        wall = statistics.median(b["(wall)"] / calls for b in per_block[k])
        print(f"{paths[k]}: kernel {total / 1e3:.3f} ms per call, wall {wall / 1e3:.3f} ms (median of {blocks} blocks)")
        per_op: dict[str, tuple[float, int]] = {}
        for op in ops:
            us = statistics.median(sum(r[op] for r in c) / len(c) for c in chunks)
            per_op[op] = (us, nodes[op])
            print(f"  {op:36s} {us / 1e3:7.3f} ms  {nodes[op]} nodes")
        tables.append((total, per_op))
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print("load average", load)
    if markdown:
        print(op_table(paths, tables, call, load))


def op_table(paths: list[str], tables: list[tuple[float, dict[str, tuple[float, int]]]], call: Call, load: str) -> str:
    """Per op type, each model's median kernel ms per call, its node count and its share of the model's kernel
    time, one column per model: shares move far less with the host's load than the milliseconds do."""
    ops = sorted({op for _, t in tables for op in t}, key=lambda op: -max(t.get(op, (0, 0))[0] for _, t in tables))
    what = f"{call.threads} thread(s), {call.tokens} token(s) after {call.past}"
    head = f"| op ({what}; load {load}) | " + " | ".join(Path(p).parent.name or p for p in paths) + " |"
    rows = [head, "| --- |" + " --- |" * len(paths)]
    for op in ops:
        cells = []
        for total, table in tables:
            us, count = table.get(op, (0.0, 0))
            cells.append(f"{us / 1e3:.3f} ms x{count} ({us / total:.1%})" if count else "-")
        rows.append(f"| {op} | " + " | ".join(cells) + " |")
    rows.append("| kernel total | " + " | ".join(f"{total / 1e3:.3f} ms" for total, _ in tables) + " |")
    return "\n".join(rows)


def timed(paths: list[str], call: Call, cpu: bool, copies: int) -> None:
    threads, blocks, calls = call.threads, call.blocks, call.calls
    # The module docstring says why copies, round-robin, and a first session never timed.
    ballast, sessions = load_copies(paths, copies, lambda path: session(path, threads))
    vocab = vocabulary(paths)
    feeds = [feeds_for(s[0], call.past, call.tokens, vocab) for s in sessions]
    for copies_of, feed in zip(sessions, feeds, strict=True):
        for sess in copies_of:
            for _ in range(3):
                sess.run(None, feed)
    # With one intra-op thread ORT runs every kernel on the calling thread: its CPU time leaves out the time
    # the host's other processes hold the CPU, which wall time on a loaded host does not.
    clock = time.thread_time if cpu else time.perf_counter
    times: list[list[float]] = [[] for _ in sessions]
    for block in range(blocks):
        order = rotated(range(len(sessions)), block)
        for k in order[::-1] if block % 2 else order:
            sess = pick(sessions[k], block)
            t0 = clock()
            for _ in range(calls):
                sess.run(None, feeds[k])
            times[k].append((clock() - t0) / calls * 1e3)
    del ballast
    for path, ms in zip(paths, times, strict=True):
        q1, med, q3 = np.percentile(ms, [25, 50, 75])
        kind = "cpu" if cpu else "wall"
        label = f"{threads}t past {call.past} tokens {call.tokens}"
        print(f"{label}: {med:7.3f} ms {kind} (quartiles {q1:.3f} / {q3:.3f})  {path}")
    print("load average", " / ".join(f"{x:.2f}" for x in os.getloadavg()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="with --profile: also a per-op markdown table")
    parser.add_argument("--optimized", type=Path, default=None)
    parser.add_argument("--cpu", action="store_true", help="the calling thread's CPU time (1 thread only)")
    parser.add_argument("--copies", type=int, default=3, help="sessions per model, used in turn")
    args = parser.parse_args(argv)
    call = Call(args.threads, args.past, args.tokens, args.blocks, args.calls)
    if args.optimized is not None:
        write_optimized(args.models, args.optimized)
    if args.profile:
        profile(args.models, call, args.markdown)
    else:
        if args.cpu and args.threads != 1:
            parser.error("--cpu measures the calling thread: only with --threads 1")
        timed(args.models, call, args.cpu, args.copies)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
