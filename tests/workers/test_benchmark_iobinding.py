"""workers/benchmark.py on the GPU path, exercised with the CPU EP: I/O binding, and the CUDA-graph decision.

ORT's IOBinding works with the CPU EP (device "cpu"), so the code that binds inputs once, keeps outputs on
the device and runs ``run_with_iobinding`` is the code a GPU worker runs; only the device name differs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from core.inputs import generate_input_sets
from core.runtime import BoundRun
from workers.benchmark import BenchmarkParams, Runs, _prepared, compare, try_cuda_graph
from workers.gpu import cuda_graph_eligibility
from workers.sessions import make_session


def _session(path: Path) -> ort.InferenceSession:
    return make_session(path, intra_op_threads=1, optimize=True)


def test_bound_run_gives_plain_run_outputs_when_bound_on_cpu(mlp_path: Path) -> None:
    session = _session(mlp_path)
    feeds = [s.feeds for s in generate_input_sets(onnx.load(str(mlp_path)), 3)]
    for feed in feeds:
        bound = BoundRun(session, feed, "cpu", 0)
        bound.run()
        for got, want in zip(bound.outputs(), session.run(None, feed), strict=True):
            np.testing.assert_array_equal(got, want)


def test_bound_run_reads_new_values_when_fixed_buffers_are_updated(mlp_path: Path) -> None:
    """The CUDA-graph form: outputs preallocated once, new input values copied into the same buffers."""
    session = _session(mlp_path)
    first, second = (s.feeds for s in generate_input_sets(onnx.load(str(mlp_path)), 1, seed=7) * 2)
    second = {k: v * -2.0 + 1.0 for k, v in second.items()}
    reference = session.run(None, first)
    shapes = {o.name: (r.shape, r.dtype) for o, r in zip(session.get_outputs(), reference, strict=True)}
    bound = BoundRun(session, first, "cpu", 0, output_shapes=shapes)
    address = bound.inputs["x"].data_ptr()
    bound.run()
    np.testing.assert_array_equal(bound.outputs()[0], reference[0])
    bound.update(second)
    bound.run()
    assert bound.inputs["x"].data_ptr() == address
    np.testing.assert_array_equal(bound.outputs()[0], session.run(None, second)[0])
    assert not np.array_equal(bound.outputs()[0], reference[0])


@pytest.mark.parametrize(
    ("target", "io_binding", "expected"),
    [("cpu", None, False), ("cuda", None, True), ("tensorrt", None, True), ("cpu", True, True), ("cuda", False, False)],
)
def test_benchmark_params_bind_by_target_when_io_binding_is_unset(target, io_binding, expected) -> None:
    assert BenchmarkParams(target=target, io_binding=io_binding).uses_io_binding is expected


def test_prepared_runs_time_io_bound_calls_when_params_ask_for_binding(mlp_path: Path) -> None:
    feeds = [s.feeds for s in generate_input_sets(onnx.load(str(mlp_path)), 2)]
    bound, _ = _prepared(mlp_path, feeds, BenchmarkParams(warmup=1, io_binding=True, intra_op_threads=1))
    plain, _ = _prepared(mlp_path, feeds, BenchmarkParams(warmup=1, intra_op_threads=1))
    assert isinstance(bound.select(0).__self__, BoundRun)
    assert not hasattr(plain.select(0), "__self__")  # a closure over session.run
    for index in range(len(feeds)):
        for got, want in zip(bound.outputs(index), plain.outputs(index), strict=True):
            np.testing.assert_array_equal(got, want)


def test_compare_reports_io_binding_and_no_graph_when_bound_on_cpu(mlp_path: Path) -> None:
    sets = generate_input_sets(onnx.load(str(mlp_path)), 2)
    params = BenchmarkParams(warmup=2, min_runs=20, max_seconds=0.1, max_runs=200, intra_op_threads=1, io_binding=True)
    result = compare(mlp_path, mlp_path, sets, params).to_dict()
    assert result["execution"]["io_binding"] is True
    assert result["execution"]["device"] == "cpu:0"
    graph = result["execution"]["cuda_graph"]
    assert graph["tried"] is False and graph["used"] is False
    assert "cuda" in graph["reason"]
    assert all(s["original"]["runs"] >= 20 for s in result["shapes"])


def test_compare_keeps_plain_run_when_target_is_cpu_and_binding_unset(mlp_path: Path) -> None:
    sets = generate_input_sets(onnx.load(str(mlp_path)), 1)
    params = BenchmarkParams(warmup=1, min_runs=5, max_seconds=0.0, max_runs=5, intra_op_threads=1)
    execution = compare(mlp_path, mlp_path, sets, params).to_dict()["execution"]
    assert execution["io_binding"] is False and execution["device"] == "host feeds"


def test_cuda_graph_eligibility_refuses_when_shapes_are_dynamic_or_target_is_not_cuda() -> None:
    assert cuda_graph_eligibility({"x": [1, 16]}, "cuda") is None
    assert "dynamic" in cuda_graph_eligibility({"x": ["batch", 16]}, "cuda")
    assert "dynamic" in cuda_graph_eligibility({"x": [None, 16]}, "cuda")
    assert "tensorrt" in cuda_graph_eligibility({"x": [1, 16]}, "tensorrt")


def test_try_cuda_graph_records_the_reason_without_failing_when_model_has_dynamic_batch(mlp_path: Path) -> None:
    params = BenchmarkParams(warmup=1, target="cuda", io_binding=True, intra_op_threads=1)
    cpu_params = BenchmarkParams(warmup=1, io_binding=True, intra_op_threads=1)
    feeds = [s.feeds for s in generate_input_sets(onnx.load(str(mlp_path)), 1)]
    runs = Runs(_session(mlp_path), feeds, cpu_params)
    choice, graph = try_cuda_graph(mlp_path, runs, params)
    assert graph is None
    assert not choice.tried and not choice.used
    assert "dynamic input shapes (x)" in choice.reason
