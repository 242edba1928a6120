"""label_sparsity: structure and numerics, both loss forms, both reductions, and the refusals."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.errors import InvalidPassOptionsError
from passes._infra import PassContext
from passes.compute_order.label_sparsity import LabelSparsity

HIDDEN, CLASSES, IGNORE = 8, 11, -100


def build_loss_model(
    form: str,
    reduction: str = "mean",
    *,
    ignore_index: int | None = IGNORE,
    weights=False,
    log_prob_used=False,
) -> onnx.ModelProto:
    """h[N,8] -> MatMul(W) -> logits[N,11] -> loss, the shape of an LM head with a token-level loss."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((HIDDEN, CLASSES)).astype(np.float32), "W")]
    attrs = {"reduction": reduction} | ({} if ignore_index is None else {"ignore_index": ignore_index})
    loss_inputs = ["logits", "labels"]
    if weights:
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 2.0, CLASSES).astype(np.float32), "class_w"))
        loss_inputs.append("class_w")
    nodes = [helper.make_node("MatMul", ["h", "W"], ["logits"], name="lm_head")]
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, None)]
    if form == "sce":
        loss_outputs = ["loss", "log_prob"] if log_prob_used else ["loss"]
        nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", loss_inputs, loss_outputs, name="sce", **attrs))
        if log_prob_used:
            outputs.append(helper.make_tensor_value_info("log_prob", TensorProto.FLOAT, None))
    else:
        nodes.append(helper.make_node("LogSoftmax", ["logits"], ["log_probs"], name="log_softmax", axis=1))
        loss_inputs[0] = "log_probs"
        nodes.append(helper.make_node("NegativeLogLikelihoodLoss", loss_inputs, ["loss"], name="nll", **attrs))
    graph = helper.make_graph(
        nodes,
        "loss_head",
        [
            helper.make_tensor_value_info("h", TensorProto.FLOAT, ["N", HIDDEN]),
            helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"]),
        ],
        outputs,
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def sparse_labels(rng: np.random.Generator, n: int, density: float) -> np.ndarray:
    return np.where(rng.random(n) < density, rng.integers(0, CLASSES, n), IGNORE).astype(np.int64)


def run_pass(model: onnx.ModelProto, samples=None, **options):
    ir_model = ir.serde.deserialize_model(model)
    result = LabelSparsity(options)(ir_model, PassContext(samples=samples or []))
    optimized = ir.serde.serialize_model(result.model)
    onnx.checker.check_model(optimized, full_check=True)
    return result, optimized


def assert_same_loss(original: onnx.ModelProto, optimized: onnx.ModelProto, label_sets: list[np.ndarray]) -> None:
    reference_options = ort.SessionOptions()
    reference_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    reference = ort.InferenceSession(
        original.SerializeToString(), reference_options, providers=["CPUExecutionProvider"]
    )
    candidate = ort.InferenceSession(optimized.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    for labels in label_sets:
        feed = {"h": rng.standard_normal((labels.size, HIDDEN)).astype(np.float32), "labels": labels}
        want, got = reference.run(["loss"], feed)[0], candidate.run(["loss"], feed)[0]
        if np.isnan(want):
            assert np.isnan(got), f"labels {labels}: expected NaN (all ignored), got {got}"
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"labels {labels}")


def label_sets() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [
        sparse_labels(rng, 32, 0.15),  # the masked-LM case
        sparse_labels(rng, 5, 0.5),  # another batch size than the samples
        np.full(16, IGNORE, np.int64),  # every label ignored: NaN, and the filter keeps one row
        rng.integers(0, CLASSES, 9).astype(np.int64),  # none ignored
        np.array([IGNORE], np.int64),
        np.array([4], np.int64),
    ]


@pytest.mark.parametrize("form", ["sce", "nll"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_label_sparsity_filters_rows_and_keeps_the_loss_when_density_is_low(form, reduction):
    model = build_loss_model(form, reduction)
    samples = [{"labels": sparse_labels(np.random.default_rng(1), 64, 0.15)}]

    result, optimized = run_pass(model, samples)

    assert result.modified and result.counts == {"losses_filtered": 1}
    ops = Counter(n.op_type for n in optimized.graph.node)
    assert ops["NonZero"] == 1 and ops["Gather"] == 2, ops
    loss = next(
        n for n in optimized.graph.node if n.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
    )
    assert loss.input[1].endswith("label_sparsity/labels")
    logits_consumer = next(
        n for n in optimized.graph.node if n.op_type == ("SoftmaxCrossEntropyLoss" if form == "sce" else "LogSoftmax")
    )
    assert logits_consumer.input[0].endswith("label_sparsity/logits")
    assert 0.1 < next(iter(result.notes["label_density"].values())) < 0.25
    assert_same_loss(model, optimized, label_sets())


def test_label_sparsity_keeps_weighted_mean_when_class_weights_are_given():
    model = build_loss_model("sce", "mean", weights=True)

    _, optimized = run_pass(model, force=True)

    assert_same_loss(model, optimized, label_sets())


def test_label_sparsity_does_nothing_when_density_is_above_threshold():
    model = build_loss_model("sce")
    samples = [{"labels": sparse_labels(np.random.default_rng(1), 64, 0.97)}]

    result, optimized = run_pass(model, samples)

    assert not result.modified
    assert "NonZero" not in {n.op_type for n in optimized.graph.node}
    assert any("label density" in nm.reason and ">= threshold 90%" in nm.reason for nm in result.non_matches)


def test_label_sparsity_does_nothing_when_no_samples_are_given():
    result, _ = run_pass(build_loss_model("sce"))

    assert not result.modified
    assert "no samples" in result.non_matches[0].reason


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"reduction": "none"}, "reduction 'none'"),
        ({"ignore_index": None}, "no ignore_index"),
        ({"log_prob_used": True}, "log_prob output is used"),
    ],
)
def test_label_sparsity_refuses_with_reason_when_rows_cannot_be_dropped(kwargs, reason):
    result, optimized = run_pass(build_loss_model("sce", **kwargs), force=True)

    assert not result.modified
    assert "NonZero" not in {n.op_type for n in optimized.graph.node}
    assert any(reason in nm.reason for nm in result.non_matches), result.non_matches


def test_label_sparsity_refuses_nll_when_its_input_is_not_log_softmax():
    model = build_loss_model("nll")
    log_softmax = next(n for n in model.graph.node if n.op_type == "LogSoftmax")
    log_softmax.op_type = "Identity"  # NLL of raw logits: rows could still be dropped, but it is not the pattern
    del log_softmax.attribute[:]

    result, _ = run_pass(model, force=True)

    assert not result.modified
    assert "not a LogSoftmax" in result.non_matches[0].reason


def test_label_sparsity_rejects_unknown_option():
    with pytest.raises(InvalidPassOptionsError, match="threshold"):
        LabelSparsity({"threshold": 0.5})
