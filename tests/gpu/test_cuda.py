"""The GPU worker path on a real GPU: verify + benchmark on the CUDA EP with I/O binding, CUDA graphs, the
per-job memory limit, and the fp16 preset end to end.

Run on a GPU node (onnxruntime-gpu installed): ``pytest -m gpu tests/gpu``. Without the CUDA EP every test
here is skipped with the reason below; the CPU-side parts of the same code run in tests/workers and
tests/gpu/test_worker_gpu.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from core import runtime
from core.config import JobConfig, Tolerance
from core.inputs import generate_input_sets
from core.settings import PipelineSettings
from workers.benchmark import BenchmarkParams, compare
from workers.gpu import MEM_LIMIT_ENV, with_cuda_graph
from workers.pipeline import PipelineRequest, run_pipeline
from workers.sessions import make_session
from workers.verify import Verifier

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not HAS_CUDA,
        reason=f"CUDAExecutionProvider not available (onnxruntime {ort.__version__} offers "
        f"{', '.join(ort.get_available_providers())}): install onnxruntime-gpu on a machine with an NVIDIA GPU",
    ),
]

MODEL = Path(__file__).resolve().parent / "static_mlp.onnx"


def _sets(count: int = 2):
    return generate_input_sets(onnx.load(str(MODEL)), count)


def _params(**kw) -> BenchmarkParams:
    return BenchmarkParams(warmup=3, min_runs=30, max_seconds=0.5, max_runs=300, target="cuda", **kw)


def test_verify_and_benchmark_run_on_cuda_with_io_binding_when_gpu_is_present() -> None:
    sets = _sets()
    verifier = Verifier(MODEL, sets, Tolerance(), target="cuda")
    assert verifier.check(MODEL).ok
    result = compare(MODEL, MODEL, sets, _params(cuda_graph=False))
    execution = result.to_dict()["execution"]
    assert execution["io_binding"] is True and execution["device"] == "cuda:0"
    assert not result.slower
    assert make_session(MODEL, target="cuda").get_providers()[0] == "CUDAExecutionProvider"


def test_benchmark_captures_cuda_graph_when_model_is_static_and_all_on_cuda() -> None:
    result = compare(MODEL, MODEL, _sets(), _params())
    graph = result.cuda_graph
    assert graph.tried and graph.captured, graph.reason
    assert graph.speedup is not None
    if graph.used:  # faster beyond noise: the measured recipe is the one users get
        assert runtime.cuda_graph_enabled(result.recipe_b)
    else:
        assert graph.reason and "not faster" in graph.reason


def test_load_with_cuda_graph_recipe_matches_cpu_outputs_through_bound_run() -> None:
    feeds = [s.feeds for s in _sets(3)]
    with_graph = runtime.session_from_recipe(MODEL, with_cuda_graph(None), ["CUDAExecutionProvider"])
    cpu = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    reference = [cpu.run(None, f)[0] for f in feeds]
    bound = runtime.BoundRun(with_graph, feeds[0], "cuda", 0, output_shapes={"y": (reference[0].shape, np.float32)})
    for _ in range(3):  # regular runs, then the capture
        bound.run()
    for feed, want in zip(feeds, reference, strict=True):
        bound.update(feed)
        bound.run()
        np.testing.assert_allclose(bound.outputs()[0], want, rtol=1e-3, atol=1e-5)


def test_make_session_caps_gpu_memory_when_the_limit_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MEM_LIMIT_ENV, "512")
    session = make_session(MODEL, target="cuda", optimize=True)
    options = session.get_provider_options()["CUDAExecutionProvider"]
    assert options["gpu_mem_limit"] == str(512 << 20)
    assert options["arena_extend_strategy"] == "kSameAsRequested"
    session.run(None, _sets(1)[0].feeds)  # a 130 KiB model runs well inside 512 MiB


def test_fp16_preset_verifies_and_benchmarks_on_cuda_when_run_through_the_pipeline(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    settings = PipelineSettings(verify_shape_sets=2, benchmark_warmup=3, benchmark_min_runs=20, benchmark_max_seconds=1)
    result = run_pipeline(
        PipelineRequest(
            model_path=MODEL,
            output_dir=out,
            config=JobConfig.parse({"preset": "fp16", "target": "cuda", "benchmark": True}),
            settings=settings,
        )
    )
    report = result.report
    assert report["verification"]["ok"], report["verification"]["reason"]
    assert report["benchmark"]["execution"]["io_binding"] is True
    assert report["host"]["execution_providers"][0] == "CUDAExecutionProvider"
    if not result.used_original:
        types = {i.type.tensor_type.elem_type for i in onnx.load(str(result.model_path)).graph.initializer}
        assert onnx.TensorProto.FLOAT16 in types
