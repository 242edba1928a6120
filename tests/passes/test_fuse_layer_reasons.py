"""fuse_transformer's per-layer reasons: a layer made not to fuse is named in the report, with its family,
what the rule expects, the subgraph found and where onnxscript's rule stopped (MatchResult.fail).

Each test breaks one layer of a committed export (tests/models/build_torchscript.py) in a way an exporter or
a hand edit could, checks the other layer still fuses, and that the fused graph computes what the edited
original does (ONNX Runtime, graph optimizations off, shapes other than the export's)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest
from onnx_ir.passes.common import ShapeInferencePass

from passes._infra import op_histogram
from passes.fusion import fuse_transformer
from passes.fusion.fuse_transformer import FuseTransformer
from tests.models.build_torchscript import inputs
from tests.passes._util import MODELS, session

SHAPES = ((1, 5), (3, 37))


def assert_same_as(original: ir.Model, optimized: ir.Model) -> None:
    reference, candidate = session(original), session(optimized)
    for batch, seq in SHAPES:
        ids, mask = inputs(batch, seq, seed=seq)
        feeds = {"input_ids": ids, "attention_mask": mask}
        np.testing.assert_allclose(candidate.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-4)


def const(value: np.ndarray, name: str) -> ir.Node:
    return ir.node("Constant", [], {"value": ir.tensor(value)}, name=name)


def scale_by_sequence_length(model: ir.Model, layer: int) -> str:
    """Layer ``layer``'s scores scaled by 1/sqrt(S) computed from the mask's shape (a run-time value) instead
    of the constant 1/sqrt(head_dim); the Softmax's name."""
    softmax = [n for n in model.graph if n.op_type == "Softmax"][layer]
    add = softmax.inputs[0].producer()
    scale = next(v.producer() for v in add.inputs if v.producer() is not None and v.producer().op_type == "Mul")
    mask = next(v for v in model.graph.inputs if v.name == "attention_mask")
    shape = ir.node("Shape", [mask], name="probe/shape")
    index = const(np.array(1, np.int64), "probe/axis")
    length = ir.node("Gather", [shape.outputs[0], index.outputs[0]], name="probe/length")
    cast = ir.node("Cast", [length.outputs[0]], {"to": ir.DataType.FLOAT}, name="probe/cast")
    root = ir.node("Sqrt", [cast.outputs[0]], name="probe/sqrt")
    inverse = ir.node("Reciprocal", [root.outputs[0]], name="probe/inverse")
    model.graph.insert_before(scale, [shape, index, length, cast, root, inverse])
    scale.replace_input_with(1, inverse.outputs[0])
    return softmax.name


def test_fuse_transformer_names_layer_and_blocking_pattern_when_one_attention_scale_is_computed():
    # setup
    model = ir.load(MODELS / "ts_bert_eager.onnx")
    softmax = scale_by_sequence_length(model, layer=1)
    original = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    # execute
    result = FuseTransformer({"engines": ["onnxscript"]})(model)
    # assert
    ops = op_histogram(result.model)
    assert ops["com.microsoft::Attention"] == 1 and ops["Softmax"] == 1
    layer = [nm for nm in result.non_matches if nm.node == softmax]
    assert len(layer) == 1, [nm.reason for nm in result.non_matches]
    reason = layer[0].reason
    assert reason.startswith(f"attention: attention layer 1 (bert, node {softmax}): expected MatMul(q, Transpose(k))")
    assert "found Softmax(Add(Mul(MatMul(Transpose(" in reason and "Reciprocal(Sqrt(Cast(" in reason
    assert reason.endswith("SDPA stopped after 6 matched nodes (CONDITION_FAILED): qk_scale is not a scalar.")
    assert layer[0].op_type == "Softmax"
    assert not any("attention layer 0" in nm.reason for nm in result.non_matches)
    assert_same_as(original, result.model)


