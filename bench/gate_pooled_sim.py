"""The gate's pooled stop on synthetic runs: time spent and decisions, with and without it.

Run ``python -m bench.gate_pooled_sim [--seeds 100]``. Three input sets (DeiT's batch 1, 2 and 4 at bench size:
70, 160 and 220 ms), runs drawn log-normal with 5% and 15% spread on a fake clock (no model runs, no wall time),
the gate's parameters of a ``fast`` job (floor of 10 blocks or 5 s, 10 s per set, the tie stop on). Per scenario
(the artifact's true ratio to the upload per set) it prints the median and 90th percentile of the timed seconds,
the median blocks, how often the gate refuses the artifact (``Comparison.slower``) and how often it hands it
back (neither slower nor a tie): the figures behind the pooled stop's paragraph in workers/benchmark.py.

``--floor S`` compares the floor in time (``benchmark_min_seconds``, 5 s) with ``S`` seconds, each session started
cold as with ``--warmup`` and warmed up as ``workers.benchmark`` does.

``--warmup`` compares the warm-up instead, the pooled stop on in both: ``before``, each model's untimed runs until
one is within 10% of the run before it, spent (the rule up to this change), against ``after``, the warm-up of
``workers.benchmark._first_block`` (untimed runs until one is no faster than the run before it beyond 10%, that
run timed as the set's first block, and the first block after the build timed too when the next one shows it
settled). Each model's runs of a set then start cold: the run made when the session
is built takes ``--cold`` times the set's center (1.5: measured with ``bench.warmup_settle``) and the runs after
it ``--curve`` times (default none: settled from the first run after the build; ``1.2`` is a second run still
20% slow, as Whisper's encoder showed once at load 4-6). The seconds include the warm-up runs. ``--centers``
sets the three sets' run times (``130,260,520``: Whisper's encoder at bench size on a quiet host), and the
scenarios add a set 15% or 25% slower as the first or second set too.
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
    """One model's synthetic runs per input set, warm from the first (``cold`` None), or as a session: built
    with one cold run of each set, then the ``curve`` and settled runs, and warmed up as ``workers.benchmark``
    does (``legacy``: each model's untimed runs until one is within 10% of the one before it, all spent)."""

    def __init__(
        self,
        centers: list[float],
        spread: float,
        rng: np.random.Generator,
        *,
        cold: float | None = None,
        curve: tuple[float, ...] = (),
        legacy: bool = False,
    ) -> None:
        self.centers, self.spread, self.rng = centers, spread, rng
        self.cold, self.curve, self.legacy = cold, curve, legacy
        self.made = [0] * len(centers)  # runs made per set after the build's
        self.runs: benchmark.Runs | None = None
        if cold is not None:
            self.runs = benchmark.Runs(None, [{}] * len(centers), BenchmarkParams())
            for index in range(len(centers)):
                self.runs.untimed(index, self._draw(index, cold))  # the build's run, timed, not on the clock

    def _draw(self, index: int, factor: float = 1.0) -> float:
        return self.centers[index] * factor * float(np.exp(self.spread * self.rng.standard_normal()))

    def _run(self, index: int) -> float:
        made, self.made[index] = self.made[index], self.made[index] + 1
        return self._draw(index, self.curve[made] if made < len(self.curve) else 1.0)

    def warming(self, index: int, warmup: int) -> bool:
        if self.runs is None:
            return False
        if self.legacy and self.runs.warming(index, warmup):
            # the rule before _first_block: up to the cap, spend runs until one is within 10% of the one before
            while self.runs.ran[index] < warmup:
                took = benchmark._time_one(lambda: self._run(index))
                previous = self.runs.last_ms[index]
                self.runs.untimed(index, took)
                if abs(took - previous) <= benchmark.WARMUP_SETTLE * previous:
                    break
            self.runs.settle(index)
        return self.runs.warming(index, warmup)

    def settles(self, index: int, ms: float, warmup: int) -> bool:
        assert self.runs is not None
        return self.runs.settles(index, ms, warmup)

    def untimed(self, index: int, ms: float) -> None:
        assert self.runs is not None
        self.runs.untimed(index, ms)

    def settle(self, index: int) -> None:
        assert self.runs is not None
        self.runs.settle(index)

    def select(self, index: int) -> Callable[[], float]:
        if self.runs is None:
            return lambda: self._draw(index)
        return lambda: self._run(index)


def _fake_clock() -> _Clock:
    clock = _Clock()

    def time_one(run: Callable[[], Any]) -> float:
        ms = float(run())
        clock.now += ms / 1000.0
        return ms

    benchmark.time = types.SimpleNamespace(perf_counter=lambda: clock.now)  # type: ignore[assignment]
    benchmark._time_one = time_one  # type: ignore[assignment]
    return clock


def one_gate(
    clock: _Clock, ratios: list[float], spread: float, params: BenchmarkParams, seed: int, **session: Any
) -> tuple[Any, ...]:
    """One gate's timing: (seconds, refused, handed back, blocks). ``session``: ``_Runs``' cold-start options."""
    rng = np.random.default_rng(seed)
    a = _Runs(CENTERS, spread, rng, **session)
    b = _Runs([c * r for c, r in zip(CENTERS, ratios, strict=True)], spread, rng, **session)
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
    parser.add_argument("--centers", default=",".join(f"{c:g}" for c in CENTERS), help="the sets' run times, ms")
    parser.add_argument("--warmup", action="store_true", help="compare the warm-up rules (module docstring)")
    parser.add_argument("--cold", type=float, default=1.5, help="--warmup: the build run's factor")
    parser.add_argument("--curve", default="", help="--warmup: factors of the runs after the build, e.g. 1.2")
    parser.add_argument(
        "--floor", type=float, default=None, help="compare the floor in time (benchmark_min_seconds) with this one"
    )
    args = parser.parse_args(argv)
    CENTERS[:] = [float(c) for c in args.centers.split(",")]
    clock = _fake_clock()
    pooled = dataclasses.replace(GATE, pooled_stop=True)
    scenarios = dict(SCENARIOS)
    variants: dict[str, tuple[BenchmarkParams, dict[str, Any]]]
    if args.floor is not None:
        session = {"cold": args.cold, "curve": tuple(float(f) for f in args.curve.split(",") if f)}
        lower = dataclasses.replace(pooled, min_seconds=args.floor)
        variants = {f"floor {GATE.min_seconds:g} s": (pooled, session), f"floor {args.floor:g} s": (lower, session)}
        scenarios.update({"set 1 +15%": [1.15, 1.0, 1.0], "set 1 +25%": [1.25, 1.0, 1.0]})
    elif args.warmup:
        curve = tuple(float(f) for f in args.curve.split(",") if f)
        session = {"cold": args.cold, "curve": curve}
        variants = {"before": (pooled, {**session, "legacy": True}), "after": (pooled, session)}
        scenarios.update({"set 1 +15%": [1.15, 1.0, 1.0], "set 2 +15%": [1.0, 1.15, 1.0]})
        scenarios.update({"set 1 +25%": [1.25, 1.0, 1.0], "set 2 +25%": [1.0, 1.25, 1.0]})
    else:
        variants = {"without": (GATE, {}), "pooled": (pooled, {})}
    print(f"centers {CENTERS} ms" + (f", cold {args.cold}, curve {args.curve or 'none'}" if args.warmup else ""))
    print("| spread | scenario | gate | median s | p90 s | median blocks | refused | handed back |")
    print("|---|---|---|---|---|---|---|---|")
    for spread in (0.05, 0.15):
        for name, ratios in scenarios.items():
            for label, (params, session) in variants.items():
                runs = [one_gate(clock, ratios, spread, params, seed, **session) for seed in range(args.seeds)]
                seconds = np.array([r[0] for r in runs])
                timing = f"{np.median(seconds):.1f} | {np.percentile(seconds, 90):.1f}"
                blocks, refused, handed = (np.median([r[3] for r in runs]), *np.mean([r[1:3] for r in runs], axis=0))
                print(f"| {spread:.0%} | {name} | {label} | {timing} | {blocks:.0f} | {refused:.0%} | {handed:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
