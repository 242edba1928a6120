"""Tests of passes/compute_order/upstream_slice.py on ORT's compute-optimizer cases (rebuilt in
``_ort_cases.py``) and on the cases where ORT's rules are unsound. The driver (graph outputs, shape
inference, opsets, random graphs, torch exports, copy merging) is tested in ``test_upstream_slice_driver.py``.

Each test asserts where the slice ended up (by node, op and inputs) and that the optimized model computes
the same outputs as the original under ORT with graph optimizations off, on several random inputs, at
other sizes of the symbolic dims too.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx_ir.passes.common import CommonSubexpressionEliminationPass

from passes.compute_order.upstream_slice import UpstreamSlice
from tests.numerics import assert_equivalent
from tests.passes import _ort_cases as cases
from tests.passes._ort_cases import I64, F, build, node, weights
from tests.passes._slice_helpers import (
    TOL,
    assert_same_feeds,
    assert_unchanged,
    dims_of,
    named,
    ops_of,
    optimize,
    producer_of,
)

# The counts of one slice moved across one op, nothing else done.
ONE_SLICE_ONE_OP = {
    "slices_moved": 1,
    "ops_crossed": 1,
    "squeezes_added": 0,
    "copies_merged": 0,
    "conv_crops_folded": 0,
}

# --- GatherND ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["Gelu", "Add", "LayerNormalization", "MatMul"])
def test_gathernd_moves_onto_graph_input_when_op_is_allowed(op):
    """op(input) -> GatherND -> Identity  =>  GatherND(input) -> op -> Identity (ORT's GatherND_<op>)."""
    proto = cases.gathernd(op)
    model, result = optimize(proto)
    (gathernd,) = ops_of(model, "GatherND")
    assert gathernd.inputs[0].name == "input" and gathernd.inputs[1].name == "positions"
    moved_op = ops_of(model, op)[0]
    assert producer_of(moved_op.inputs[0]) is gathernd
    assert producer_of(named(model, "identity").inputs[0]) is moved_op
    assert result.counts == ONE_SLICE_ONE_OP
    rng = np.random.default_rng(0)
    feeds = [
        {"input": rng.standard_normal((b, s, 32)).astype(np.float32), "positions": rng.integers(0, s, (b, 3, 1))}
        for b, s in ((2, 7), (1, 5), (4, 3))
    ]
    assert_same_feeds(proto, model, feeds)


def test_gathernd_moves_and_keeps_the_output_name_when_its_output_is_a_graph_output():
    """ORT's GatherND_Add second GatherND, which ORT leaves: the slice producing the graph output moves above
    Add, and Add's output takes the name ``output``, so the model's signature is unchanged."""
    nodes = [
        node("Add", ["input", "bias"], "sum", "add"),
        node("GatherND", ["sum", "pos"], "output", "g", batch_dims=1),
    ]
    proto = build(
        nodes, {"input": (F, ["batch", 8, 4]), "pos": (I64, ["batch", 3, 1])}, {"output": F}, {"bias": weights(4)}
    )
    model, result = optimize(proto)
    assert result.counts["ops_crossed"] == 1
    (out,) = model.graph.outputs
    assert out.name == "output" and producer_of(out) is named(model, "add")
    assert producer_of(named(model, "add").inputs[0]).op_type == "GatherND"
    rng = np.random.default_rng(0)
    feeds = [
        {"input": rng.standard_normal((b, 8, 4)).astype(np.float32), "pos": rng.integers(0, 8, (b, 3, 1))}
        for b in (2, 5)
    ]
    assert_same_feeds(proto, model, feeds)


# --- GatherMatMul -------------------------------------------------------------------------------------


@pytest.mark.parametrize("scalar", [True, False], ids=["scalar", "non-scalar"])
@pytest.mark.parametrize(
    ("axis", "expected"),
    [(0, {0: 0, 1: 0}), (1, {0: 1}), (2, {1: 2})],
    ids=["batch-dim", "second-last-dim", "last-dim"],
)
def test_gather_matmul_slices_the_operands_that_carry_the_axis_when_gather_follows_matmul(axis, expected, scalar):
    """[8,16,H] x [8,H,16] -> m1 -> Gather(axis): batch -> both inputs; M -> input1 only; N -> input2 only."""
    proto = cases.gather_matmul(axis, scalar)
    model, result = optimize(proto)
    m1 = named(model, "m1")
    for i, name in enumerate(("input1", "input2")):
        value = m1.inputs[i]
        if i not in expected:
            assert value.name == name
            continue
        if scalar:  # the scalar slice goes through Unsqueeze so MatMul keeps its rank
            unsqueeze = producer_of(value)
            assert unsqueeze.op_type == "Unsqueeze"
            value = unsqueeze.inputs[0]
        gather = producer_of(value)
        assert gather.op_type == "Gather" and gather.inputs[0].name == name
        assert gather.attributes.get_int("axis") == expected[i]
    identity_in = producer_of(named(model, "identity").inputs[0])
    assert identity_in.op_type == ("Squeeze" if scalar else "MatMul")
    assert result.counts["squeezes_added"] == int(scalar)
    assert_equivalent(proto, model, **TOL)


# --- GatherLayerNormalization / GatherSoftmax ------------------------------------------------------------


@pytest.mark.parametrize("scalar", [True, False], ids=["scalar", "non-scalar"])
@pytest.mark.parametrize("ln_axis", [2, -1])
def test_gather_layer_norm_moves_when_ln_axis_is_after_slice_axis(ln_axis, scalar):
    """[2,32,64] -> LN(axis) -> Gather(axis 1): moves; a scalar slice turns LN axis into 1, output [2,64]."""
    proto = cases.gather_layer_norm(ln_axis, scalar)
    model, _ = optimize(proto)
    ln = named(model, "ln")
    assert producer_of(ln.inputs[0]).op_type == "Gather" and producer_of(ln.inputs[0]).inputs[0].name == "input"
    assert ln.attributes.get_int("axis") == (1 if scalar else ln_axis)
    assert dims_of(ln.outputs[0]) == ([2, 64] if scalar else [2, 1, 64])
    assert_equivalent(proto, model, **TOL)


@pytest.mark.parametrize("ln_axis", [0, 1, -3, -2])
def test_gather_layer_norm_stays_when_ln_axis_is_not_after_slice_axis(ln_axis):
    result = assert_unchanged(cases.gather_layer_norm(ln_axis, scalar=True))
    normalized = ln_axis % 3
    assert result.non_matches[0].reason == (
        f"Gather 'g1' stops at 'ln' (LayerNormalization axis {normalized} <= slice axis 1)"
    )


@pytest.mark.parametrize("scalar", [True, False], ids=["scalar", "non-scalar"])
@pytest.mark.parametrize(("softmax_axis", "scalar_axis"), [(2, 1), (3, 2), (-2, 1), (-1, 2)])
def test_gather_softmax_moves_when_softmax_axis_is_after_slice_axis(softmax_axis, scalar_axis, scalar):
    proto = cases.gather_softmax(softmax_axis, scalar)
    model, _ = optimize(proto)
    softmax = named(model, "softmax")
    assert producer_of(softmax.inputs[0]).op_type == "Gather"
    assert softmax.attributes.get_int("axis") == (scalar_axis if scalar else softmax_axis)
    assert_equivalent(proto, model, **TOL)


@pytest.mark.parametrize("softmax_axis", [0, 1, -4, -3])
def test_gather_softmax_stays_when_softmax_axis_is_not_after_slice_axis(softmax_axis):
    assert_unchanged(cases.gather_softmax(softmax_axis, scalar=False))


# --- GatherReshape ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("axis", "indices", "shape", "new_shape"),
    [
        pytest.param(0, np.array(0), [0, 0, 16, 64], [0, 16, 64], id="scalar-batch"),
        pytest.param(1, np.array(3), [0, 0, 16, 64], [0, 16, 64], id="scalar-seqlen"),
        pytest.param(0, np.array([0]), [0, 0, 16, 64], [0, 0, 16, 64], id="batch"),
        pytest.param(1, np.array([0, 2]), [0, 0, 16, 64], [0, 0, 16, 64], id="seqlen"),
    ],
)
def test_gather_reshape_moves_above_reshape_when_dims_before_axis_are_kept(axis, indices, shape, new_shape):
    """[B,S,1024] -> Reshape(shape) -> [B,S,16,64] -> Gather(axis): the shape constant follows the slice."""
    proto = cases.gather_reshape(axis, indices.astype(np.int64), shape, seq=16)
    model, _ = optimize(proto)
    reshape = named(model, "reshape")
    assert producer_of(reshape.inputs[0]).op_type == "Gather"
    assert reshape.inputs[1].const_value.numpy().tolist() == new_shape
    sizes = [{"input": (2, 16, 1024)}, {"input": (3, 16, 1024)}, {"input": (1, 16, 1024)}]
    assert_equivalent(proto, model, shapes=sizes, n_random=0, **TOL)  # batch >= 1: index 0 exists


