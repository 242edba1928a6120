"""workers/benchmark.py: the warm-up that stops once runs settle and the benchmark floor in time, on synthetic
timings (a fake clock advanced by each synthetic run; no wall-clock assertion)."""

from __future__ import annotations

import dataclasses
import itertools
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from core.settings import PipelineSettings
from workers import benchmark
from workers.benchmark import (
    FUTILITY_MIN_PAIRS,
    MIN_SETTLE_PAIRS,
    BenchmarkParams,
    Runs,
    floor_reached,
    warmed,
)


class _Clock:
    """``time.perf_counter`` for workers.benchmark, advanced only by the synthetic runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(benchmark, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))

    def time_one(run: Callable[[], Any]) -> float:
        ms = float(run())
        fake.now += ms / 1000.0
        return ms

    monkeypatch.setattr(benchmark, "_time_one", time_one)
    return fake


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


def test_runs_of_seconds_that_settle_stop_at_five_pairs_once_min_seconds_passed(clock: _Clock) -> None:
    # A second per A run, B 25% faster: five pairs (9 s) already clear 0.97.
    params = BenchmarkParams(min_runs=10, min_seconds=5.0, max_seconds=60.0, max_runs=1000)
    a_ms, b_ms, stopped = benchmark._timed_blocks(_runs(1000, 0.02, 1), _runs(750, 0.02, 2), params, 0)
    assert (len(a_ms), len(b_ms), stopped) == (MIN_SETTLE_PAIRS, MIN_SETTLE_PAIRS, "settled: clearly faster")
    # Without the floor in time the same runs take the ten blocks of min_runs.
    blocks = dataclasses.replace(params, min_seconds=0.0)
    a_ms, _, stopped = benchmark._timed_blocks(_runs(1000, 0.02, 1), _runs(750, 0.02, 2), blocks, 0)
    assert (len(a_ms), stopped) == (10, "settled: clearly faster")


def test_short_runs_keep_the_floor_in_blocks_when_min_seconds_is_not_reached(clock: _Clock) -> None:
    params = BenchmarkParams(min_runs=10, min_seconds=5.0, max_seconds=60.0, max_runs=1000)
    a_ms, _, stopped = benchmark._timed_blocks(_runs(10, 0.02, 3), _runs(7.5, 0.02, 4), params, 0)
    assert (len(a_ms), stopped) == (10, "settled: clearly faster")


def test_an_open_answer_still_gets_min_runs_when_the_budget_is_spent(clock: _Clock) -> None:
    # Runs of 2 s with 30% noise and no real difference: open at five pairs, the 10 s budget spent by then.
    params = BenchmarkParams(min_runs=10, min_seconds=5.0, max_seconds=10.0, max_runs=1000)
    a_ms, b_ms, stopped = benchmark._timed_blocks(_runs(2000, 0.3, 5), _runs(2000, 0.3, 6), params, 0)
    assert len(a_ms) == len(b_ms) >= 10
    assert stopped == "time budget" or (stopped.startswith("futile") and len(a_ms) >= FUTILITY_MIN_PAIRS)


def test_warmed_compares_a_run_with_the_one_before_it() -> None:
    assert not warmed(None, 100.0)  # nothing timed before: no evidence yet
    assert warmed(100.0, 109.0) and warmed(100.0, 91.0)
    assert not warmed(150.0, 100.0) and not warmed(100.0, 115.0)


class _Session:
    def run(self, _outputs: Any, _feed: Any) -> None:
        return None


def _scripted(monkeypatch: pytest.MonkeyPatch, times: list[float]) -> Iterator[float]:
    script = iter(times)
    monkeypatch.setattr(benchmark, "_time_one", lambda run: (run(), next(script))[1])
    return script


def _built(first_run_ms: float) -> Runs:
    runs = Runs(_Session(), [{"x": np.zeros(1)}], BenchmarkParams(warmup=5))
    runs.last_ms[0] = first_run_ms  # the timed first run a session makes of each set when it is built
    runs.count(0, 1)
    return runs


def test_warm_up_stops_once_a_run_is_within_ten_percent_of_the_one_before(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whisper-like: a cold first run of 570 ms, then 420, 355, 350 (settled), never the last 900.
    script = _scripted(monkeypatch, [420.0, 355.0, 350.0, 900.0])
    runs = _built(570.0)
    assert runs.warm_up(0, 5) == 3
    assert runs.ran == {0: 4} and runs.last_ms[0] == 350.0 and next(script) == 900.0


def test_warm_up_is_capped_when_runs_never_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted(monkeypatch, [float(t) for t in itertools.islice(itertools.cycle([100, 200]), 50)])
    runs = _built(300.0)
    assert runs.warm_up(0, 5) == 4  # five runs of the set in all, the first one at build
    assert runs.warm_up(0, 5) == 0  # warm already: a pooled session is not warmed up again
    assert runs.ran == {0: 5}


def test_warm_up_of_zero_makes_no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted(monkeypatch, [])
    assert _built(300.0).warm_up(0, 0) == 0
