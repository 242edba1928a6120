"""Latency statistics and the "slower beyond noise" verdict: pure functions of timings.

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
from collections.abc import Sequence
from typing import Any

import numpy as np

NOISY_CV = 0.10
MIN_MARGIN = 0.03
CLEAR_SLOWDOWN = 0.10  # one input set alone makes a model slower beyond this
BOOTSTRAP_RESAMPLES = 1000


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