def test_gather_reshape_rewrites_the_seq_entry_when_shape_names_it():
    """ORT's SeqlenDim2: S=128, shape [0,128,4,64], 31 indices on axis 1 -> shape [0,31,4,64]."""
    indices = np.arange(0, 124, 4, dtype=np.int64)  # 31 indices
    proto = cases.gather_reshape(1, indices, [0, 128, 4, 64], seq=128)
    model, _ = optimize(proto)
    reshape = named(model, "reshape")
    assert reshape.inputs[1].const_value.numpy().tolist() == [0, 31, 4, 64]
    assert dims_of(producer_of(reshape.inputs[0]).outputs[0]) == ["batch", 31, 256]
    assert_equivalent(proto, model, **TOL)


# --- RoBERTa classification head -------------------------------------------------------------------------


def test_roberta_cls_gather_moves_into_the_last_layer_when_run_with_cse():
    """2-layer encoder -> Gather(axis 1, 0) -> dense -> Tanh -> out_proj, then upstream_slice + CSE to a fixpoint.

    Afterwards the last layer computes its FFN, output projection and query path on one token, the keys
    and values stay full ([B,S,.]), the query-key MatMul takes its lhs from an Unsqueeze, the masked Add
    (which broadcasts on the query axis) is followed by a Squeeze, and the cls Gathers sit on layer 0's
    output, which the keys and values also read.
    """
    proto = cases.roberta_classifier()
    model = ir.serde.deserialize_model(proto)
    for _ in range(4):
        moved = UpstreamSlice()(model).modified
        merged = CommonSubexpressionEliminationPass()(model).modified
        if not (moved or merged):
            break
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    last = "layer1"
    assert dims_of(named(model, f"{last}/ln2").outputs[0]) == ["batch", 32]
    assert dims_of(named(model, f"{last}/gelu").outputs[0]) == ["batch", 64]
    qk = named(model, f"{last}/qk")
    assert producer_of(qk.inputs[0]).op_type == "Unsqueeze"
    assert qk.inputs[1].name == f"{last}/k_t.out"
    assert dims_of(named(model, f"{last}/k_t").outputs[0]) == ["batch", 4, 8, "seq"]  # keys stay full
    masked = named(model, f"{last}/masked")
    (squeeze,) = [u.node for u in masked.outputs[0].uses()]
    assert squeeze.op_type == "Squeeze"
    gathers = ops_of(model, "Gather")
    assert gathers and all(g.inputs[0].name == "layer0/ln2.out" for g in gathers)
    assert len(gathers) == 1  # CSE merged the copies of the query path and the residual
    assert_equivalent(proto, model, shapes=[{"embeddings": (2, 5, 32), "mask": (2, 1, 1, 5)}], **TOL)


