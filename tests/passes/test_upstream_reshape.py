"""Tests of passes/compute_order/upstream_reshape.py on ORT's Reshape cases (``compute_optimizer_test.cc``,
spec 1.6) and on the LM-head chain it exists for: flatten moved up, then ``upstream_slice`` carries a row filter
up the head.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from passes._infra import PassResult
from passes.compute_order.upstream_reshape import UpstreamReshape
from passes.compute_order.upstream_slice import UpstreamSlice
from tests.numerics import assert_equivalent
from tests.passes._ort_cases import BOOL, I64, F, build, node, weights

TOL = {"rtol": 1e-4, "atol": 1e-4}


def _optimize(proto: onnx.ModelProto) -> tuple[ir.Model, PassResult]:
    model = ir.serde.deserialize_model(proto)
    result = UpstreamReshape()(model)
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    unread = [name for name, v in model.graph.initializers.items() if not list(v.uses())]
    assert not unread, f"initializers left behind: {unread}"
    return model, result


def _flatten_after(op_node: onnx.NodeProto, inputs: dict, inits: dict | None = None, opset: int = 14, width: int = 16):
    """op -> Reshape([-1, width]) -> Identity (ORT's Reshape_* graphs)."""
    nodes = [
        op_node,
        node("Reshape", [op_node.output[0], "flat"], "r", "reshape"),
        node("Identity", ["r"], "y", "identity"),
    ]
    inits = {"flat": np.array([-1, width], np.int64), **(inits or {})}
    return build(nodes, inputs, {"y": F}, inits, opset)


def _reshaped_inputs(model: ir.Model, name: str) -> list[str]:
    """Names of the original inputs of node ``name`` that now come through a moved Reshape."""
    (target,) = [n for n in model.graph if n.name == name]
    found = []
    for value in target.inputs:
        producer = value.producer() if value is not None else None
        if producer is not None and producer.op_type == "Reshape":
            assert producer.inputs[1].const_value.numpy().tolist()[0] == -1
            found.append(producer.inputs[0].name)
    return found


@pytest.mark.parametrize("opset", [12, 13, 14])
def test_reshape_goes_to_both_inputs_when_add_inputs_are_full_rank(opset):
    """Add(a[4,32,16], b[4,32,16]) -> Reshape[-1,16]: each input gets Reshape([-1,16]) (ORT's Reshape test)."""
    proto = _flatten_after(
        node("Add", ["a", "b"], "s", "add"), {"a": (F, [4, 32, 16]), "b": (F, [4, 32, 16])}, opset=opset
    )
    model, result = _optimize(proto)
    assert _reshaped_inputs(model, "add") == ["a", "b"]
    assert [n.op_type for n in model.graph].count("Reshape") == 2
    assert result.counts == {"reshapes_moved": 1, "ops_crossed": 1, "copies_merged": 0}
    assert_equivalent(proto, model)


@pytest.mark.parametrize("other", [[16], [], [1, 16], [4, 32, 1]], ids=["rank1", "scalar", "rank2-broadcast", "last-1"])
def test_reshape_goes_to_the_3d_input_only_when_other_input_broadcasts(other):
    """Add(a[4,32,16], b): b of [16] or a scalar stays (ORT too); [1,16] stays, [4,32,1] is flattened too."""
    proto = _flatten_after(node("Add", ["a", "b"], "s", "add"), {"a": (F, [4, 32, 16]), "b": (F, other)})
    model, _ = _optimize(proto)
    assert _reshaped_inputs(model, "add") == (["a", "b"] if len(other) == 3 else ["a"])
    assert_equivalent(proto, model)


def test_reshape_stays_when_an_input_carries_only_one_leading_dim():
    """Add(a[4,1,16], b[32,16]) -> [4,32,16]: neither input has both leading dims (ORT: no change)."""
    proto = _flatten_after(node("Add", ["a", "b"], "s", "add"), {"a": (F, [4, 1, 16]), "b": (F, [32, 16])})
    _, result = _optimize(proto)
    assert not result.modified
    assert "does not carry both leading dims" in result.non_matches[0].reason


def test_reshape_is_no_entry_when_it_does_not_flatten_the_leading_dims():
    """Cast([128,4,32]) -> Reshape([-1,128]): the last dim changes, so it is not [B,S,H]->[B*S,H]."""
    proto = _flatten_after(node("Cast", ["a"], "c", "cast", to=F), {"a": (F, [128, 4, 32])}, width=128)
    _, result = _optimize(proto)
    assert not result.modified
    assert "is no flatten" in result.non_matches[0].reason


def test_reshape_goes_to_lhs_only_when_matmul_has_2d_weights():
    """MatMul(a[4,32,16], w[16,16]) -> Reshape[-1,16]: only the lhs is flattened."""
    proto = _flatten_after(node("MatMul", ["a", "w"], "m", "matmul"), {"a": (F, [4, 32, 16])}, {"w": weights(16, 16)})
    model, _ = _optimize(proto)
    assert _reshaped_inputs(model, "matmul") == ["a"]
    assert_equivalent(proto, model, **TOL)


@pytest.mark.parametrize(("axis", "moves"), [(-1, True), (2, True), (1, False)])
def test_reshape_crosses_layer_norm_when_it_normalizes_the_last_axis(axis, moves):
    """LayerNormalization(axis) on [4,32,16]: axis -1/2 moves and becomes 1; axis 1 would normalize over S."""
    scale_shape = [16] if axis % 3 == 2 else [32, 16]
    ln = node("LayerNormalization", ["a", "g"], "n", "ln", axis=axis)
    proto = _flatten_after(ln, {"a": (F, [4, 32, 16])}, {"g": weights(*scale_shape) + 1}, opset=17)
    model, result = _optimize(proto)
    assert result.modified == moves
    if moves:
        (ln_node,) = [n for n in model.graph if n.name == "ln"]
        assert ln_node.attributes.get_int("axis") == 1
    assert_equivalent(proto, model, **TOL)


def test_reshape_stops_when_producer_output_is_a_graph_output():
    nodes = [
        node("Relu", ["a"], "r0", "relu"),
        node("Reshape", ["r0", "flat"], "r", "reshape"),
        node("Identity", ["r"], "y", "identity"),
    ]
    proto = build(nodes, {"a": (F, [2, 3, 4])}, {"y": F, "r0": F}, {"flat": np.array([-1, 4], np.int64)})
    _, result = _optimize(proto)
    assert not result.modified
    assert "graph output" in result.non_matches[0].reason


def test_lm_head_row_filter_reaches_the_encoder_when_reshape_moves_first():
    """h[B,S,H] -> LN -> MatMul(W[H,V]) -> Add(b) -> Reshape[-1,V] -> Gather(axis 0, Squeeze(NonZero(keep))).

    upstream_reshape moves the flatten to h; upstream_slice then carries the row filter up the whole head,
    so LayerNorm, the [N,H]x[H,V] MatMul and the bias run only on the kept rows.
    """
    hidden, vocab = 16, 40
    nodes = [
        node("LayerNormalization", ["h", "g", "beta"], "n", "ln", axis=-1),
        node("MatMul", ["n", "w"], "m", "decoder"),
        node("Add", ["m", "bias"], "logits3d", "decoder_bias"),
        node("Reshape", ["logits3d", "flat"], "logits", "view"),
        node("Reshape", ["keep", "flat1"], "keep1", "keep_view"),
        node("NonZero", ["keep1"], "nz", "nonzero"),
        node("Squeeze", ["nz", "zero"], "idx", "squeeze"),
        node("Gather", ["logits", "idx"], "kept", "filter", axis=0),
        node("Identity", ["kept"], "y", "identity"),
    ]
    inits = {
        "g": weights(hidden, seed=1) + 1,
        "beta": weights(hidden, seed=2),
        "w": weights(hidden, vocab, seed=3),
        "bias": weights(vocab, seed=4),
        "flat": np.array([-1, vocab], np.int64),
        "flat1": np.array([-1], np.int64),
        "zero": np.array([0], np.int64),
    }
    proto = build(nodes, {"h": (F, ["batch", "seq", hidden]), "keep": (BOOL, ["batch", "seq"])}, {"y": F}, inits, 17)
    model = ir.serde.deserialize_model(proto)
    assert UpstreamReshape()(model).counts == {"reshapes_moved": 1, "ops_crossed": 3, "copies_merged": 0}
    assert UpstreamSlice()(model).counts["ops_crossed"] == 3
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    order = [n.op_type for n in model.graph if n.op_type in ("Reshape", "Gather", "LayerNormalization", "MatMul")]
    assert order[-4:] == ["Reshape", "Gather", "LayerNormalization", "MatMul"]
    (ln,) = [n for n in model.graph if n.name == "ln"]
    assert ln.inputs[0].producer().op_type == "Gather"
    assert ln.inputs[0].producer().inputs[0].producer().inputs[0].name == "h"
    assert_equivalent(proto, model, **TOL)


def test_reshape_is_no_entry_when_its_rank_is_unknown():
    """A Reshape with a data-dependent target shape is left alone."""
    nodes = [node("Relu", ["a"], "r0", "relu"), node("Reshape", ["r0", "s"], "r", "reshape")]
    nodes.append(node("Identity", ["r"], "y", "identity"))
    proto = build(nodes, {"a": (F, [2, 3, 4]), "s": (I64, [2])}, {"y": F})
    _, result = _optimize(proto)
    assert not result.modified


def _erf_gelu_head(second_reader: str | None = None) -> onnx.ModelProto:
    """h[B,S,H] -> MatMul(W) -> Add(b) = x -> erf-GELU (x/sqrt2 -> Erf -> +1 -> x * . -> * 0.5) -> Reshape[-1,H].

    x has two readers (Div and the first Mul), as in every BERT/RoBERTa FFN and LM-head transform exported
    by torch. ``second_reader`` adds a third reader of x (a graph output through that op)."""
    hidden = 8
    nodes = [
        node("MatMul", ["h", "w"], "m", "dense"),
        node("Add", ["m", "b"], "x", "dense_bias"),
        node("Div", ["x", "sqrt2"], "d", "gelu_div"),
        node("Erf", ["d"], "e", "gelu_erf"),
        node("Add", ["e", "one"], "e1", "gelu_add"),
        node("Mul", ["x", "e1"], "p", "gelu_mul"),
        node("Mul", ["p", "half"], "gelu", "gelu_half"),
        node("Reshape", ["gelu", "flat"], "r", "view"),
        node("Identity", ["r"], "y", "identity"),
    ]
    outputs = {"y": F}
    if second_reader is not None:
        nodes.append(node(second_reader, ["x"], "z", "other"))
        outputs["z"] = F
    inits = {
        "w": weights(hidden, hidden, seed=1),
        "b": weights(hidden, seed=2),
        "sqrt2": np.array(np.sqrt(2.0), np.float32),
        "one": np.array(1.0, np.float32),
        "half": np.array(0.5, np.float32),
        "flat": np.array([-1, hidden], np.int64),
    }
    return build(nodes, {"h": (F, ["batch", "seq", hidden])}, outputs, inits, 17)


def test_reshape_copies_merge_and_move_on_when_every_reader_of_a_value_gets_one():
    """The flatten reaches x on both GELU branches; the two copies merge and it goes on through the bias
    Add and the MatMul to h (ORT and a pass without merging stop at x: "2 consumers")."""
    proto = _erf_gelu_head()
    model, result = _optimize(proto)
    assert result.counts == {"reshapes_moved": 1, "ops_crossed": 7, "copies_merged": 1}
    reshapes = [n for n in model.graph if n.op_type == "Reshape"]
    assert len(reshapes) == 1 and reshapes[0].inputs[0].name == "h"
    (dense,) = [n for n in model.graph if n.name == "dense"]
    assert dense.inputs[0] is reshapes[0].outputs[0]
    assert not result.non_matches or all("graph input" in m.reason for m in result.non_matches)
    assert_equivalent(proto, model, **TOL)


def test_reshape_copies_stay_when_a_value_has_a_reader_that_is_no_flatten():
    """x is also read by a Sigmoid: the copies on x cannot merge into one flatten, so they stop there."""
    proto = _erf_gelu_head(second_reader="Sigmoid")
    model, result = _optimize(proto)
    assert result.counts["copies_merged"] == 0
    assert any("stops at 'dense_bias' (3 consumers)" in m.reason for m in result.non_matches)
    assert [n.inputs[0].name for n in model.graph if n.op_type == "Reshape"] == ["x", "x"]
    assert_equivalent(proto, model, **TOL)


def test_hf_bert_mlm_row_filter_reaches_the_last_attention_when_copies_merge():
    """Torch-exported BertForMaskedLM, loss only (the ``logits`` output dropped, as in bench/seed_passes.py):
    label_sparsity, upstream_reshape, upstream_slice. The flatten crosses the LM head, the last layer's FFN,
    residual Adds and LayerNorms (merging the copies met at the GELU halves and at each LayerNorm read by
    the FFN and the residual), so the row filter ends on the last attention's merged heads (before the
    output projection) and on the previous layer's output (the residual): only attention runs on all rows.
    """
    from passes._infra import PassContext
    from passes.cleanup.dead_node_elimination import DeadNodeElimination
    from passes.compute_order.label_sparsity import LabelSparsity
    from tests.models.build_hf import make_inputs

    path = Path(__file__).resolve().parents[1] / "models" / "hf_bert_mlm_loss.onnx"
    proto = onnx.load(str(path))
    outputs = [o for o in proto.graph.output if o.name != "logits"]
    del proto.graph.output[:]
    proto.graph.output.extend(outputs)
    model = ir.serde.deserialize_model(proto)
    DeadNodeElimination()(model)
    proto = ir.serde.serialize_model(model)
    feeds = [
        make_inputs("bert_mlm_loss", b, s, valid_label_fraction=0.15, seed=b, size="tiny") for b, s in ((4, 16), (3, 9))
    ]
    ctx = PassContext(samples=feeds[:1])
    assert LabelSparsity()(model, ctx).modified
    reshaped = UpstreamReshape()(model, ctx)
    assert reshaped.counts["copies_merged"] >= 3
    assert UpstreamSlice()(model, ctx).counts["copies_merged"] >= 3
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    filters = [n for n in model.graph if n.op_type == "Gather" and "gather_logits" in n.name]
    sources = sorted(f.inputs[0].producer().inputs[0].producer().op_type for f in filters)
    # the previous layer's output; the heads transposed back, which the flatten now reads directly (the
    # merging Reshape folds into it)
    assert sources == ["LayerNormalization", "Transpose"]
    users = sorted(u.node.op_type for f in filters for u in f.outputs[0].uses())
    assert users == ["Add", "MatMul"]  # the residual Add; the attention output projection
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref, opt = (
        ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
        for m in (proto, ir.serde.serialize_model(model))
    )
    for feed in feeds:
        (expected,), (got,) = ref.run(None, feed), opt.run(None, feed)
        np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_upstream_reshape_keeps_declared_io_when_it_moves_nothing_on_a_vit_torchscript_export():
    """The TorchScript ViT export has unannotated values, so the pass runs shape inference first; that
    inference resolves the declared symbolic output axes to 17 and 32. Nothing moves, so the model must
    come back unmodified and declaring exactly what the upload did."""
    from tests.models.corpus import committed_path
    from tests.passes.test_fuse_io_signature import io_declarations

    upload = onnx.load(committed_path("vit", "ts_eager"))
    model = ir.serde.deserialize_model(upload)
    assert any(o.shape is None for n in model.graph for o in n.outputs)  # inference will run
    result = UpstreamReshape()(model)
    assert not result.modified
    assert result.notes.get("shape_inference")
    proto = ir.serde.serialize_model(model)
    assert io_declarations(proto) == io_declarations(upload)
    assert [n.op_type for n in proto.graph.node] == [n.op_type for n in upload.graph.node]
    assert_equivalent(upload, proto, shapes=[{"pixel_values": (b, 3, 32, 32)} for b in (1, 3)])
