"""workers/benchmark.py: interleaved timing, statistics, and the slower-beyond-noise rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from core.inputs import generate_input_sets
from core.settings import PipelineSettings
from core.verdict import MIN_MARGIN, LatencyStats, slower_beyond_noise
from workers.benchmark import BenchmarkParams, compare, host_info


def _noisy(n: int, center: float, spread: float, seed: int) -> np.ndarray:
    return center * (1 + spread * np.random.default_rng(seed).standard_normal(n))


def test_slower_beyond_noise_says_slower_when_candidate_is_50_percent_slower() -> None:
    a = _noisy(40, 1.0, 0.05, 0)
    verdict = slower_beyond_noise(a, a * 1.5)
    assert verdict.slower and not verdict.faster
    assert abs(verdict.ratio - 1.5) < 1e-9


def test_slower_beyond_noise_says_not_slower_when_shift_is_inside_the_floor() -> None:
    a = _noisy(40, 1.0, 0.01, 1)
    verdict = slower_beyond_noise(a, a * 1.02)
    assert not verdict.slower and verdict.margin >= MIN_MARGIN


def test_slower_beyond_noise_widens_margin_when_measurements_are_noisy() -> None:
    a, b = _noisy(15, 1.0, 0.4, 2), _noisy(15, 1.1, 0.4, 3)
    verdict = slower_beyond_noise(np.abs(a) + 0.1, np.abs(b) + 0.1)
    assert verdict.margin > MIN_MARGIN
    assert verdict.ci95[0] <= verdict.paired_ratio <= verdict.ci95[1]


def test_slower_beyond_noise_is_deterministic_when_called_twice() -> None:
    a, b = _noisy(20, 1.0, 0.2, 4), _noisy(20, 1.0, 0.2, 5)
    assert slower_beyond_noise(a, b) == slower_beyond_noise(a, b)


def test_latency_stats_flags_noisy_when_cv_exceeds_ten_percent() -> None:
    steady = LatencyStats.from_samples([1.0, 1.01, 0.99, 1.0])
    noisy = LatencyStats.from_samples([1.0, 2.0, 0.5, 1.5])
    assert not steady.noisy and noisy.noisy
    assert steady.p50_ms == 1.0 and steady.throughput_per_s == 1000.0
    assert steady.p25_ms <= steady.p50_ms <= steady.p75_ms <= steady.p90_ms <= steady.p99_ms <= steady.max_ms


def test_compare_agrees_within_stated_noise_when_both_sides_are_the_same_model(mlp_path: Path) -> None:
    """An A/A comparison lands outside its own 95% interval about one time in twenty by construction, more on a
    loaded machine: of three independent comparisons at most one may disagree (false alarm ~1% at 5% each)."""
    sets = generate_input_sets(onnx.load(str(mlp_path)), 2)
    params = BenchmarkParams(warmup=3, min_runs=60, max_seconds=0.3, max_runs=400, intra_op_threads=1)
    disagreeing = []
    for _ in range(3):
        result = compare(mlp_path, mlp_path, sets, params)
        for shape in result.shapes:
            assert shape.a.runs == shape.b.runs >= 60
            assert shape.a.peak_rss_delta_mb is not None
        outside = [s.to_dict() for s in result.shapes if abs(s.verdict.ratio - 1.0) > s.verdict.margin]
        if result.slower or outside:
            disagreeing.append(outside or "slower")
    assert len(disagreeing) <= 1, disagreeing


def test_compare_says_slower_when_candidate_has_200_extra_nodes(mlp_path: Path, slow_mlp_path: Path) -> None:
    sets = generate_input_sets(onnx.load(str(mlp_path)), 1)
    params = BenchmarkParams(warmup=2, min_runs=15, max_seconds=0.1, max_runs=100, intra_op_threads=1)
    result = compare(mlp_path, slow_mlp_path, sets, params)
    assert result.slower and result.speedup < 0.8
    assert result.to_dict()["shapes"][0]["slower"] is True


def test_benchmark_params_quick_mode_uses_ledger_runs_when_built_from_settings() -> None:
    quick = BenchmarkParams.from_settings(PipelineSettings(ledger_runs=7), target="cpu", quick=True)
    full = BenchmarkParams.from_settings(PipelineSettings(benchmark_min_runs=12), target="cpu")
    assert quick.min_runs == quick.max_runs == 7
    assert full.min_runs == 12 and full.max_runs >= 12


def test_host_info_records_versions_and_cpu_when_called() -> None:
    info = host_info(target="cpu", intra_op_threads=0)
    assert info["cpu_model"] and info["onnxruntime_version"] and info["onnx_version"]
    assert info["execution_providers"] == ["CPUExecutionProvider"]


def test_comparison_slower_uses_pooled_and_clear_rules_when_sets_disagree() -> None:
    from workers.benchmark import Comparison, ShapeComparison

    a = _noisy(30, 1.0, 0.02, 6)

    def shape(factor: float, seed: int) -> ShapeComparison:
        b = a * factor * (1 + 0.02 * np.random.default_rng(seed).standard_normal(30))
        return ShapeComparison(
            f"x{factor}",
            LatencyStats.from_samples(a),
            LatencyStats.from_samples(b),
            slower_beyond_noise(a, b),
            b / a,
        )

    params = BenchmarkParams()
    # One set 5% slower, two sets unchanged: neither pooled nor clearly slower.
    mild = Comparison([shape(1.05, 1), shape(1.0, 2), shape(1.0, 3)], "quick", params)
    assert not mild.slower
    # One set 40% slower: clearly slower even though the pooled median barely moves.
    one_bad = Comparison([shape(1.4, 1), shape(1.0, 2), shape(1.0, 3)], "quick", params)
    assert one_bad.slower and one_bad.shapes[0].clearly_slower
    # Every set 8% slower: the pooled verdict catches it.
    steady = Comparison([shape(1.08, 1), shape(1.08, 2), shape(1.08, 3)], "quick", params)
    assert steady.pooled.slower and steady.slower