# --- ShrunkenGather, Slice, SliceTranspose --------------------------------------------------------------


def test_shrinking_gather_moves_on_both_branches_when_indices_come_from_nonzero():
    """Add(int64 [4,32,64] x 2) -> Gather(axis 1, Squeeze(NonZero(keep))): one Gather per Add input."""
    proto = cases.shrunken_gather_two_branches()
    model, result = optimize(proto)
    add = named(model, "add")
    gathers = [producer_of(v) for v in add.inputs]
    assert [g.op_type for g in gathers] == ["Gather", "Gather"]
    assert [g.inputs[0].name for g in gathers] == ["a", "b"]
    assert gathers[0].inputs[1] is gathers[1].inputs[1] and gathers[0].inputs[1].name == "idx"
    assert result.counts == ONE_SLICE_ONE_OP
    assert_equivalent(proto, model)


@pytest.mark.parametrize(
    ("data_shape", "axes", "steps", "moves"),
    [
        pytest.param([4, 32, 64], None, False, False, id="3d-axes-absent"),
        pytest.param([4, 32, 64], None, True, False, id="3d-axes-omitted-steps"),
        pytest.param([4, 32, 64], [1], False, True, id="3d-axes-1"),
        pytest.param([4, 32, 64], [1], True, True, id="3d-axes-1-steps"),
        pytest.param([256], None, False, True, id="1d-axes-absent"),
        pytest.param([256], None, True, True, id="1d-axes-omitted-steps"),
        pytest.param([256], [0], True, True, id="1d-axes-0"),
    ],
)
def test_slice_moves_on_both_branches_when_it_has_one_known_axis(data_shape, axes, steps, moves):
    """Add(a, b) -> Slice(0:-1): 3-D data moves only with axes=[1]; 1-D data always moves.

    ORT's "axes empty" variant is an omitted axes input before steps here: ONNX rejects an empty axes
    tensor next to one-element starts.
    """
    proto = cases.slice_two_branches(data_shape, axes, steps)
    model, result = optimize(proto)
    producers = [producer_of(v).op_type if v.producer() else None for v in named(model, "add").inputs]
    assert producers == (["Slice", "Slice"] if moves else [None, None])
    assert result.modified == moves
    assert_equivalent(proto, model)


