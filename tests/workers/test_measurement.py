"""workers/measurement.py: the latency measurement the engine offers passes through ``PassContext.measure``."""

from __future__ import annotations

from pathlib import Path

import onnx

from core.inputs import generate_input_sets
from passes._infra import Measure
from workers.measurement import BenchmarkMeasure


def test_measure_says_faster_when_model_b_drops_a_chain_of_200_kernels(mlp_path: Path, slow_mlp_path: Path) -> None:
    # setup
    measure: Measure = BenchmarkMeasure(intra_op_threads=1)
    feeds = [s.feeds for s in generate_input_sets(onnx.load(str(mlp_path)), 2)]
    # execute
    verdict = measure(slow_mlp_path, mlp_path, feeds, runs=15)
    # assert
    assert verdict.faster and not verdict.slower and verdict.ratio < 1.0