def test_fuse_transformer_names_gelu_layer_and_wrong_constant_when_one_tanh_gelu_is_not_gelu():
    # setup: layer 1's cubic coefficient 0.05 instead of 0.044715, an activation that is not GELU
    model = ir.load(MODELS / "ts_gpt2_eager.onnx")
    tanh = [n for n in model.graph if n.op_type == "Tanh"][1]
    inner = tanh.inputs[0].producer().inputs[0].producer()  # Add(h, Mul(Pow(h, 3), 0.044715))
    cubic = next(v.producer() for v in inner.inputs if v.producer().op_type == "Mul")
    other = const(np.array(0.05, np.float32), "probe/cubic")
    model.graph.insert_before(cubic, [other])
    cubic.replace_input_with(1, other.outputs[0])
    original = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    # execute
    result = FuseTransformer({"engines": ["onnxscript"]})(model)
    # assert
    ops = op_histogram(result.model)
    assert ops["com.microsoft::FastGelu"] == 1 and ops["Tanh"] == 1
    assert ops["com.microsoft::MultiHeadAttention"] == 2
    reasons = [nm.reason for nm in result.non_matches if nm.node == tanh.name]
    assert len(reasons) == 1, [nm.reason for nm in result.non_matches]
    assert reasons[0].startswith(f"gelu: GELU layer 1 (gpt2, node {tanh.name}): expected 0.5 * x * (1 + Erf(")
    assert "found Mul(Mul(" in reasons[0] and "Tanh(" in reasons[0]
    assert reasons[0].endswith("(CONDITION_FAILED): cubic is 0.05, expected 0.044715: not the tanh GELU")
    assert result.notes["missing"]["gelu"].startswith("expected 2, achieved 1")
    assert_same_as(original, result.model)


@pytest.mark.parametrize("symbolic", ["applied", "skipped: AttributeError: 'NoneType' object has no attribute"])
def test_missing_names_symbolic_shape_inference_when_it_refused_the_graph(symbolic):
    """A refused symbolic shape inference leaves a TorchScript export's heads dims unknown: the attention
    shortfall names it beside onnxscript's partial match, which alone shows only "unk__10 vs unk__9"."""
    model = ir.load(MODELS / "ts_bert_eager.onnx")
    missing = fuse_transformer._missing({"attention": 2, "gelu": 2}, {"gelu": 2}, model, Counter(), symbolic)
    assert list(missing) == ["attention"]
    assert missing["attention"].startswith("expected 2, achieved 0; closest onnxscript sdpa match")
    named = f"; heads dims unresolved, ORT symbolic shape inference {symbolic}" in missing["attention"]
    assert named is symbolic.startswith("skipped")


def test_layer_whose_probabilities_are_a_model_output_is_named_with_that_reason():
    # setup: layer 0's attention probabilities also returned by the model (output_attentions=True)
    model = ir.load(MODELS / "ts_bert_eager.onnx")
    ShapeInferencePass()(model)  # an exporter declares its outputs' type and shape
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    softmax.outputs[0].name = "attentions.0"
    model.graph.outputs.append(softmax.outputs[0])
    original = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    fuse_transformer._LAST.clear()
    # execute
    result = FuseTransformer({"pack_qkv": True})(model)
    # assert
    assert result.counts["fused_attention"] == 1  # the other layer still fuses
    (reason,) = [m.reason for m in result.non_matches if m.node == softmax.name]
    assert "its probabilities are the model's output 'attentions.0'" in reason
    reference, candidate = session(original), session(result.model)
    ids, mask = inputs(3, 37, seed=37)
    for want, got in zip(reference.run(None, {"input_ids": ids, "attention_mask": mask}),
                         candidate.run(None, {"input_ids": ids, "attention_mask": mask}), strict=True):  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_layer_whose_scores_are_scaled_per_head_is_named_left_unfused_by_design():
    # setup: layer 0's scores scaled by a learned temperature per head (cross-covariance attention, timm's
    # EdgeNeXt and XCiT), which no attention kernel's scalar scale carries: the report quoted onnxscript's
    # closest match and counted the layer as missing
    model = ir.load(MODELS / "ts_bert_eager.onnx")
    ShapeInferencePass()(model)
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    add = softmax.inputs[0].producer()
    scale = next(v.producer() for v in add.inputs if v.producer() is not None and v.producer().op_type == "Mul")
    scores = next(v for v in scale.inputs if v.const_value is None)
    heads = 4  # tests/models/build_torchscript.py
    temperature = const(np.linspace(0.2, 0.5, heads, dtype=np.float32).reshape(heads, 1, 1), "probe/temperature")
    model.graph.insert_before(scale, [temperature])
    scale.replace_input_with(1 if scale.inputs[0] is scores else 0, temperature.outputs[0])
    original = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    fuse_transformer._LAST.clear()
    # execute
    result = FuseTransformer({"pack_qkv": True})(model)
    # assert
    assert result.counts["fused_attention"] == 1  # the other layer still fuses
    (reason,) = [m.reason for m in result.non_matches if m.node == softmax.name]
    assert f"scaled by a tensor of {heads} distinct values" in reason
    assert "left unfused by design" in result.notes["missing"]["attention"]
    assert_same_as(original, result.model)


