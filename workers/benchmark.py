"""Latency measurement and the "slower beyond noise" rule.

Fairness: the original (A) and the candidate (B) are timed **interleaved in one process**. Runs go in
blocks of one A run and one B run; the order inside a block alternates (AB, BA, AB, ...), so drift in
clock speed, cache state or a noisy neighbour hits both models alike, and each block gives one *paired*
ratio b/a. Sessions are built with ORT's default optimizations (ORT_ENABLE_ALL), i.e. what a user who
deploys the artifact gets; verification, by contrast, turns them off.

Stopping: after ``warmup`` untimed runs of each, at least ``min_runs`` timed runs each, then more while the
time budget ``max_seconds`` lasts, up to ``max_runs``.

Slower beyond noise (``slower_beyond_noise``), per input set:

    ratio   = median(B) / median(A)
    noise   = half-width of the 95% bootstrap interval of the median paired ratio b_i/a_i
    margin  = max(3%, noise)
    slower  = ratio > 1 + margin

so a model is called slower only when the slowdown exceeds both a fixed 3% floor (below that nobody can
act on it) and the spread this very measurement showed. The bootstrap is seeded, so the verdict is a pure
function of the timings.

Over several input sets (``Comparison.slower``), a model is slower when either

* the **pooled** verdict says so: the same rule on the paired ratios of every input set together (ratios
  are unit-free, so sets of different sizes pool), which catches a consistent small slowdown; or
* **one input set is clearly slower**: its ratio exceeds 1 + max(10%, 2 x its margin), which catches a
  slowdown on one shape without firing on the noise of many small per-set tests.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from workers.verify import InputSet, make_session

NOISY_CV = 0.10
MIN_MARGIN = 0.03
CLEAR_SLOWDOWN = 0.10  # one input set alone makes a model slower beyond this
BOOTSTRAP_RESAMPLES = 1000


@dataclasses.dataclass
class BenchmarkParams:
    warmup: int = 5
    min_runs: int = 30
    max_seconds: float = 10.0
    max_runs: int = 1000
    target: str = "cpu"
    intra_op_threads: int = 0

    @classmethod
    def from_settings(cls, settings: Any, *, target: str, quick: bool = False) -> BenchmarkParams:
        """Full mode from the benchmark_* settings; quick mode (the per-pass ledger) does ledger_runs."""
        if quick:
            runs = settings.ledger_runs
            return cls(
                warmup=min(2, settings.benchmark_warmup),
                min_runs=runs,
                max_seconds=0.0,
                max_runs=runs,
                target=target,
                intra_op_threads=settings.intra_op_threads,
            )
        return cls(
            warmup=settings.benchmark_warmup,
            min_runs=settings.benchmark_min_runs,
            max_seconds=settings.benchmark_max_seconds,
            max_runs=max(settings.benchmark_min_runs, 10 * settings.benchmark_min_runs),
            target=target,
            intra_op_threads=settings.intra_op_threads,
        )


@dataclasses.dataclass
class LatencyStats:
    runs: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    p25_ms: float
    p75_ms: float
    cv: float  # standard deviation / mean
    robust_cv: float  # 1.4826 * MAD / median
    noisy: bool  # cv > 10%
    throughput_per_s: float  # input sets per second at the median latency, one stream
    peak_rss_delta_mb: float | None = None

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float], peak_rss_delta_mb: float | None = None) -> LatencyStats:
        x = np.asarray(samples_ms, dtype=np.float64)
        med = float(np.median(x))
        mean = float(x.mean())
        cv = float(x.std() / mean) if mean > 0 else 0.0
        mad = float(np.median(np.abs(x - med)))
        p = np.percentile(x, [25, 75, 90, 99])
        return cls(
            runs=len(x),
            p50_ms=med,
            p90_ms=float(p[2]),
            p99_ms=float(p[3]),
            mean_ms=mean,
            min_ms=float(x.min()),
            max_ms=float(x.max()),
            p25_ms=float(p[0]),
            p75_ms=float(p[1]),
            cv=cv,
            robust_cv=1.4826 * mad / med if med > 0 else 0.0,
            noisy=cv > NOISY_CV,
            throughput_per_s=1000.0 / med if med > 0 else 0.0,
            peak_rss_delta_mb=peak_rss_delta_mb,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Verdict:
    ratio: float  # median(B) / median(A); < 1 means B is faster
    speedup: float  # 1 / ratio
    margin: float  # the noise margin the verdict used
    paired_ratio: float  # median of per-block b/a
    ci95: tuple[float, float]  # bootstrap interval of the median paired ratio
    slower: bool  # B slower than A beyond the margin
    faster: bool  # B faster than A beyond the margin

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ci95"] = list(self.ci95)
        return d


def _verdict(ratio: float, pairs: np.ndarray, seed: int) -> Verdict:
    paired = float(np.median(pairs))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(pairs), size=(BOOTSTRAP_RESAMPLES, len(pairs)))
    medians = np.median(pairs[idx], axis=1)
    lo, hi = (float(v) for v in np.percentile(medians, [2.5, 97.5]))
    margin = max(MIN_MARGIN, hi - paired, paired - lo)
    return Verdict(
        ratio=ratio,
        speedup=1.0 / ratio if ratio > 0 else 0.0,
        margin=margin,
        paired_ratio=paired,
        ci95=(lo, hi),
        slower=ratio > 1.0 + margin,
        faster=ratio < 1.0 - margin,
    )


def slower_beyond_noise(a_ms: Sequence[float], b_ms: Sequence[float], *, seed: int = 0) -> Verdict:
    """The per-set rule in the module docstring. ``a_ms[i]`` and ``b_ms[i]`` must come from one block."""
    a, b = np.asarray(a_ms, dtype=np.float64), np.asarray(b_ms, dtype=np.float64)
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    return _verdict(float(np.median(b) / np.median(a)), b / a, seed)


def pooled_verdict(pairs: Sequence[np.ndarray], *, seed: int = 0) -> Verdict:
    """The rule on the paired ratios of several input sets together; ratio = their median."""
    pooled = np.concatenate([np.asarray(p, dtype=np.float64) for p in pairs])
    return _verdict(float(np.median(pooled)), pooled, seed)


@dataclasses.dataclass
class ShapeComparison:
    input_set: str
    a: LatencyStats
    b: LatencyStats
    verdict: Verdict
    pairs: np.ndarray = dataclasses.field(default_factory=lambda: np.ones(1), repr=False)  # b_i / a_i

    @property
    def clearly_slower(self) -> bool:
        return self.verdict.ratio > 1.0 + max(CLEAR_SLOWDOWN, 2 * self.verdict.margin)

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_set": self.input_set,
            "original": self.a.to_dict(),
            "optimized": self.b.to_dict(),
            **self.verdict.to_dict(),
            "clearly_slower": self.clearly_slower,
        }


@dataclasses.dataclass
class Comparison:
    shapes: list[ShapeComparison]
    mode: str  # "quick" (ledger) or "full"
    params: BenchmarkParams

    @property
    def pooled(self) -> Verdict:
        return pooled_verdict([s.pairs for s in self.shapes])

    @property
    def slower(self) -> bool:
        """Pooled verdict slower, or one input set clearly slower (module docstring)."""
        return self.pooled.slower or any(s.clearly_slower for s in self.shapes)

    @property
    def speedup(self) -> float:
        """Geometric mean over input sets of median(A) / median(B)."""
        return float(np.exp(np.mean([np.log(s.verdict.speedup) for s in self.shapes])))

    @property
    def p50_a_ms(self) -> float:
        return float(np.mean([s.a.p50_ms for s in self.shapes]))

    @property
    def p50_b_ms(self) -> float:
        return float(np.mean([s.b.p50_ms for s in self.shapes]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "slower": self.slower,
            "pooled": self.pooled.to_dict(),
            "speedup": self.speedup,
            "p50_ms_original": self.p50_a_ms,
            "p50_ms_optimized": self.p50_b_ms,
            "params": dataclasses.asdict(self.params),
            "shapes": [s.to_dict() for s in self.shapes],
        }


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _session_with_memory(
    path: Path,
    feeds: Sequence[dict[str, np.ndarray]],
    params: BenchmarkParams,
    recipe: dict[str, Any] | None = None,
) -> tuple[Any, float]:
    """Create a session and run its warm-ups; the RSS growth meanwhile (sampled after each step), in MiB.

    Approximate by nature (allocator caches, the other session alive beside it), but it tells a model that
    needs 10x the memory of the original from one that does not.
    """
    gc.collect()
    base = peak = _rss()
    session = make_session(
        path, target=params.target, intra_op_threads=params.intra_op_threads, optimize=True, recipe=recipe
    )
    peak = max(peak, _rss())
    for _ in range(max(1, params.warmup)):
        for feed in feeds:
            session.run(None, feed)
            peak = max(peak, _rss())
    return session, (peak - base) / (1 << 20)


def _time_one(session: Any, feed: dict[str, np.ndarray]) -> float:
    start = time.perf_counter_ns()
    session.run(None, feed)
    return (time.perf_counter_ns() - start) / 1e6


def compare(
    path_a: Path,
    path_b: Path,
    input_sets: Sequence[InputSet],
    params: BenchmarkParams,
    *,
    mode: str = "full",
    recipe_a: dict[str, Any] | None = None,
    recipe_b: dict[str, Any] | None = None,
) -> Comparison:
    """Benchmark A (original) against B (candidate), interleaved, per input set. A recipe (tune_session's
    ``onnxforge.session``) sets that model's session options and EP options."""
    feeds = [s.feeds for s in input_sets]
    session_a, mem_a = _session_with_memory(path_a, feeds, params, recipe_a)
    session_b, mem_b = _session_with_memory(path_b, feeds, params, recipe_b)
    results = []
    for index, input_set in enumerate(input_sets):
        feed = input_set.feeds
        for _ in range(params.warmup):
            session_a.run(None, feed)
            session_b.run(None, feed)
        a_ms: list[float] = []
        b_ms: list[float] = []
        start = time.perf_counter()
        block = 0
        while True:
            if (block + index) % 2 == 0:
                a_ms.append(_time_one(session_a, feed))
                b_ms.append(_time_one(session_b, feed))
            else:
                b_ms.append(_time_one(session_b, feed))
                a_ms.append(_time_one(session_a, feed))
            block += 1
            if block >= params.max_runs:
                break
            if block >= params.min_runs and time.perf_counter() - start >= params.max_seconds:
                break
        results.append(
            ShapeComparison(
                input_set.name,
                LatencyStats.from_samples(a_ms, mem_a),
                LatencyStats.from_samples(b_ms, mem_b),
                slower_beyond_noise(a_ms, b_ms, seed=index),
                np.asarray(b_ms) / np.asarray(a_ms),
            )
        )
    del session_a, session_b
    gc.collect()
    return Comparison(results, mode, params)


