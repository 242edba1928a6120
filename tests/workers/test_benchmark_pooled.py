"""workers/benchmark.py: the gate's stop once the decision over every input set is taken (``pooled_stop``,
``decided``), on synthetic timings (a fake clock advanced by each synthetic run; no wall-clock assertion)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from core.verdict import LatencyStats, slower_beyond_noise
from tests.workers.conftest import SyntheticClock, SyntheticRuns
from workers import benchmark
from workers.benchmark import (
    POOLED_STOP,
    BenchmarkParams,
    Comparison,
    ShapeComparison,
    cannot_turn_clearly_slower,
    decided,
)


def _blocks(pairs: list[float], a_ms: float = 100.0, elapsed_s: float = 1.0) -> benchmark._Blocks:
    """One input set's blocks whose paired ratios b/a are ``pairs``."""
    return benchmark._Blocks([a_ms] * len(pairs), [a_ms * p for p in pairs], elapsed_s, len(pairs))


def _comparison(states: list[benchmark._Blocks], stops: list[str | None], params: BenchmarkParams) -> Comparison:
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
    return Comparison(shapes, "full", params)


# DeiT at bench size on a loaded host: batch 1, 2 and 4 at 224x224, the artifact 4% faster, pairs off by 12%.
_CENTERS_A = [70.0, 160.0, 220.0]
_CENTERS_B = [67.0, 154.0, 211.0]
_GATE = BenchmarkParams(min_runs=10, min_seconds=5.0, max_seconds=30.0, max_runs=1000, tie_stop=True)


@pytest.mark.parametrize("seed", [8, 22, 34])
def test_time_sets_stops_the_open_sets_once_the_pooled_decision_is_taken_when_pooled_stop(
    clock: SyntheticClock, seed: int
) -> None:
    plain_a, plain_b = SyntheticRuns(_CENTERS_A, 0.12, seed), SyntheticRuns(_CENTERS_B, 0.12, seed + 1)
    plain_states, plain_stops, _ = benchmark._time_sets(plain_a, plain_b, 3, _GATE)  # type: ignore[arg-type]
    params = dataclasses.replace(_GATE, pooled_stop=True)
    a, b = SyntheticRuns(_CENTERS_A, 0.12, seed), SyntheticRuns(_CENTERS_B, 0.12, seed + 1)
    states, stops, tied = benchmark._time_sets(a, b, 3, params)  # type: ignore[arg-type]
    assert not tied and any(stop is not None and stop.startswith(POOLED_STOP) for stop in stops)
    assert all(stop is not None for stop in stops)
    assert a.warmed == b.warmed == [0, 1, 2]  # each set warmed up once, the turns after the floor are not
    # Every set still gets its floor, and the pooled stop spends fewer blocks than each set to its own end.
    assert all(len(s.a_ms) == len(s.b_ms) >= _GATE.min_runs for s in states)
    assert sum(len(s.a_ms) for s in states) < sum(len(s.a_ms) for s in plain_states)
    # The decision the gate takes on it is the one it took on every set timed to its own end: not slower.
    assert not _comparison(states, stops, params).slower
    assert not _comparison(plain_states, plain_stops, _GATE).slower


def test_time_sets_calls_a_tie_after_the_floor_when_the_turns_show_one_and_tie_stop(clock: SyntheticClock) -> None:
    # Open at the floor without a tie (a set looked faster there); the turns after it bring the pooled estimate
    # to a tie, which ends the comparison then instead of at the end of every set's budget.
    params = dataclasses.replace(_GATE, pooled_stop=True)
    a, b = SyntheticRuns(_CENTERS_A, 0.12, 14), SyntheticRuns(_CENTERS_B, 0.12, 15)
    states, stops, tied = benchmark._time_sets(a, b, 3, params)  # type: ignore[arg-type]
    assert tied and benchmark.TIE_STOP in stops and all(stop is not None for stop in stops)
    assert max(len(s.a_ms) for s in states) > _GATE.min_runs  # called past the floor
    plain_a, plain_b = SyntheticRuns(_CENTERS_A, 0.12, 14), SyntheticRuns(_CENTERS_B, 0.12, 15)
    plain_states, _, plain_tied = benchmark._time_sets(plain_a, plain_b, 3, _GATE)  # type: ignore[arg-type]
    assert not plain_tied  # at the floor alone there was no tie
    assert sum(len(s.a_ms) for s in states) < sum(len(s.a_ms) for s in plain_states)


def test_decided_waits_while_an_open_set_may_still_turn_clearly_slower() -> None:
    params = BenchmarkParams(min_runs=10, max_seconds=30.0, max_runs=1000)
    rng = np.random.default_rng(3)
    faster = [_blocks(list(0.80 + 0.01 * rng.standard_normal(20))) for _ in range(2)]
    # The pooled verdict is settled (clearly faster), but the third set sits near the 10% step, its pairs wide.
    near_step = _blocks(list(1.08 + 0.15 * rng.standard_normal(12)))
    assert decided([*faster, near_step], ["settled: clearly faster", "settled: clearly faster", None], params) is None
    # The same set on par with the upload, its interval under 1.10: nothing it can still show turns the decision.
    on_par = _blocks(list(1.00 + 0.03 * rng.standard_normal(12)))
    answer = decided([*faster, on_par], ["settled: clearly faster", "settled: clearly faster", None], params)
    assert answer == f"{POOLED_STOP}: settled: clearly faster"


def test_decided_needs_five_pairs_in_every_set_and_an_open_one() -> None:
    params = BenchmarkParams(min_runs=10, max_seconds=30.0, max_runs=1000)
    tight = _blocks([0.8] * 20)
    assert decided([tight, _blocks([1.0] * 4)], [None, None], params) is None  # four pairs: no interval yet
    assert decided([tight, tight], ["settled: clearly faster"] * 2, params) is None  # nothing left open


def test_cannot_turn_clearly_slower_reads_the_ten_percent_step_not_the_three_percent_floor() -> None:
    rng = np.random.default_rng(5)
    # 1.05 with 5% noise: open for the 3% floor, and out of the 10% step's reach.
    pairs = 1.05 + 0.05 * rng.standard_normal(12)
    verdict = slower_beyond_noise(np.ones(12), pairs)
    assert verdict.ci95[0] < 1.03 < verdict.ci95[1] < 1.10
    assert cannot_turn_clearly_slower(verdict, pairs=12, remaining=100)
    # Already past the step: its own rules decide it, never the pooled stop.
    past = slower_beyond_noise(np.ones(12), 1.3 + 0.01 * rng.standard_normal(12))
    assert not cannot_turn_clearly_slower(past, pairs=12, remaining=100)
    # Noisy pairs near the step, ten of them and a long budget left: it may yet cross.
    noisy = slower_beyond_noise(np.ones(10), 1.08 + 0.2 * rng.standard_normal(10))
    assert not cannot_turn_clearly_slower(noisy, pairs=10, remaining=100)
    assert not cannot_turn_clearly_slower(verdict, pairs=4, remaining=100)  # under five pairs: never
