"""upgrade_opset: exports below opset 17 reach the fusions as opset-17 graphs (issue 17, export variants).

``tests/models/heldout/vit_op14_ts.onnx`` and ``llama_op14_ts.onnx``: ``python -m bench.heldout_export_variants
--only vit llama --exporters ts_op14`` (the corpus's tiny ViT and Llama, TorchScript at opset 14, dynamic batch,
and sequence for Llama); ``vit_op11_ts.onnx``: ``--only vit --exporters ts_op11``. Before the pass, ViT's
nine-node LayerNorms left 0/4 residual norms fused under ``fast``, and Llama's ``fuse_transformer`` raised on
the ``Shape(start=0, end=1)`` fuse_rotary writes (an attribute of opset 15): 0/2 attention. At opset 11 the
converter's flattened Softmax left 0/2 attention. Each case is checked against the original in ORT
(optimizations off) on shapes other than the export's.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx_ir as ir
import pytest

from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_gqa import FuseGqa
from passes.fusion.fuse_rotary import FuseRotary
from passes.fusion.fuse_transformer import FuseTransformer
from passes.fusion.upgrade_opset import UpgradeOpset
from tests.models.corpus import feeds
from tests.passes._util import MODELS, session

HELDOUT = MODELS / "heldout"
HIDDEN = 8


def _norm_graph(
    *, square: str = "pow", axis: int = -1, weight_shape: tuple[int, ...] = (HIDDEN,), commuted: bool = False
) -> onnx.ModelProto:
    """``Relu(x)`` then a LayerNorm as TorchScript writes it at opset 14 (axes attribute, no keepdims), then
    ``Relu`` again: the norm is interior, its constants Constant nodes as the exporter emits them."""
    rng = np.random.default_rng(0)

    def const(name: str, value: np.ndarray) -> onnx.NodeProto:
        return oh.make_node("Constant", [], [name], value=onh.from_array(value, name))

    sq = oh.make_node("Pow", ["d", "two"], ["sq"]) if square == "pow" else oh.make_node("Mul", ["d", "d"], ["sq"])
    nodes = [
        oh.make_node("Relu", ["x"], ["h"]),
        oh.make_node("ReduceMean", ["h"], ["mean"], axes=[axis]),
        oh.make_node("Sub", ["h", "mean"], ["d"]),
        const("two", np.array(2.0, np.float32)),
        sq,
        oh.make_node("ReduceMean", ["sq"], ["var"], axes=[axis]),
        const("eps", np.array(1e-5, np.float32)),
        oh.make_node("Add", ["var", "eps"], ["ve"]),
        oh.make_node("Sqrt", ["ve"], ["std"]),
        oh.make_node("Div", ["d", "std"], ["n"]),
        oh.make_node("Mul", ["w", "n"] if commuted else ["n", "w"], ["nw"]),
        oh.make_node("Add", ["b", "nw"] if commuted else ["nw", "b"], ["y0"]),
        oh.make_node("Relu", ["y0"], ["y"]),
    ]
    inits = [
        onh.from_array(rng.standard_normal(weight_shape).astype(np.float32), "w"),
        onh.from_array(rng.standard_normal(HIDDEN).astype(np.float32), "b"),
    ]
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", "S", HIDDEN])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["B", "S", HIDDEN])],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 14)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _same(original: onnx.ModelProto | str, rewritten: ir.Model, feeds_list: list[dict[str, np.ndarray]]) -> None:
    reference, candidate = session(original if isinstance(original, str) else _ir(original)), session(rewritten)
    for x in feeds_list:
        for ref, got in zip(reference.run(None, x), candidate.run(None, x), strict=True):
            assert ref.shape == got.shape
            np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-3)


def _ir(proto: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(proto)


def _upgraded(model: ir.Model) -> ir.Model:
    result = UpgradeOpset()(model, PassContext())
    onnx.checker.check_model(ir.serde.serialize_model(result.model), full_check=True)
    return result.model


def _xs() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal(s).astype(np.float32)} for s in ((1, 3, HIDDEN), (4, 11, HIDDEN))]


@pytest.mark.parametrize(("square", "commuted"), [("pow", False), ("mul", False), ("pow", True)])
def test_written_out_layer_norm_fuses_at_opset_17(square, commuted) -> None:
    proto = _norm_graph(square=square, commuted=commuted)
    result = UpgradeOpset()(_ir(proto), PassContext())
    assert result.modified and result.counts["layer_norms_fused"] == 1
    assert result.model.opset_imports[""] == 17
    ops = op_histogram(result.model)
    assert ops["LayerNormalization"] == 1 and "ReduceMean" not in ops and "Sqrt" not in ops
    onnx.checker.check_model(ir.serde.serialize_model(result.model), full_check=True)
    _same(proto, result.model, _xs())


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [("not the last axis", {"axis": 1}), ("weight not a vector", {"weight_shape": (1, 1, HIDDEN)})],
)
def test_other_statistics_are_converted_but_not_fused(case, kwargs) -> None:
    proto = _norm_graph(**kwargs)
    model = _upgraded(_ir(proto))
    assert model.opset_imports[""] == 17
    assert "LayerNormalization" not in op_histogram(model), case
    _same(proto, model, _xs())


def test_opset_17_graph_is_left_as_it_is() -> None:
    model = ir.load(MODELS / "corpus" / "vit_ts_eager.onnx")
    result = UpgradeOpset()(model, PassContext())
    assert not result.modified and "nothing to upgrade" in result.non_matches[0].reason


def test_vit_opset_14_fuses_every_norm_and_keeps_its_declared_outputs() -> None:
    path = HELDOUT / "vit_op14_ts.onnx"
    model = _upgraded(ir.load(path))
    assert op_histogram(model)["LayerNormalization"] == 5  # two per layer and the final one
    out = model.graph.outputs[0]
    assert [str(d) for d in out.shape] == ["batch", "Addlast_hidden_state_dim_1", "Addlast_hidden_state_dim_2"]
    fused = FuseTransformer()(model).model
    ops = op_histogram(fused)
    assert ops["com.microsoft::Attention"] + ops["com.microsoft::MultiHeadAttention"] == 2
    assert ops["com.microsoft::SkipLayerNormalization"] == 4
    _same(str(path), fused, [feeds("vit", "tiny", b, 0, seed=b) for b in (1, 3)])


def test_llama_opset_14_rotary_and_attention_fuse_into_a_valid_graph() -> None:
    path = HELDOUT / "llama_op14_ts.onnx"
    model = _upgraded(ir.load(path))
    for p in (FuseRotary(), FuseGqa(), FuseTransformer()):
        model = p(model, PassContext()).model
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    ops = op_histogram(model)
    assert ops["com.microsoft::RotaryEmbedding"] == 4
    assert ops["com.microsoft::GroupQueryAttention"] + ops["com.microsoft::MultiHeadAttention"] == 2
    _same(str(path), model, [feeds("llama", "tiny", b, s, seed=b, pad=True) for b, s in ((1, 7), (3, 23))])


@pytest.mark.parametrize("preset", ["fast", "int8", "int4", "fp16"])
def test_every_fusing_preset_upgrades_the_opset_before_its_fusions(preset) -> None:
    from passes.registry import PRESETS

    names = PRESETS[preset].passes
    fusions = [i for i, n in enumerate(names) if n in ("fuse_transformer", "fuse_rotary", "fuse_gqa")]
    assert fusions and names.index("upgrade_opset") < min(fusions)


def _softmax_graph(axis: int) -> onnx.ModelProto:
    """``Softmax(Relu(x), axis)`` at opset 11, x ``[B, H, S, S]`` (scores), read by a Relu."""
    graph = oh.make_graph(
        [
            oh.make_node("Relu", ["x"], ["r"]),
            oh.make_node("Softmax", ["r"], ["p"], axis=axis),
            oh.make_node("Relu", ["p"], ["y"]),
        ],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", 2, "S", "S"])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["B", 2, "S", "S"])],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 11)])


@pytest.mark.parametrize(("axis", "direct"), [(3, True), (-1, True), (1, False)])
def test_opset_11_softmax_over_the_last_axis_is_one_softmax_at_17(axis, direct) -> None:
    """Before 13, Softmax normalizes x flattened from ``axis`` on; the converter writes that as Flatten ->
    Softmax -> Reshape where it cannot read the rank (here it can, and writes Softmax(axis=-1) itself; the ViT
    below is the case it cannot). Over the last axis it is Softmax(axis=-1) at 13; over axis 1 (heads, rows and
    columns together) it is not, and stays flattened."""
    proto = _softmax_graph(axis)
    result = UpgradeOpset()(_ir(proto), PassContext())
    onnx.checker.check_model(ir.serde.serialize_model(result.model), full_check=True)
    ops = op_histogram(result.model)
    assert result.counts["softmax_unflattened"] == 0 or direct  # the converter itself may write it directly
    assert ("Flatten" not in ops and "Reshape" not in ops) if direct else ops["Flatten"] == 1
    rng = np.random.default_rng(2)
    xs = [{"x": rng.standard_normal((b, 2, s, s)).astype(np.float32)} for b, s in ((1, 3), (3, 7))]
    _same(proto, result.model, xs)


def test_vit_opset_11_attention_fuses_after_the_upgrade() -> None:
    """The TorchScript ViT at opset 11: its attention Softmax came out of the converter flattened and neither
    fusion engine matched it (0/2 under ``fast``); now both layers fuse, exact at other batch sizes."""
    path = HELDOUT / "vit_op11_ts.onnx"
    result = UpgradeOpset()(ir.load(path), PassContext())
    model = result.model
    assert result.counts["softmax_unflattened"] == 2 and "Flatten" not in op_histogram(model)
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    fused = FuseTransformer()(model).model
    ops = op_histogram(fused)
    assert ops["com.microsoft::Attention"] + ops["com.microsoft::MultiHeadAttention"] == 2 and "Softmax" not in ops
    _same(str(path), fused, [feeds("vit", "tiny", b, 0, seed=b) for b in (1, 3)])
