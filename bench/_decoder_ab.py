"""What the decoder-fusion benchmarks (``bench.gqa``, ``bench.rotary``) share: the Llama-shaped decoder they
build (4 layers, hidden 512, 8 heads / 2 kv heads, MLP 1408, vocabulary 32000, random weights, TorchScript
export with a KV cache), the exactness check of a fused variant, and the interleaved timing of variants."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from tests.models.build_decoders import Family, Signature, causal_lm, decoder_feeds, export, save, wrap

LLAMA = Family(
    "bench_llama", "LlamaConfig", "LlamaForCausalLM", layers=4, hidden=512, heads=8, kv_heads=2, intermediate=1408,
    vocab=32000, max_positions=2048,
)  # fmt: skip


def build(path: Path) -> Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        save(export(wrap(causal_lm(LLAMA), "past"), LLAMA, "past", "ts", path), path)
    return path


def check(original: Path, fused: Path, signature: Signature) -> float:
    """Max |diff| of every output at a prefill of 9 and a decode after 33, ORT optimizations off."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    a, b = (ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"]) for p in (original, fused))
    worst = 0.0
    for seq, past in ((9, 0), (1, 33)):
        feeds = decoder_feeds(signature, 1, seq, past, seed=seq)
        for x, y in zip(a.run(None, feeds), b.run(None, feeds), strict=True):
            worst = max(worst, float(np.abs(x - y).max()))
    if worst > 1e-3:
        raise RuntimeError(f"{fused.name} differs from the original by {worst}")
    return worst


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def timed(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> float:
    t0 = time.perf_counter()
    sess.run(None, feeds)
    return (time.perf_counter() - t0) * 1e3


def measure(variants: dict[str, Path], feeds: dict[str, dict], threads: int, rounds: int) -> dict:
    """Median ms per figure and variant: every round runs each variant once per figure, in an order that
    rotates per round (the host's drift falls on every variant alike)."""
    sessions = {name: session(path, threads) for name, path in variants.items()}
    for sess in sessions.values():  # warm-up: allocations and kernel selection outside the timings
        for f in feeds.values():
            timed(sess, f)
    times: dict[str, dict[str, list[float]]] = {name: {k: [] for k in feeds} for name in variants}
    order = list(variants)
    for rnd in range(rounds):
        for figure, f in feeds.items():
            for name in order[rnd % len(order) :] + order[: rnd % len(order)]:
                times[name][figure].append(timed(sessions[name], f))
    return {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