def test_slice_moves_above_transpose_when_axis_maps_through_perm():
    """[2,4,32,64] -> Transpose(0,2,1,3) -> Slice(axis 1, 0:-1)  =>  Slice(axis 2) -> [2,4,31,64] -> Transpose."""
    proto = cases.slice_transpose()
    model, _ = optimize(proto)
    transpose = named(model, "transpose")
    moved = producer_of(transpose.inputs[0])
    assert moved.op_type == "Slice" and moved.inputs[3].const_value.numpy().tolist() == [2]
    assert dims_of(moved.outputs[0]) == [2, 4, 31, 64]
    assert transpose.attributes.get_ints("perm") == (0, 2, 1, 3)
    assert_equivalent(proto, model)


def test_slice_stays_when_it_has_several_axes():
    assert_unchanged(cases.slice_transpose(axes=(0, 1)))


def test_scalar_gather_drops_axis_from_perm_when_crossing_transpose():
    """Transpose(0,2,1,3) -> Gather(axis 1, 5): the copy gathers input axis 2 and perm becomes (0,1,2)."""
    nodes = [
        node("Transpose", ["x"], "t", "transpose", perm=[0, 2, 1, 3]),
        node("Gather", ["t", "i"], "g", "g1", axis=1),
        node("Identity", ["g"], "y", "identity"),
    ]
    proto = build(nodes, {"x": (F, [2, 3, 8, 4])}, {"y": F}, {"i": np.array(5, np.int64)})
    model, _ = optimize(proto)
    transpose = named(model, "transpose")
    assert transpose.attributes.get_ints("perm") == (0, 1, 2)
    assert producer_of(transpose.inputs[0]).attributes.get_int("axis") == 2
    assert_equivalent(proto, model)


# --- where ORT is unsound ---------------------------------------------------------------------------------


def test_lower_rank_input_is_sliced_at_its_own_axis_when_broadcast():
    """Add(x[M,N,K], y[N,K]) -> Gather(axis 1, [0, 2]): y is sliced on its axis 0 (ORT slices axis 1)."""
    nodes = [
        node("Add", ["x", "y"], "s", "add"),
        node("Gather", ["s", "i"], "g", "g1", axis=1),
        node("Identity", ["g"], "out", "identity"),
    ]
    proto = build(nodes, {"x": (F, ["m", 5, 6]), "y": (F, [5, 6])}, {"out": F}, {"i": np.array([0, 2], np.int64)})
    model, _ = optimize(proto)
    x_gather, y_gather = (producer_of(v) for v in named(model, "add").inputs)
    assert (x_gather.inputs[0].name, x_gather.attributes.get_int("axis")) == ("x", 1)
    assert (y_gather.inputs[0].name, y_gather.attributes.get_int("axis")) == ("y", 0)
    assert_equivalent(proto, model)


def test_reshape_stops_slice_when_dims_before_axis_change():
    """[4,3,8] -> [2,3,16] keeps dim 1 = 3, but rows mix across it: ORT moves the Gather, we must not."""
    nodes = [
        node("Reshape", ["x", "shape"], "r", "reshape"),
        node("Gather", ["r", "i"], "g", "g1", axis=1),
        node("Identity", ["g"], "y", "identity"),
    ]
    inits = {"shape": np.array([2, 3, 16], np.int64), "i": np.array([1], np.int64)}
    result = assert_unchanged(build(nodes, {"x": (F, [4, 3, 8])}, {"y": F}, inits))
    assert "does not keep axis 1" in result.non_matches[0].reason


def test_reshape_stops_slice_when_allowzero_makes_a_zero_entry_literal():
    """[3,0,4] -> Reshape([3,4,0], allowzero=1) -> Gather(axis 0, 1): the 0 is an empty dim, not a copy.

    ORT keeps 0 entries as copies without looking at allowzero; here the new shape would need a literal
    0 where the input dim is 4, which only allowzero=1 can say, so the slice stops.
    """
    nodes = [
        node("Reshape", ["x", "shape"], "r", "reshape", allowzero=1),
        node("Gather", ["r", "i"], "g", "g1", axis=0),
        node("Identity", ["g"], "y", "identity"),
    ]
    inits = {"shape": np.array([3, 4, 0], np.int64), "i": np.array(1, np.int64)}
    result = assert_unchanged(build(nodes, {"x": (F, [3, 0, 4])}, {"y": F}, inits))
    assert "literal 0" in result.non_matches[0].reason