def test_layer_whose_probabilities_feed_a_second_product_is_named_left_unfused_by_design():
    # setup: layer 0's probabilities also multiply a table of relative position values, the result added to
    # the attention's output (VITS / MMS-TTS's windowed attention): no attention kernel exposes them
    model = ir.load(MODELS / "ts_bert_eager.onnx")
    ShapeInferencePass()(model)
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    product = next(u.node for u in softmax.outputs[0].uses() if u.node.op_type == "MatMul")
    scores = softmax.inputs[0]
    # softmax @ softmax^T-shaped values: [B, H, S, S] @ [B, H, S, S] -> [B, H, S, S]; its row sums, scaled, add to
    # the context, a stand-in for the relative values' product (a Pad and a Reshape in VITS)
    readers = [(u.node, u.idx) for u in product.outputs[0].uses()]
    relative = ir.node("MatMul", [softmax.outputs[0], scores], name="probe/relative_values")
    summed = ir.node("ReduceMean", [relative.outputs[0]], {"axes": [-1], "keepdims": 1}, name="probe/mean")
    added = ir.node("Add", [product.outputs[0], summed.outputs[0]], name="probe/add")
    model.graph.insert_after(product, [relative, summed, added])
    for node, idx in readers:
        node.replace_input_with(idx, added.outputs[0])
    original = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    fuse_transformer._LAST.clear()
    # execute
    result = FuseTransformer({"pack_qkv": True})(model)
    # assert
    assert result.counts["fused_attention"] == 1  # the other layer still fuses
    (reason,) = [m.reason for m in result.non_matches if m.node == softmax.name]
    assert "its probabilities are also read by MatMul 'probe/relative_values'" in reason
    assert "left unfused by design" in result.notes["missing"]["attention"]
    assert_same_as(original, result.model)


def test_a_softmax_no_product_reads_is_not_counted_as_an_attention_block():
    # setup: a spline flow's bin widths (VITS's duration predictor): softmax over computed logits, read by a Mul
    model = ir.load(MODELS / "ts_bert_eager.onnx")
    ShapeInferencePass()(model)
    layers = fuse_transformer.fam.count_layers(model)
    hidden = next(n for n in model.graph if n.op_type in {"LayerNormalization", "ReduceMean"})
    widths = ir.node("Softmax", [hidden.outputs[0]], {"axis": -1}, name="probe/widths")
    scaled = ir.node("Mul", [widths.outputs[0], hidden.outputs[0]], name="probe/scaled")
    model.graph.insert_after(hidden, [widths, scaled])
    model.graph.outputs.append(scaled.outputs[0])
    # execute / assert
    assert fuse_transformer.fam.count_layers(model) == layers == 2
