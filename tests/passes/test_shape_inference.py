"""shape_inference: annotations are added (never changed wrongly), the graph itself is not touched."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from passes.cleanup.shape_inference import ShapeInference
from tests.numerics import assert_equivalent
from tests.passes._util import MLP_CLEANUP, apply, checked, ops, parse


def test_shape_inference_annotates_every_intermediate_value_when_mlp_has_no_value_info() -> None:
    original = onnx.load(MLP_CLEANUP)
    assert len(original.graph.value_info) == 0
    model, result = apply(ShapeInference(), original)
    assert result.modified
    assert result.counts == {"values_typed": 13, "values_untyped": 0}
    assert ops(model) == dict(ops(ir.serde.deserialize_model(original)))
    h0 = model.graph.node("matmul_1").outputs[0]
    assert h0.dtype == ir.DataType.FLOAT and h0.shape == ir.Shape(["batch", 32])
    proto = checked(model)
    assert {v.name for v in proto.graph.value_info} >= {"h0", "h1", "r_a", "r_b", "r_sum", "dead"}
    assert_equivalent(original, proto)


def test_shape_inference_reports_unmodified_when_model_is_already_annotated() -> None:
    model, _ = apply(ShapeInference(), onnx.load(MLP_CLEANUP))
    result = ShapeInference()(model)
    assert not result.modified
    assert result.counts == {"values_typed": 0, "values_untyped": 0}


_SHAPE_ARITHMETIC = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 3, 4] x) => (float[N, M] y)
      <int64[1] start = {0}, int64[1] end = {1}, int64[1] minus_one = {-1}> {
        [shape] s = Shape(x)
        [slice] s0 = Slice(s, start, end)
        [concat] target = Concat <axis = 0> (s0, minus_one)
        [reshape] y = Reshape(x, target)
    }"""


def test_shape_inference_resolves_reshape_target_when_data_prop_is_on() -> None:
    """Shape -> Slice -> Concat is computed on values, so Reshape's output is [2, 12]."""
    original = parse(_SHAPE_ARITHMETIC)
    model, result = apply(ShapeInference({"data_prop": True}), original)
    assert result.modified
    assert model.graph.node("concat").outputs[0].shape == ir.Shape([2])
    # The graph output keeps the declared symbols N and M though inference found [2, 12]: users' code
    # reads the declaration, and the ledger rolls back a pass that freezes a declared axis.
    assert model.graph.outputs[0].shape == ir.Shape(["N", "M"])
    assert_equivalent(original, checked(model))


def test_shape_inference_keeps_declared_symbols_when_data_prop_is_off() -> None:
    original = parse(_SHAPE_ARITHMETIC)
    model, result = apply(ShapeInference({"data_prop": False}), original)
    assert result.modified  # the intermediate values still get types
    assert model.graph.outputs[0].shape == ir.Shape(["N", "M"])


def test_shape_inference_keeps_declared_name_when_inference_gives_anonymous_dim() -> None:
    """NonZero's count is unknown to ONNX; the model's name ``nnz`` for it must survive."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N] x) => (int64[1, nnz] y) {
            [nonzero] y = NonZero(x)
        }""")
    model, result = apply(ShapeInference(), original)
    assert not result.modified
    assert model.graph.outputs[0].shape == ir.Shape([1, "nnz"])


_INCOMPATIBLE = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[3] x, float[4] z) => (float[N] y) {
        [add] a = Add(x, z)
        [relu] y = Relu(a)
    }"""


def test_shape_inference_returns_non_match_when_strict_and_a_node_cannot_be_inferred() -> None:
    model, result = apply(ShapeInference({"strict": True}), parse(_INCOMPATIBLE, check=False))
    assert not result.modified
    [non_match] = result.non_matches
    assert "Incompatible dimensions" in non_match.reason and "add" in non_match.reason
    assert model.graph.node("add").outputs[0].type is None


def test_shape_inference_counts_untyped_values_when_not_strict_and_a_node_cannot_be_inferred() -> None:
    _, result = apply(ShapeInference(), parse(_INCOMPATIBLE, check=False))
    assert result.non_matches == []
    assert result.counts == {"values_typed": 0, "values_untyped": 1}


def test_shape_inference_restores_initializers_and_inputs_when_large_ones_are_stripped() -> None:
    """A 4 KiB initializer is handed to ONNX as a typed input; afterwards the model is as it was."""
    original = onnx.load(MLP_CLEANUP)
    model, _ = apply(ShapeInference(), original)
    assert list(model.graph.initializers) == ["W1", "b1", "W2", "six"]
    assert [v.name for v in model.graph.inputs] == ["x"]
    w1 = model.graph.initializers["W1"].const_value
    assert w1 is not None
    np.testing.assert_array_equal(w1.numpy(), numpy_helper.to_array(original.graph.initializer[0]))
    assert_equivalent(original, checked(model))


def test_shape_inference_never_reads_external_data_when_weights_are_external(tmp_path) -> None:
    """The external weight file is deleted before the pass runs: reading it would raise."""
    path = tmp_path / "mlp.onnx"
    onnx.save(onnx.load(MLP_CLEANUP), path, save_as_external_data=True, location="mlp.bin", size_threshold=0)
    model = ir.load(path)
    (tmp_path / "mlp.bin").unlink()
    result = ShapeInference()(model)
    assert result.non_matches == []
    assert result.counts["values_typed"] > 0
    assert all(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())
    assert model.graph.node("matmul_1").outputs[0].shape == ir.Shape(["batch", 32])


def test_shape_inference_keeps_declared_io_when_vit_torchscript_export_fixes_the_sequence() -> None:
    """The TorchScript ViT export (fixed 32x32 image, 8x8 patches) declares ``last_hidden_state`` with
    symbolic sequence and hidden axes; inference finds 17 and 32. The inner values take the numbers, the
    declaration stays: it is the upload's signature, and freezing it made the ledger roll the pass back."""
    from tests.models.corpus import committed_path
    from tests.passes.test_fuse_io_signature import io_declarations

    upload = onnx.load(committed_path("vit", "ts_eager"))
    declared_dims = [d.dim_param or d.dim_value for d in upload.graph.output[0].type.tensor_type.shape.dim]
    assert declared_dims[1] and isinstance(declared_dims[1], str)  # a symbol, as the exporter writes it
    model, result = apply(ShapeInference(), upload)
    assert result.modified and result.counts["values_typed"] > 100
    proto = checked(model)
    assert io_declarations(proto) == io_declarations(upload)
    inner = {v.name: v for v in proto.graph.value_info}
    last_norm = next(n for n in reversed(proto.graph.node) if n.op_type == "LayerNormalization")
    assert last_norm.output[0] == proto.graph.output[0].name  # the output itself is declared, never inner
    ranks3 = [v.type.tensor_type.shape.dim for v in inner.values() if len(v.type.tensor_type.shape.dim) == 3]
    assert any(dims[1].dim_value == 17 for dims in ranks3)  # inner values do get the resolved sequence
    assert_equivalent(upload, proto, shapes=[{"pixel_values": (batch, 3, 32, 32)} for batch in (1, 3)])
