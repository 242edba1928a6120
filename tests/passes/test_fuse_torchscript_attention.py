"""Attention fuses on TorchScript-exporter graphs (``torch.onnx.export(dynamo=False)``), eager and SDPA.

The committed ``ts_bert_*.onnx`` (tests/models/build_torchscript.py) split heads with a runtime ``-1`` shape
and, in the SDPA form, guard the Softmax against NaN with a ``[1]`` constant: before this, neither engine
fused their attention. Numerics are checked against the original (graph optimizations off) at shapes other
than the export's 2 x 16."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from passes.fusion import _nan_guard, _symbolic_shapes
from passes.fusion.fuse_transformer import FuseTransformer
from tests.models.build_torchscript import inputs
from tests.passes._util import MODELS, session

LAYERS = 2
SHAPES = ((1, 5), (3, 37), (4, 64))


def assert_same_as_export(name: str, optimized: ir.Model) -> None:
    reference, candidate = session(str(MODELS / f"{name}.onnx")), session(optimized)
    for batch, seq in SHAPES:
        ids, mask = inputs(batch, seq, seed=batch * seq)
        feeds = {"input_ids": ids, "attention_mask": mask}
        want, got = reference.run(None, feeds)[0], candidate.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{name} at {batch}x{seq}")


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_fuse_transformer_fuses_packed_attention_when_torchscript_export(attention):
    name = f"ts_bert_{attention}"
    result = FuseTransformer({"engines": ["onnxscript"]})(ir.load(MODELS / f"{name}.onnx"))
    ops = op_histogram(result.model)
    onnxscript = result.notes["candidates"]["onnxscript"]
    assert result.notes["family"] == "bert"
    assert onnxscript["symbolic_shapes"] == "applied"
    assert result.counts["fused_attention"] == LAYERS
    # TorchScript writes Add(bias, MatMul): the biases turned, Q/K/V go into one packed Attention, no Split
    assert onnxscript["onnxscript_counts"]["projection_biases_turned"] == 3 * LAYERS
    assert ops["com.microsoft::Attention"] == LAYERS
    assert "com.microsoft::MultiHeadAttention" not in ops and "Split" not in ops
    assert "Softmax" not in ops
    # the SDPA export's guard is put back on the fused output (test_fuse_nan_guard_rows): one per layer
    assert ops["IsNaN"] == (LAYERS if attention == "sdpa" else 0)
    assert result.counts["fused_skip_layer_norm"] == 2 * LAYERS and result.counts["fused_gelu"] == LAYERS
    assert "attention" not in result.notes["missing"]
    assert onnxscript["nan_guards"] == (LAYERS if attention == "sdpa" else 0)
    assert_same_as_export(name, result.model)


def test_fuse_transformer_gives_multi_head_attention_its_bias_when_torchscript_export_and_mha():
    """``attention: "mha"`` (the int8 preset) keeps the projections' MatMuls and hands their bias to the op."""
    name = "ts_bert_eager"
    result = FuseTransformer({"engines": ["onnxscript"], "attention": "mha"})(ir.load(MODELS / f"{name}.onnx"))
    ops = op_histogram(result.model)
    assert ops["com.microsoft::MultiHeadAttention"] == LAYERS and "com.microsoft::Attention" not in ops
    for node in result.model.graph:
        if node.op_type == "MultiHeadAttention":
            assert node.inputs[3] is not None and node.inputs[3].shape.numpy() == (3 * 32,)
            assert all(v.producer().op_type == "MatMul" for v in node.inputs[:3])
    assert_same_as_export(name, result.model)


GUARD = """
<ir_version: 9, opset_import: ["" : 18]>
guard (float[B, H, S, S] s) => (float[B, H, S, S] y) <float[1] fill = {%s}> {
    p = %s
    nan = IsNaN(p)
    y = Where(nan, fill, p)
}
"""


def guard_model(fill: str, producer: str = "Softmax <axis = -1> (s)") -> onnx.ModelProto:
    model = onnx.parser.parse_model(GUARD % (fill, producer))
    onnx.checker.check_model(model, full_check=True)
    return model


