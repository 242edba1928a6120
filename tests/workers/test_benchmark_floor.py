"""workers/benchmark.py: the benchmark floor in time and the tie stop, on synthetic
timings (a fake clock advanced by each synthetic run; no wall-clock assertion)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from core.settings import PipelineSettings
from core.verdict import Verdict
from tests.workers.conftest import SyntheticClock, SyntheticRuns
from workers import benchmark
from workers.benchmark import (
    FUTILITY_MIN_PAIRS,
    MIN_SETTLE_PAIRS,
    TIE_STOP,
    BenchmarkParams,
    floor_reached,
    tie,
)


def _runs(center_ms: float, spread: float, seed: int) -> Callable[[], float]:
    """A model whose runs take ``center_ms`` with a relative normal spread (seeded)."""
    rng = np.random.default_rng(seed)
    return lambda: center_ms * (1.0 + spread * float(rng.standard_normal()))


def test_floor_reached_takes_min_runs_or_min_settle_pairs_over_min_seconds_whichever_first() -> None:
    params = BenchmarkParams(min_runs=10, min_seconds=5.0)
    assert not floor_reached(MIN_SETTLE_PAIRS - 1, 60.0, params)  # never under the pairs the rule needs
    assert not floor_reached(MIN_SETTLE_PAIRS, 4.9, params)
    assert floor_reached(MIN_SETTLE_PAIRS, 5.0, params)
    assert floor_reached(10, 0.01, params)  # short runs: the floor in blocks comes first
    assert not floor_reached(9, 60.0, BenchmarkParams(min_runs=10, min_seconds=0.0))  # 0: blocks alone
    assert floor_reached(3, 0.0, BenchmarkParams(min_runs=3, min_seconds=5.0))  # a lower min_runs stays lower


def test_benchmark_params_carry_the_floor_in_time_in_full_mode_only() -> None:
    settings = PipelineSettings(benchmark_min_seconds=7.5)
    assert BenchmarkParams.from_settings(settings, target="cpu").min_seconds == 7.5
    assert BenchmarkParams.from_settings(settings, target="cpu", quick=True).min_seconds == 0.0
    assert PipelineSettings().benchmark_min_seconds == 5.0


def test_runs_of_seconds_that_settle_stop_at_five_pairs_once_min_seconds_passed(clock: SyntheticClock) -> None:
    # A second per A run, B 25% faster: five pairs (9 s) already clear 0.97.
    params = BenchmarkParams(min_runs=10, min_seconds=5.0, max_seconds=60.0, max_runs=1000)
    a_ms, b_ms, stopped = benchmark._timed_blocks(_runs(1000, 0.02, 1), _runs(750, 0.02, 2), params, 0)
    assert (len(a_ms), len(b_ms), stopped) == (MIN_SETTLE_PAIRS, MIN_SETTLE_PAIRS, "settled: clearly faster")
    # Without the floor in time the same runs take the ten blocks of min_runs.
    blocks = dataclasses.replace(params, min_seconds=0.0)
    a_ms, _, stopped = benchmark._timed_blocks(_runs(1000, 0.02, 1), _runs(750, 0.02, 2), blocks, 0)
    assert (len(a_ms), stopped) == (10, "settled: clearly faster")


def test_short_runs_keep_the_floor_in_blocks_when_min_seconds_is_not_reached(clock: SyntheticClock) -> None:
    params = BenchmarkParams(min_runs=10, min_seconds=5.0, max_seconds=60.0, max_runs=1000)
    a_ms, _, stopped = benchmark._timed_blocks(_runs(10, 0.02, 3), _runs(7.5, 0.02, 4), params, 0)
    assert (len(a_ms), stopped) == (10, "settled: clearly faster")


def test_an_open_answer_still_gets_min_runs_when_the_budget_is_spent(clock: SyntheticClock) -> None:
    # Runs of 2 s with 30% noise and no real difference: open at five pairs, the 10 s budget spent by then.
    params = BenchmarkParams(min_runs=10, min_seconds=5.0, max_seconds=10.0, max_runs=1000)
    a_ms, b_ms, stopped = benchmark._timed_blocks(_runs(2000, 0.3, 5), _runs(2000, 0.3, 6), params, 0)
    assert len(a_ms) == len(b_ms) >= 10
    assert stopped == "time budget" or (stopped.startswith("futile") and len(a_ms) >= FUTILITY_MIN_PAIRS)


def _verdict(paired_ratio: float, half_width: float = 0.05) -> Verdict:
    lo, hi = paired_ratio - half_width, paired_ratio + half_width
    margin = max(0.03, half_width)
    return Verdict(paired_ratio, 1 / paired_ratio, margin, paired_ratio, (lo, hi), False, paired_ratio < 1 - margin)


def test_tie_needs_an_open_answer_a_bounded_pooled_gain_under_the_floor_and_no_set_faster() -> None:
    near = [_verdict(1.0), _verdict(0.96), _verdict(1.06)]
    assert tie(near, _verdict(0.99), [None, "settled: not slower", None])
    assert not tie(near, _verdict(0.965), [None, None, None])  # the pooled estimate gains beyond 3%
    # A host so noisy that the pooled interval cannot rule out a 10% gain: no tie, the rules decide as before.
    assert not tie(near, _verdict(0.99, half_width=0.12), [None, None, None])
    # One set faster beyond its margin: its gain is worth the budget, whatever the pooled estimate says.
    assert not tie([_verdict(0.90), _verdict(1.0), _verdict(1.02)], _verdict(1.0), [None, None, None])
    # Every set already answered at the floor: nothing is left to spend, the answer is the rules' own.
    answered = ["settled: within noise", "settled: not slower", "futile: not slower whatever the budget left"]
    assert not tie(near, _verdict(0.99), answered)


def test_time_sets_stops_every_set_at_its_floor_when_a_noisy_tie_and_tie_stop(clock: SyntheticClock) -> None:
    # ViT at bench size on a loaded host: the same speed on three sets, pairs off by 20%; without the tie stop
    # the sets run on until the interval clears 1.03 or the budget says futile.
    params = BenchmarkParams(min_runs=10, min_seconds=5.0, max_seconds=30.0, max_runs=1000, tie_stop=True)
    centers = [40.0, 80.0, 160.0]
    a, b = SyntheticRuns(centers, 0.15, 7), SyntheticRuns(centers, 0.15, 8)
    states, stops, tied = benchmark._time_sets(a, b, 3, params)  # type: ignore[arg-type]
    assert tied and all(len(s.a_ms) == len(s.b_ms) == 10 for s in states)
    assert all(stop == TIE_STOP or stop.startswith(("settled", "futile")) for stop in stops)
    assert TIE_STOP in stops
    assert a.warmed == b.warmed == [0, 1, 2]  # each set warmed up once
    # The same runs without the tie stop: at least one set goes on past its floor.
    plain = dataclasses.replace(params, tie_stop=False)
    a, b = SyntheticRuns(centers, 0.15, 7), SyntheticRuns(centers, 0.15, 8)
    states, stops, tied = benchmark._time_sets(a, b, 3, plain)  # type: ignore[arg-type]
    assert not tied and TIE_STOP not in stops and max(len(s.a_ms) for s in states) > 10


def test_time_sets_goes_on_past_the_floor_when_one_set_gains_beyond_the_floor(clock: SyntheticClock) -> None:
    # Batch 1 clearly faster, the larger sets a noisy tie: no tie, each set is timed to its own answer.
    params = BenchmarkParams(min_runs=10, min_seconds=5.0, max_seconds=30.0, max_runs=1000, tie_stop=True)
    a = SyntheticRuns([40.0, 80.0, 160.0], 0.15, 9)
    b = SyntheticRuns([30.0, 80.0, 160.0], 0.15, 10)
    states, stops, tied = benchmark._time_sets(a, b, 3, params)  # type: ignore[arg-type]
    assert not tied and TIE_STOP not in stops
    assert all(stop is not None for stop in stops) and a.warmed == [0, 1, 2]
    # Resumed sets keep their floor's blocks and the A/B order of their block numbers.
    assert all(len(s.a_ms) == len(s.b_ms) >= 10 for s in states)


def test_time_sets_ends_as_the_rules_say_when_every_set_is_settled_at_the_floor(clock: SyntheticClock) -> None:
    # A quiet host and a real tie: every interval sits inside 0.97..1.03 at ten blocks; "within noise" is the
    # rules' answer, the artifact is handed back as before (no tie).
    params = BenchmarkParams(min_runs=10, min_seconds=5.0, max_seconds=30.0, max_runs=1000, tie_stop=True)
    a, b = SyntheticRuns([40.0, 80.0], 0.002, 11), SyntheticRuns([40.0, 80.0], 0.002, 12)
    states, stops, tied = benchmark._time_sets(a, b, 2, params)  # type: ignore[arg-type]
    assert not tied and stops == ["settled: within noise"] * 2
    assert [len(s.a_ms) for s in states] == [10, 10]
