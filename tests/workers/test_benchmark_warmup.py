"""workers/benchmark.py: the warm-up of each input set, which ends on runs that show the sessions settled and
times them (``warmed``, ``Runs.settles``, ``_first_block``, ``measure``), on scripted run times."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from core.inputs import generate_input_sets
from tests.workers.conftest import SyntheticClock, SyntheticRuns
from workers import benchmark
from workers.benchmark import (
    BenchmarkParams,
    Runs,
    SessionPool,
    _Blocks,
    _first_block,
    _timed_blocks,
    measure,
    warmed,
)


class _Session:
    def run(self, _outputs: Any, _feed: Any) -> None:
        return None


def _scripted(monkeypatch: pytest.MonkeyPatch, times: list[float]) -> Iterator[float]:
    """Every timed run takes the next of ``times``, in the order the runs are made (A and B together)."""
    script = iter(times)
    monkeypatch.setattr(benchmark, "_time_one", lambda run: (run(), next(script))[1])
    return script


def _built(first_run_ms: float) -> Runs:
    runs = Runs(_Session(), [{"x": np.zeros(1)}, {"x": np.zeros(2)}], BenchmarkParams(warmup=5))
    for index in (0, 1):
        runs.last_ms[index] = first_run_ms  # the timed first run a session makes of each set when it is built
        runs.count(index, 1)
    return runs


def test_warmed_asks_that_a_run_be_no_faster_than_the_one_before_it_beyond_ten_percent() -> None:
    assert not warmed(None, 100.0)  # nothing timed before: no evidence yet
    assert warmed(100.0, 100.0) and warmed(100.0, 91.0)
    assert warmed(100.0, 115.0) and warmed(100.0, 300.0)  # slower: the host's noise, not a session warming up
    assert not warmed(100.0, 89.0) and not warmed(150.0, 100.0)


def test_a_first_block_after_the_cold_one_is_timed_once_the_next_shows_it_settled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Whisper-like: cold runs of 570 and 500 ms at build, settled from the next run on (420 / 330 ms).
    script = _scripted(monkeypatch, [420.0, 330.0, 410.0, 335.0, 999.0])
    a, b = _built(570.0), _built(500.0)
    blocks, seconds = _first_block(a, b, 0, 5)
    # no untimed run: the first block is held (faster than the build's), then the second shows it settled
    assert blocks == [(420.0, 330.0), (410.0, 335.0)] and seconds >= 0.0
    assert a.ran[0] == b.ran[0] == 1 and 0 in a.settled and 0 in b.settled and next(script) == 999.0
    assert _first_block(a, b, 0, 5) == ([], 0.0)  # settled: never warmed up again on that set
    assert a.warming(1, 5) and b.warming(1, 5)  # the other set still is


def test_a_held_block_that_the_next_does_not_confirm_is_untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    # A warms up in two steps (450, 380, then 370 settled); B settles at once (340, 330).
    script = _scripted(monkeypatch, [450.0, 340.0, 380.0, 330.0, 370.0, 335.0, 999.0])
    a, b = _built(570.0), _built(500.0)
    blocks, _ = _first_block(a, b, 0, 5)
    # 450 / 340 held, then untimed (380 is 16% faster); 380 untimed, B settled on 330 (spent, its block dropped);
    # A alone settles on 370, paired with B's run right after it
    assert blocks == [(370.0, 335.0)]
    assert a.ran[0] == 3 and b.ran[0] == 3 and a.last_ms[0] == 380.0 and next(script) == 999.0


def test_a_warm_pooled_model_is_not_run_beside_the_others_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # A is warm on set 1 already (a pooled session): B alone warms up, its settling run paired with one of A
    script = _scripted(monkeypatch, [300.0, 290.0, 150.0, 999.0])
    a, b = _built(200.0), _built(400.0)
    a.settled.add(1)
    assert _first_block(a, b, 1, 5)[0] == [(150.0, 290.0)]
    assert a.ran[1] == 1 and b.ran[1] == 2  # A's paired run is timed (compare counts it), B's 300 untimed
    assert next(script) == 999.0


def test_the_warm_up_is_capped_at_warmup_runs_and_then_times_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each run 20% faster than the one before: never settled. Five runs of the set in all, the build's first.
    times = [1000.0 * 0.8**k for k in range(1, 20)]
    script = _scripted(monkeypatch, [t for t in times for _ in (0, 1)])
    a, b = _built(1000.0), _built(1000.0)
    assert _first_block(a, b, 0, 5) == ([], 0.0)
    assert a.ran[0] == b.ran[0] == 5 and not a.warming(0, 5) and not b.warming(0, 5)
    assert next(script) == pytest.approx(1000.0 * 0.8**5)


def test_a_warm_up_of_zero_makes_no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted(monkeypatch, [])
    assert _first_block(_built(300.0), _built(300.0), 0, 0) == ([], 0.0)


def test_measure_takes_the_settling_run_as_its_first_sample(mlp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sets = generate_input_sets(onnx.load(str(mlp_path)), 1)
    params = BenchmarkParams(warmup=5, min_runs=3, max_runs=3, max_seconds=0.0, intra_op_threads=1)
    # the build's cold run, one untimed run, then the settling run and two more: three samples
    _scripted(monkeypatch, [570.0, 420.0, 410.0, 400.0, 405.0])
    pool = SessionPool()
    (stats,) = measure(mlp_path, sets, params, pool=pool)
    runs = pool.runs(mlp_path, [s.feeds for s in sets], params)[0]
    assert (stats.runs, stats.min_ms, stats.max_ms) == (3, 400.0, 410.0)
    assert runs.ran == {0: 5} and runs.settled == {0}
    pool.close()


def test_the_warm_ups_blocks_open_the_sets_timing_and_count_towards_its_floor(clock: SyntheticClock) -> None:
    params = BenchmarkParams(min_runs=10, max_seconds=60.0, max_runs=1000)
    a, b = SyntheticRuns([100.0], 0.01, 1), SyntheticRuns([80.0], 0.01, 2)
    state = _Blocks()
    a_ms, b_ms, _ = _timed_blocks(
        a.select(0), b.select(0), params, 0, state, until_floor=True, first=([(101.0, 79.0), (99.0, 81.0)], 0.36)
    )
    assert (a_ms[:2], b_ms[:2], len(a_ms)) == ([101.0, 99.0], [79.0, 81.0], 10)  # 2 warm-up blocks + 8 more
    assert state.elapsed_s == pytest.approx(0.36 + 8 * 0.18, rel=0.05)