def test_reshape_moves_slice_when_allowzero_is_set_without_zero_entries():
    """The torch exporter sets allowzero=1 on every Reshape; without a 0 entry it changes nothing."""
    nodes = [
        node("Reshape", ["x", "shape"], "r", "reshape", allowzero=1),
        node("Gather", ["r", "i"], "g", "g1", axis=0),
        node("Identity", ["g"], "y", "identity"),
    ]
    inits = {"shape": np.array([4, 3, 8], np.int64), "i": np.array(1, np.int64)}
    proto = build(nodes, {"x": (F, [4, 24])}, {"y": F}, inits)
    model, _ = optimize(proto)
    reshape = named(model, "reshape")
    assert reshape.inputs[1].const_value.numpy().tolist() == [3, 8]
    assert reshape.attributes.get_int("allowzero") == 1
    assert_equivalent(proto, model)


def test_reshape_gets_a_constant_shape_when_its_shape_is_computed():
    """Reshape(x[B,S,32], Concat(Shape(x)[0:2], [4, 8]), allowzero=1), then Gather(axis 1, 0): the shape
    the exporter computes at run time becomes the constant [0, 4, 8] (0 = copy B), with allowzero=0."""
    nodes = [
        node("Shape", ["x"], "x_shape", "shape"),
        node("Slice", ["x_shape", "zero", "two"], "lead", "lead"),
        node("Concat", ["lead", "heads"], "target", "concat", axis=0),
        node("Reshape", ["x", "target"], "r", "reshape", allowzero=1),
        node("Gather", ["r", "i"], "g", "g1", axis=1),
        node("Identity", ["g"], "y", "identity"),
    ]
    inits = {
        "zero": np.array([0], np.int64),
        "two": np.array([2], np.int64),
        "heads": np.array([4, 8], np.int64),
        "i": np.array(0, np.int64),
    }
    proto = build(nodes, {"x": (F, ["batch", "seq", 32])}, {"y": F}, inits)
    model, _ = optimize(proto)
    reshape = named(model, "reshape")
    assert producer_of(reshape.inputs[0]).op_type == "Gather"
    assert reshape.inputs[1].const_value.numpy().tolist() == [0, 4, 8]
    assert reshape.attributes.get_int("allowzero") == 0
    assert_equivalent(proto, model)


def test_slice_stops_when_producer_output_is_also_a_graph_output():
    """Relu's output r is a graph output: slicing above Relu would change r's shape."""
    nodes = [
        node("Relu", ["x"], "r", "relu"),
        node("Gather", ["r", "i"], "g", "g1", axis=1),
        node("Identity", ["g"], "y", "identity"),
    ]
    proto = build(nodes, {"x": (F, [2, 8, 4])}, {"y": F, "r": F}, {"i": np.array(0, np.int64)})
    result = assert_unchanged(proto)
    assert result.non_matches[0].reason == "Gather 'g1' stops at 'relu' (its output 'r' is a graph output)"


def test_scalar_slice_adds_one_squeeze_for_all_consumers_when_an_input_broadcasts_on_the_axis():
    """Add(x[B,S,H], m[B,1,H]) -> Gather(axis 1, 2) -> {Tanh, Relu}: one Squeeze after Add feeds both."""
    nodes = [
        node("Add", ["x", "m"], "s", "add"),
        node("Gather", ["s", "i"], "g", "g1", axis=1),
        node("Tanh", ["g"], "y1", "tanh"),
        node("Relu", ["g"], "y2", "relu"),
    ]
    inputs = {"x": (F, ["b", 6, 4]), "m": (F, ["b", 1, 4])}
    proto = build(nodes, inputs, {"y1": F, "y2": F}, {"i": np.array(2, np.int64)})
    model, result = optimize(proto)
    (squeeze,) = ops_of(model, "Squeeze")
    assert producer_of(squeeze.inputs[0]).name == "add"
    assert named(model, "tanh").inputs[0] is squeeze.outputs[0] is named(model, "relu").inputs[0]
    add = named(model, "add")
    assert producer_of(add.inputs[0]).op_type == "Unsqueeze" and add.inputs[1].name == "m"
    assert result.counts["squeezes_added"] == 1
    assert_equivalent(proto, model)
