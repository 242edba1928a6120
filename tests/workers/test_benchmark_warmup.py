"""workers/benchmark.py: the warm-up of each input set, which ends on a run that shows the session settled and
times that run (``warmed``, ``Runs.settles``, ``_first_block``, ``measure``), on scripted run times."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from core.inputs import generate_input_sets
from workers import benchmark
from workers.benchmark import BenchmarkParams, Runs, SessionPool, _first_block, measure, warmed


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


def test_the_run_that_shows_both_sessions_settled_is_the_first_timed_block(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whisper-like: cold runs of 570 and 500 ms at build, settled from the next run on (420 / 330 ms).
    script = _scripted(monkeypatch, [420.0, 330.0, 410.0, 335.0, 999.0])
    a, b = _built(570.0), _built(500.0)
    a_ms, b_ms, seconds = _first_block(a, b, 0, 5) or (0.0, 0.0, 0.0)
    # one untimed run each (not two, as when the run that settles was spent too); the settling pair is timed
    assert (a_ms, b_ms) == (410.0, 335.0) and seconds >= 0.0
    assert a.ran[0] == b.ran[0] == 2 and a.last_ms[0] == 420.0 and b.last_ms[0] == 330.0
    assert 0 in a.settled and 0 in b.settled and next(script) == 999.0
    assert _first_block(a, b, 0, 5) is None  # settled: never warmed up again on that set
    assert a.warming(1, 5) and b.warming(1, 5)  # the other set still is


def test_a_settled_model_runs_only_to_pair_the_other_ones_settling_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # B settles at once (330 after 340), A only later: A alone then, and B once, right after A's settling run.
    script = _scripted(monkeypatch, [420.0, 330.0, 360.0, 350.0, 325.0, 999.0])
    a, b = _built(570.0), _built(340.0)
    assert (_first_block(a, b, 0, 5) or ())[:2] == (350.0, 325.0)
    assert a.ran[0] == 3 and b.ran[0] == 2  # A: build, 420, 360 untimed; B: build, 330 untimed (settled, unpaired)
    assert next(script) == 999.0


def test_a_warm_pooled_model_is_not_run_beside_the_others_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # set 1 runs B first (the order of its first block); A is warm on it already (a pooled session)
    script = _scripted(monkeypatch, [300.0, 290.0, 150.0, 999.0])
    a, b = _built(200.0), _built(400.0)
    a.settled.add(1)
    assert (_first_block(a, b, 1, 5) or ())[:2] == (150.0, 290.0)
    assert a.ran[1] == 1 and b.ran[1] == 2  # A's paired run is timed (compare counts it), B's 300 untimed
    assert next(script) == 999.0


def test_the_warm_up_is_capped_at_warmup_runs_and_then_times_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each run 20% faster than the one before: never settled. Five runs of the set in all, the build's first.
    times = [1000.0 * 0.8**k for k in range(1, 20)]
    script = _scripted(monkeypatch, [t for t in times for _ in (0, 1)])
    a, b = _built(1000.0), _built(1000.0)
    assert _first_block(a, b, 0, 5) is None
    assert a.ran[0] == b.ran[0] == 5 and not a.warming(0, 5) and not b.warming(0, 5)
    assert next(script) == pytest.approx(1000.0 * 0.8**5)


def test_a_warm_up_of_zero_makes_no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    _scripted(monkeypatch, [])
    assert _first_block(_built(300.0), _built(300.0), 0, 0) is None


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