def measure(path: Path, input_sets: Sequence[InputSet], params: BenchmarkParams) -> list[LatencyStats]:
    """One model alone (the ledger's baseline): stats per input set."""
    feeds = [s.feeds for s in input_sets]
    session, mem = _session_with_memory(path, feeds, params)
    out = []
    for feed in feeds:
        samples = []
        start = time.perf_counter()
        while True:
            samples.append(_time_one(session, feed))
            if len(samples) >= params.max_runs:
                break
            if len(samples) >= params.min_runs and time.perf_counter() - start >= params.max_seconds:
                break
        out.append(LatencyStats.from_samples(samples, mem))
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "processor\t: arm")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_info(*, target: str, intra_op_threads: int) -> dict[str, Any]:
    """What a benchmark ran on: enough to tell whether two reports are comparable."""
    import onnx
    import onnxruntime as ort

    from workers.verify import providers_for

    try:
        providers = providers_for(target)
    except Exception:
        providers = []
    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "physical_cpus": psutil.cpu_count(logical=False),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_total_mb": psutil.virtual_memory().total // (1 << 20),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "onnx_version": onnx.__version__,
        "onnxruntime_version": ort.__version__,
        "target": target,
        "execution_providers": providers,
        "intra_op_threads": intra_op_threads,
        "intra_op_threads_effective": intra_op_threads or "ort-default",
        "inter_op_threads": 1,
        "benchmark_graph_optimization_level": "ORT_ENABLE_ALL",
        "verification_graph_optimization_level": "ORT_DISABLE_ALL",
    }
