"""The gate's pooled stop on synthetic runs: time spent and decisions, with and without it.

Run ``python -m bench.gate_pooled_sim [--seeds 100]``. Three input sets (DeiT's batch 1, 2 and 4 at bench size:
70, 160 and 220 ms), runs drawn log-normal with 5% and 15% spread on a fake clock (no model runs, no wall time),
the gate's parameters of a ``fast`` job (floor of 10 blocks or 5 s, 10 s per set, the tie stop on). Per scenario
(the artifact's true ratio to the upload per set) it prints the median and 90th percentile of the timed seconds,
the median blocks, how often the gate refuses the artifact (``Comparison.slower``) and how often it hands it
back (neither slower nor a tie): the figures behind the pooled stop's paragraph in workers/benchmark.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # bench scripts may run as files rather than with python -m
    sys.path.insert(0, str(REPO))

from core.verdict import LatencyStats, slower_beyond_noise  # noqa: E402
from workers import benchmark  # noqa: E402
from workers.benchmark import BenchmarkParams, Comparison, ShapeComparison  # noqa: E402

CENTERS = [70.0, 160.0, 220.0]
SCENARIOS = {
    "gain 4%": [0.96] * 3,
    "tie": [1.0] * 3,
    "gain 10%": [0.90] * 3,
    "slower 5%": [1.05] * 3,
    "slower 8%": [1.08] * 3,
    "one set +15%": [1.0, 1.0, 1.15],
    "one set +25%": [1.0, 1.0, 1.25],
}
GATE = BenchmarkParams(min_runs=10, min_seconds=5.0, max_seconds=10.0, max_runs=100, tie_stop=True)


class _Clock:
    now = 0.0


class _Runs:
    def __init__(self, centers: list[float], spread: float, rng: np.random.Generator) -> None:
        self.centers, self.spread, self.rng = centers, spread, rng

    def warm_up(self, _index: int, _warmup: int) -> int:
        return 0

    def select(self, index: int) -> Callable[[], float]:
        return lambda: self.centers[index] * float(np.exp(self.spread * self.rng.standard_normal()))


def _fake_clock() -> _Clock:
    clock = _Clock()

    def time_one(run: Callable[[], Any]) -> float:
        ms = float(run())
        clock.now += ms / 1000.0
        return ms

    benchmark.time = types.SimpleNamespace(perf_counter=lambda: clock.now)  # type: ignore[assignment]
    benchmark._time_one = time_one  # type: ignore[assignment]
    return clock


def one_gate(clock: _Clock, ratios: list[float], spread: float, params: BenchmarkParams, seed: int) -> tuple[Any, ...]:
    rng = np.random.default_rng(seed)
    a = _Runs(CENTERS, spread, rng)
    b = _Runs([c * r for c, r in zip(CENTERS, ratios, strict=True)], spread, rng)
    clock.now = 0.0
    states, stops, tied = benchmark._time_sets(a, b, len(CENTERS), params)  # type: ignore[arg-type]
    shapes = [
        ShapeComparison(
            str(i),
            LatencyStats.from_samples(s.a_ms),
            LatencyStats.from_samples(s.b_ms),
            slower_beyond_noise(s.a_ms, s.b_ms, seed=i),
            np.asarray(s.b_ms) / np.asarray(s.a_ms),
            stops[i],
        )
        for i, s in enumerate(states)
    ]
    slower = Comparison(shapes, "full", params, tie=tied).slower
    return clock.now, slower, not slower and not tied, sum(len(s.a_ms) for s in states)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100)
    args = parser.parse_args(argv)
    clock = _fake_clock()
    variants = {"without": GATE, "pooled": dataclasses.replace(GATE, pooled_stop=True)}
    print("| spread | scenario | gate | median s | p90 s | median blocks | refused | handed back |")
    print("|---|---|---|---|---|---|---|---|")
    for spread in (0.05, 0.15):
        for name, ratios in SCENARIOS.items():
            for label, params in variants.items():
                runs = [one_gate(clock, ratios, spread, params, seed) for seed in range(args.seeds)]
                seconds = np.array([r[0] for r in runs])
                timing = f"{np.median(seconds):.1f} | {np.percentile(seconds, 90):.1f}"
                blocks, refused, handed = (np.median([r[3] for r in runs]), *np.mean([r[1:3] for r in runs], axis=0))
                print(f"| {spread:.0%} | {name} | {label} | {timing} | {blocks:.0f} | {refused:.0%} | {handed:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
