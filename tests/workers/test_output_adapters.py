"""A scikit-learn classifier as skl2onnx converts it by default ends in ZipMap (a sequence of maps, which onnx-ir
cannot hold): the job takes it off, optimizes and verifies the probabilities tensor, and puts it back
(workers/output_adapters.py). Before, such a model was refused (UNSUPPORTED_MODEL)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from core.config import JobConfig
from core.settings import PipelineSettings
from workers.output_adapters import detach
from workers.pipeline import PipelineRequest, run_pipeline

LABELS = ["cat", "dog", "eel"]


def _classifier(path: Path) -> Path:
    """skl2onnx's layout of a linear classifier with its default options: label and ZipMap'ed probabilities.
    The Identity is what a converter leaves and cleanup removes, so that the job hands back a rewritten model."""
    rng = np.random.default_rng(0)
    weights = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "coef")
    bias = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "intercept")
    nodes = [
        helper.make_node("Identity", ["features"], ["features_copy"]),
        helper.make_node("MatMul", ["features_copy", "coef"], ["scores_raw"]),
        helper.make_node("Add", ["scores_raw", "intercept"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probabilities"], axis=1),
        helper.make_node("ArgMax", ["probabilities"], ["output_label"], axis=1, keepdims=0),
        helper.make_node("ZipMap", ["probabilities"], ["output_probability"], domain="ai.onnx.ml",
                         classlabels_strings=LABELS),
    ]  # fmt: skip
    maps = helper.make_sequence_type_proto(
        helper.make_map_type_proto(TensorProto.STRING, helper.make_tensor_type_proto(TensorProto.FLOAT, []))
    )
    graph = helper.make_graph(
        nodes,
        "linear_classifier",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, 4])],
        [
            helper.make_tensor_value_info("output_label", TensorProto.INT64, [None]),
            helper.make_value_info("output_probability", maps),
        ],
        [weights, bias],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)]
    proto = helper.make_model(graph, opset_imports=opsets, producer_name="skl2onnx")
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(path))
    return path


def test_a_trailing_zipmap_is_taken_off_for_the_job_and_put_back_on_the_artifact(tmp_path: Path):
    upload = _classifier(tmp_path / "classifier.onnx")
    settings = PipelineSettings(
        verify_shape_sets=2, benchmark_warmup=1, benchmark_min_runs=5, benchmark_max_seconds=0.2, ledger_runs=5
    )
    config = JobConfig.parse({"preset": "fast", "rollback_slower": False})
    result = run_pipeline(
        PipelineRequest(model_path=upload, output_dir=tmp_path / "out", config=config, settings=settings)
    )

    report = result.report
    assert report["decision"]["used_original"] is False and report["verification"]["ok"] is True
    assert "ZipMap output 'output_probability' (from 'probabilities') taken off" in report["decision"]["reason"]
    assert report["op_histogram"]["before"]["ai.onnx.ml::ZipMap"] == 1
    assert report["op_histogram"]["after"]["ai.onnx.ml::ZipMap"] == 1
    assert "Identity" not in report["op_histogram"]["after"]  # the passes ran on the graph behind the ZipMap
    assert not list((tmp_path / "out").glob(".upload*"))  # the job's copy without the ZipMap is gone

    before, after = onnx.load(str(upload)), onnx.load(str(result.model_path))
    assert [o.name for o in after.graph.output] == ["output_label", "output_probability"]
    assert after.graph.output[1].type == before.graph.output[1].type  # still a sequence of maps
    original = ort.InferenceSession(str(upload), providers=["CPUExecutionProvider"])
    returned = ort.InferenceSession(str(result.model_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for rows in (1, 3, 8):  # batch sizes beyond the job's own sets
        feeds = {"features": rng.standard_normal((rows, 4)).astype(np.float32)}
        (label_a, maps_a), (label_b, maps_b) = original.run(None, feeds), returned.run(None, feeds)
        np.testing.assert_array_equal(label_a, label_b)
        assert len(maps_b) == rows and all(sorted(m) == LABELS for m in maps_b)
        for a, b in zip(maps_a, maps_b, strict=True):
            np.testing.assert_allclose([b[k] for k in LABELS], [a[k] for k in LABELS], atol=1e-6)


def test_a_model_without_zipmap_is_left_as_it_is(tmp_path: Path):
    proto = onnx.load(str(_classifier(tmp_path / "classifier.onnx")))
    detached, taken = detach(proto)
    assert taken is not None and [n.op_type for n in detached.graph.node][-1] == "ArgMax"
    assert [o.name for o in detached.graph.output] == ["output_label", "probabilities"]
    again, none = detach(detached)
    assert none is None and again is detached