def test_nan_guard_becomes_scalar_when_fill_is_one_element_zero():
    proto = guard_model("0.0")
    model = ir.serde.deserialize_model(proto)
    assert _nan_guard.rules.apply_to_model(model) == 1
    where = next(n for n in model.graph if n.op_type == "Where")
    fill = where.inputs[1]
    assert fill.const_value is not None or fill.producer().op_type == "Constant"
    scores = np.full((2, 1, 3, 3), -np.inf, np.float32)
    scores[0] = np.random.default_rng(0).standard_normal((1, 3, 3))  # row 1 fully masked: the guard's case
    want = session(ir.serde.deserialize_model(proto)).run(None, {"s": scores})[0]
    got = session(model).run(None, {"s": scores})[0]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("fill", "producer"), [("1.0", "Softmax <axis = -1> (s)"), ("0.0", "Sigmoid (s)")], ids=["non-zero", "no-softmax"]
)
def test_nan_guard_stays_when_fill_non_zero_or_not_a_softmax(fill, producer):
    model = ir.serde.deserialize_model(guard_model(fill, producer))
    assert _nan_guard.rules.apply_to_model(model) == 0
    assert op_histogram(model)["Where"] == 1


def as_value_ints(proto: onnx.ModelProto) -> int:
    """Rewrite the 1-D int64 Constants to ``value_ints``, the form onnxscript's constant folder writes."""
    count = 0
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.attribute[0].name == "value":
            array = onnx.numpy_helper.to_array(node.attribute[0].t)
            if array.dtype == np.int64 and array.ndim == 1 and array.size:
                node.ClearField("attribute")
                node.attribute.append(onnx.helper.make_attribute("value_ints", array.tolist()))
                count += 1
    return count


def test_fuse_transformer_fuses_attention_when_shape_constants_are_value_ints():
    """ORT's symbolic shape inference reads Constant ``value`` only: with ``value_ints`` it raised, the heads
    dims stayed unknown and no attention fused (the ``fast`` preset's case, after constant_folding)."""
    proto = onnx.load(str(MODELS / "ts_bert_eager.onnx"))
    assert as_value_ints(proto) > 0
    onnx.checker.check_model(proto, full_check=True)
    result = FuseTransformer({"engines": ["onnxscript"]})(ir.serde.deserialize_model(proto))
    report = result.notes["candidates"]["onnxscript"]
    assert report["symbolic_shapes"] == "applied"
    assert report["constants_as_tensors"] > 0
    assert op_histogram(result.model)["com.microsoft::Attention"] == LAYERS
    assert "Softmax" not in op_histogram(result.model)
    assert_same_as_export("ts_bert_eager", result.model)


CONSTANTS = """
<ir_version: 9, opset_import: ["" : 18]>
constants (float[N] x) => (float[N] y, int64 n, string[2] s) {
    scale = Constant <value_floats = [2.0, 0.5, -1.0]> ()
    y = Mul(x, scale)
    n = Constant <value_int = 7> ()
    s = Constant <value_strings = ["a", "bc"]> ()
}
"""


def test_constants_as_tensors_keeps_values_when_scalar_list_and_string_forms():
    original = onnx.parser.parse_model(CONSTANTS)
    proto = onnx.ModelProto()
    proto.CopyFrom(original)
    assert _symbolic_shapes.constants_as_tensors(proto.graph) == 3
    assert [a.name for n in proto.graph.node if n.op_type == "Constant" for a in n.attribute] == ["value"] * 3
    onnx.checker.check_model(proto, full_check=True)
    feeds = {"x": np.array([1.0, 2.0, 3.0], np.float32)}
    want = session(ir.serde.deserialize_model(original)).run(None, feeds)
    got = session(ir.serde.deserialize_model(proto)).run(None, feeds)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert _symbolic_shapes.constants_as_tensors(proto.graph) == 0  # already in tensor form
