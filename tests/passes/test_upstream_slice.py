"""Tests of passes/compute_order/upstream_slice.py on ORT's compute-optimizer cases (rebuilt in
``_ort_cases.py``) and on the cases where ORT's rules are unsound.

Each test asserts where the slice ended up (by node, op and inputs) and that the optimized model computes
the same outputs as the original under ORT with graph optimizations off, on several random inputs, at
other sizes of the symbolic dims too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx_ir.passes.common import CommonSubexpressionEliminationPass

from passes._infra import PassResult
from passes.compute_order.upstream_slice import UpstreamSlice
from tests.numerics import assert_equivalent, to_proto
from tests.passes import _ort_cases as cases
from tests.passes._ort_cases import BOOL, I64, F, build, node, weights

TOL = {"rtol": 1e-4, "atol": 1e-4}
MODELS = Path(__file__).resolve().parents[1] / "models"


def _optimize(proto: onnx.ModelProto) -> tuple[ir.Model, PassResult]:
    model = ir.serde.deserialize_model(proto)  # a fresh IR copy: the pass is in place
    result = UpstreamSlice()(model)
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    unread = [name for name, v in model.graph.initializers.items() if not list(v.uses())]
    assert not unread, f"initializers left behind: {unread}"  # our shapes agree with ONNX's
    return model, result


def _node(model: ir.Model, name: str) -> ir.Node:
    (found,) = [n for n in model.graph if n.name == name]
    return found


def _ops(model: ir.Model, op: str) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == op]


def _producer(value: ir.Value | None) -> ir.Node:
    assert value is not None and value.producer() is not None
    return value.producer()


def _shape(value: ir.Value) -> list:
    return [d if isinstance(d, int) else d.value for d in value.shape]


def _assert_same(original: onnx.ModelProto, optimized: ir.Model, feeds: Sequence[Mapping[str, np.ndarray]]) -> None:
    """Explicit feeds, for inputs whose values must stay in range (GatherND positions)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sessions = [
        ort.InferenceSession(to_proto(m).SerializeToString(), options, providers=["CPUExecutionProvider"])
        for m in (original, optimized)
    ]
    for feed in feeds:
        expected, got = (s.run(None, dict(feed)) for s in sessions)
        for e, g in zip(expected, got, strict=True):
            assert e.shape == g.shape
            np.testing.assert_allclose(g, e, **TOL)


def _unchanged(proto: onnx.ModelProto) -> PassResult:
    model, result = _optimize(proto)
    assert not result.modified
    assert [n.op_type for n in model.graph] == [n.op_type for n in proto.graph.node]
    return result


# --- GatherND ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["Gelu", "Add", "LayerNormalization", "MatMul"])
def test_gathernd_moves_onto_graph_input_when_op_is_allowed(op):
    """op(input) -> GatherND -> Identity  =>  GatherND(input) -> op -> Identity (ORT's GatherND_<op>)."""
    proto = cases.gathernd(op)
    model, result = _optimize(proto)
    (gathernd,) = _ops(model, "GatherND")
    assert gathernd.inputs[0].name == "input" and gathernd.inputs[1].name == "positions"
    moved_op = _ops(model, op)[0]
    assert _producer(moved_op.inputs[0]) is gathernd
    assert _producer(_node(model, "identity").inputs[0]) is moved_op
    assert result.counts == {"slices_moved": 1, "ops_crossed": 1, "squeezes_added": 0, "copies_merged": 0}
    rng = np.random.default_rng(0)
    feeds = [
        {"input": rng.standard_normal((b, s, 32)).astype(np.float32), "positions": rng.integers(0, s, (b, 3, 1))}
        for b, s in ((2, 7), (1, 5), (4, 3))
    ]
    _assert_same(proto, model, feeds)


def test_gathernd_stays_when_its_output_is_a_graph_output():
    """Like ORT's GatherND_Add second GatherND: a slice producing a graph output is never moved."""
    nodes = [
        node("Add", ["input", "bias"], "sum", "add"),
        node("GatherND", ["sum", "pos"], "output", "g", batch_dims=1),
    ]
    proto = build(nodes, {"input": (F, [2, 8, 4]), "pos": (I64, [2, 3, 1])}, {"output": F}, {"bias": weights(4)})
    result = _unchanged(proto)
    assert "graph output" in result.non_matches[0].reason


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
    model, result = _optimize(proto)
    m1 = _node(model, "m1")
    for i, name in enumerate(("input1", "input2")):
        value = m1.inputs[i]
        if i not in expected:
            assert value.name == name
            continue
        if scalar:  # the scalar slice goes through Unsqueeze so MatMul keeps its rank
            unsqueeze = _producer(value)
            assert unsqueeze.op_type == "Unsqueeze"
            value = unsqueeze.inputs[0]
        gather = _producer(value)
        assert gather.op_type == "Gather" and gather.inputs[0].name == name
        assert gather.attributes.get_int("axis") == expected[i]
    identity_in = _producer(_node(model, "identity").inputs[0])
    assert identity_in.op_type == ("Squeeze" if scalar else "MatMul")
    assert result.counts["squeezes_added"] == int(scalar)
    assert_equivalent(proto, model, **TOL)


# --- GatherLayerNormalization / GatherSoftmax ------------------------------------------------------------


@pytest.mark.parametrize("scalar", [True, False], ids=["scalar", "non-scalar"])
@pytest.mark.parametrize("ln_axis", [2, -1])
def test_gather_layer_norm_moves_when_ln_axis_is_after_slice_axis(ln_axis, scalar):
    """[2,32,64] -> LN(axis) -> Gather(axis 1): moves; a scalar slice turns LN axis into 1, output [2,64]."""
    proto = cases.gather_layer_norm(ln_axis, scalar)
    model, _ = _optimize(proto)
    ln = _node(model, "ln")
    assert _producer(ln.inputs[0]).op_type == "Gather" and _producer(ln.inputs[0]).inputs[0].name == "input"
    assert ln.attributes.get_int("axis") == (1 if scalar else ln_axis)
    assert _shape(ln.outputs[0]) == ([2, 64] if scalar else [2, 1, 64])
    assert_equivalent(proto, model, **TOL)


@pytest.mark.parametrize("ln_axis", [0, 1, -3, -2])
def test_gather_layer_norm_stays_when_ln_axis_is_not_after_slice_axis(ln_axis):
    result = _unchanged(cases.gather_layer_norm(ln_axis, scalar=True))
    normalized = ln_axis % 3
    assert result.non_matches[0].reason == (
        f"Gather 'g1' stops at 'ln' (LayerNormalization axis {normalized} <= slice axis 1)"
    )


@pytest.mark.parametrize("scalar", [True, False], ids=["scalar", "non-scalar"])
@pytest.mark.parametrize(("softmax_axis", "scalar_axis"), [(2, 1), (3, 2), (-2, 1), (-1, 2)])
def test_gather_softmax_moves_when_softmax_axis_is_after_slice_axis(softmax_axis, scalar_axis, scalar):
    proto = cases.gather_softmax(softmax_axis, scalar)
    model, _ = _optimize(proto)
    softmax = _node(model, "softmax")
    assert _producer(softmax.inputs[0]).op_type == "Gather"
    assert softmax.attributes.get_int("axis") == (scalar_axis if scalar else softmax_axis)
    assert_equivalent(proto, model, **TOL)


@pytest.mark.parametrize("softmax_axis", [0, 1, -4, -3])
def test_gather_softmax_stays_when_softmax_axis_is_not_after_slice_axis(softmax_axis):
    _unchanged(cases.gather_softmax(softmax_axis, scalar=False))


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
    model, _ = _optimize(proto)
    reshape = _node(model, "reshape")
    assert _producer(reshape.inputs[0]).op_type == "Gather"
    assert reshape.inputs[1].const_value.numpy().tolist() == new_shape
    sizes = [{"input": (2, 16, 1024)}, {"input": (3, 16, 1024)}, {"input": (1, 16, 1024)}]
    assert_equivalent(proto, model, shapes=sizes, n_random=0, **TOL)  # batch >= 1: index 0 exists


def test_gather_reshape_rewrites_the_seq_entry_when_shape_names_it():
    """ORT's SeqlenDim2: S=128, shape [0,128,4,64], 31 indices on axis 1 -> shape [0,31,4,64]."""
    indices = np.arange(0, 124, 4, dtype=np.int64)  # 31 indices
    proto = cases.gather_reshape(1, indices, [0, 128, 4, 64], seq=128)
    model, _ = _optimize(proto)
    reshape = _node(model, "reshape")
    assert reshape.inputs[1].const_value.numpy().tolist() == [0, 31, 4, 64]
    assert _shape(_producer(reshape.inputs[0]).outputs[0]) == ["batch", 31, 256]
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
    assert _shape(_node(model, f"{last}/ln2").outputs[0]) == ["batch", 32]
    assert _shape(_node(model, f"{last}/gelu").outputs[0]) == ["batch", 64]
    qk = _node(model, f"{last}/qk")
    assert _producer(qk.inputs[0]).op_type == "Unsqueeze"
    assert qk.inputs[1].name == f"{last}/k_t.out"
    assert _shape(_node(model, f"{last}/k_t").outputs[0]) == ["batch", 4, 8, "seq"]  # keys stay full
    masked = _node(model, f"{last}/masked")
    (squeeze,) = [u.node for u in masked.outputs[0].uses()]
    assert squeeze.op_type == "Squeeze"
    gathers = _ops(model, "Gather")
    assert gathers and all(g.inputs[0].name == "layer0/ln2.out" for g in gathers)
    assert len(gathers) == 1  # CSE merged the copies of the query path and the residual
    assert_equivalent(proto, model, shapes=[{"embeddings": (2, 5, 32), "mask": (2, 1, 1, 5)}], **TOL)


# --- ShrunkenGather, Slice, SliceTranspose --------------------------------------------------------------


def test_shrinking_gather_moves_on_both_branches_when_indices_come_from_nonzero():
    """Add(int64 [4,32,64] x 2) -> Gather(axis 1, Squeeze(NonZero(keep))): one Gather per Add input."""
    proto = cases.shrunken_gather_two_branches()
    model, result = _optimize(proto)
    add = _node(model, "add")
    gathers = [_producer(v) for v in add.inputs]
    assert [g.op_type for g in gathers] == ["Gather", "Gather"]
    assert [g.inputs[0].name for g in gathers] == ["a", "b"]
    assert gathers[0].inputs[1] is gathers[1].inputs[1] and gathers[0].inputs[1].name == "idx"
    assert result.counts == {"slices_moved": 1, "ops_crossed": 1, "squeezes_added": 0, "copies_merged": 0}
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
    model, result = _optimize(proto)
    producers = [_producer(v).op_type if v.producer() else None for v in _node(model, "add").inputs]
    assert producers == (["Slice", "Slice"] if moves else [None, None])
    assert result.modified == moves
    assert_equivalent(proto, model)


def test_slice_moves_above_transpose_when_axis_maps_through_perm():
    """[2,4,32,64] -> Transpose(0,2,1,3) -> Slice(axis 1, 0:-1)  =>  Slice(axis 2) -> [2,4,31,64] -> Transpose."""
    proto = cases.slice_transpose()
    model, _ = _optimize(proto)
    transpose = _node(model, "transpose")
    moved = _producer(transpose.inputs[0])
    assert moved.op_type == "Slice" and moved.inputs[3].const_value.numpy().tolist() == [2]
    assert _shape(moved.outputs[0]) == [2, 4, 31, 64]
    assert transpose.attributes.get_ints("perm") == (0, 2, 1, 3)
    assert_equivalent(proto, model)


def test_slice_stays_when_it_has_several_axes():
    _unchanged(cases.slice_transpose(axes=(0, 1)))


def test_scalar_gather_drops_axis_from_perm_when_crossing_transpose():
    """Transpose(0,2,1,3) -> Gather(axis 1, 5): the copy gathers input axis 2 and perm becomes (0,1,2)."""
    nodes = [
        node("Transpose", ["x"], "t", "transpose", perm=[0, 2, 1, 3]),
        node("Gather", ["t", "i"], "g", "g1", axis=1),
        node("Identity", ["g"], "y", "identity"),
    ]
    proto = build(nodes, {"x": (F, [2, 3, 8, 4])}, {"y": F}, {"i": np.array(5, np.int64)})
    model, _ = _optimize(proto)
    transpose = _node(model, "transpose")
    assert transpose.attributes.get_ints("perm") == (0, 1, 2)
    assert _producer(transpose.inputs[0]).attributes.get_int("axis") == 2
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
    model, _ = _optimize(proto)
    x_gather, y_gather = (_producer(v) for v in _node(model, "add").inputs)
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
    result = _unchanged(build(nodes, {"x": (F, [4, 3, 8])}, {"y": F}, inits))
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
    result = _unchanged(build(nodes, {"x": (F, [3, 0, 4])}, {"y": F}, inits))
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
    model, _ = _optimize(proto)
    reshape = _node(model, "reshape")
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
    model, _ = _optimize(proto)
    reshape = _node(model, "reshape")
    assert _producer(reshape.inputs[0]).op_type == "Gather"
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
    result = _unchanged(proto)
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
    model, result = _optimize(proto)
    (squeeze,) = _ops(model, "Squeeze")
    assert _producer(squeeze.inputs[0]).name == "add"
    assert _node(model, "tanh").inputs[0] is squeeze.outputs[0] is _node(model, "relu").inputs[0]
    add = _node(model, "add")
    assert _producer(add.inputs[0]).op_type == "Unsqueeze" and add.inputs[1].name == "m"
    assert result.counts["squeezes_added"] == 1
    assert_equivalent(proto, model)


# --- driver ---------------------------------------------------------------------------------------------


def test_branch_continues_when_another_branch_reaches_a_graph_input():
    """Add(x, Relu(Tanh(y))) -> Gather: x's branch ends at the input, y's goes on through Relu and Tanh."""
    nodes = [
        node("Tanh", ["y"], "t", "tanh"),
        node("Relu", ["t"], "r", "relu"),
        node("Add", ["x", "r"], "s", "add"),
        node("Gather", ["s", "i"], "g", "g1", axis=1),
        node("Identity", ["g"], "out", "identity"),
    ]
    proto = build(nodes, {"x": (F, [2, 8, 4]), "y": (F, [2, 8, 4])}, {"out": F}, {"i": np.array([3], np.int64)})
    model, result = _optimize(proto)
    assert _producer(_node(model, "tanh").inputs[0]).inputs[0].name == "y"
    assert _producer(_node(model, "add").inputs[0]).inputs[0].name == "x"
    assert result.counts == {"slices_moved": 1, "ops_crossed": 3, "squeezes_added": 0, "copies_merged": 0}
    reasons = sorted(m.reason for m in result.non_matches)
    assert reasons == ["Gather 'g1@add_in0' stops at graph input 'x'", "Gather 'g1@tanh_in0' stops at graph input 'y'"]
    assert_equivalent(proto, model)


def test_slice_stops_when_producer_has_two_consumers():
    nodes = [
        node("Relu", ["x"], "r", "relu"),
        node("Gather", ["r", "i"], "g", "g1", axis=1),
        node("Identity", ["g"], "y", "identity"),
        node("Sigmoid", ["r"], "z", "sigmoid"),
    ]
    proto = build(nodes, {"x": (F, [2, 8, 4])}, {"y": F, "z": F}, {"i": np.array(0, np.int64)})
    result = _unchanged(proto)
    assert result.non_matches[0].reason == "Gather 'g1' stops at 'relu' (2 consumers)"


def test_gather_moves_through_element_wise_chain_when_ops_are_beyond_orts_list():
    """Sub, Mul, Tanh, Sigmoid, Erf, ONNX Gelu: all element-wise, all crossed."""
    nodes = [
        node("Sub", ["x", "c"], "a", "sub"),
        node("Mul", ["a", "c"], "b", "mul"),
        node("Tanh", ["b"], "t", "tanh"),
        node("Sigmoid", ["t"], "s", "sigmoid"),
        node("Erf", ["s"], "e", "erf"),
        node("Gelu", ["e"], "ge", "gelu"),
        node("Gather", ["ge", "i"], "g", "g1", axis=0),
        node("Identity", ["g"], "y", "identity"),
    ]
    proto = build(nodes, {"x": (F, [6, "n"])}, {"y": F}, {"c": weights(1), "i": np.array([4], np.int64)}, opset=20)
    model, result = _optimize(proto)
    assert result.counts["ops_crossed"] == 6
    assert _producer(_node(model, "sub").inputs[0]).op_type == "Gather"
    assert _node(model, "sub").inputs[1].name == "c"  # a [1] constant broadcasts: not sliced
    assert_equivalent(proto, model)


@pytest.mark.parametrize(("axis", "trans_b"), [(0, 0), (1, 0), (1, 1)])
def test_gather_moves_above_gemm_when_axis_is_m_or_n(axis, trans_b):
    """Gemm(A[6,4], B, C[5]) -> Gather(axis, [1, 3]): M slices A; N slices B (by transB) and C."""
    b_shape = [5, 4] if trans_b else [4, 5]
    nodes = [
        node("Gemm", ["a", "b", "c"], "o", "gemm", transB=trans_b),
        node("Gather", ["o", "i"], "g", "g1", axis=axis),
        node("Identity", ["g"], "y", "identity"),
    ]
    inputs = {"a": (F, [6, 4]), "b": (F, b_shape), "c": (F, [5])}
    proto = build(nodes, inputs, {"y": F}, {"i": np.array([1, 3], np.int64)})
    model, _ = _optimize(proto)
    gemm = _node(model, "gemm")
    sliced = {i: _producer(v).attributes.get_int("axis") for i, v in enumerate(gemm.inputs) if v.producer()}
    assert sliced == ({0: 0} if axis == 0 else {1: 0 if trans_b else 1, 2: 0})
    assert_equivalent(proto, model)


def test_gather_stays_when_indices_are_not_fewer_than_the_axis():
    """Gather of 8 indices from an axis of 8 shrinks nothing: not an entry."""
    nodes = [node("Relu", ["x"], "r", "relu"), node("Gather", ["r", "i"], "g", "g1", axis=1)]
    nodes.append(node("Identity", ["g"], "y", "identity"))
    result = _unchanged(build(nodes, {"x": (F, [2, 8])}, {"y": F}, {"i": np.arange(8, dtype=np.int64)}))
    assert "not known to be fewer" in result.non_matches[0].reason


def test_shape_inference_runs_first_when_values_lack_shapes():
    proto = cases.gather_layer_norm(-1, scalar=True)
    del proto.graph.value_info[:]
    model, result = _optimize(proto)
    assert result.modified and "shape_inference" in result.notes
    assert_equivalent(proto, model, **TOL)


def test_bool_inputs_are_sliced_when_where_selects():
    """Where(cond[B,S], x[B,S], y[S]) -> Gather(axis 1, [2]): cond and x sliced on axis 1, y on axis 0."""
    nodes = [
        node("Where", ["cond", "x", "y"], "w", "where"),
        node("Gather", ["w", "i"], "g", "g1", axis=1),
        node("Identity", ["g"], "out", "identity"),
    ]
    inputs = {"cond": (BOOL, ["b", 5]), "x": (F, ["b", 5]), "y": (F, [5])}
    proto = build(nodes, inputs, {"out": F}, {"i": np.array([2], np.int64)})
    model, _ = _optimize(proto)
    axes = [_producer(v).attributes.get_int("axis") for v in _node(model, "where").inputs]
    assert axes == [1, 1, 0]
    assert_equivalent(proto, model)


def test_scalar_gather_uses_axes_attributes_when_opset_is_below_13():
    """Opset 12: Unsqueeze/Squeeze take ``axes`` as an attribute, not an input."""
    nodes = [
        node("MatMul", ["x", "w"], "m", "m1"),
        node("Gather", ["m", "i"], "g", "g1", axis=1),
        node("Identity", ["g"], "y", "identity"),
    ]
    inits = {"w": weights(4, 3), "i": np.array(2, np.int64)}
    proto = build(nodes, {"x": (F, ["b", 5, 4])}, {"y": F}, inits, opset=12)
    model, _ = _optimize(proto)
    (unsqueeze,) = _ops(model, "Unsqueeze")
    (squeeze,) = _ops(model, "Squeeze")
    assert len(unsqueeze.inputs) == 1 and unsqueeze.attributes.get_ints("axes") == (1,)
    assert len(squeeze.inputs) == 1 and squeeze.attributes.get_ints("axes") == (1,)
    assert_equivalent(proto, model, **TOL)


def test_gather_moves_above_softmax_when_opset_11_coerces_at_a_later_axis():
    """Softmax-11 flattens [2,4,32,64] to 2-D at axis 2; slicing axis 1 before it commutes (axis -> 1)."""
    nodes = [
        node("Softmax", ["x"], "s", "softmax", axis=2),
        node("Gather", ["s", "i"], "g", "g1", axis=1),
        node("Identity", ["g"], "y", "identity"),
    ]
    proto = build(nodes, {"x": (F, [2, 4, 32, 64])}, {"y": F}, {"i": np.array(3, np.int64)}, opset=11)
    model, _ = _optimize(proto)
    assert _node(model, "softmax").attributes.get_int("axis") == 1
    assert_equivalent(proto, model, **TOL)


def test_slice_with_dynamic_bounds_moves_when_its_axis_is_constant():
    """Slice(Relu(x), starts=s, ends=e, axes=[1]) with s, e graph inputs: the bounds travel with the copy."""
    nodes = [
        node("Relu", ["x"], "r", "relu"),
        node("Slice", ["r", "s", "e", "axes"], "out", "slice"),
        node("Identity", ["out"], "y", "identity"),
    ]
    inputs = {"x": (F, [2, 9, 4]), "s": (I64, [1]), "e": (I64, [1])}
    proto = build(nodes, inputs, {"y": F}, {"axes": np.array([1], np.int64)})
    model, _ = _optimize(proto)
    moved = _producer(_node(model, "relu").inputs[0])
    assert moved.op_type == "Slice" and [v.name for v in moved.inputs[:3]] == ["x", "s", "e"]
    assert_equivalent(proto, model)


def test_dropout_moves_with_its_unused_mask_when_gather_follows():
    """Dropout (inference) -> Gather: the mask output changes like the data output."""
    nodes = [
        helper_node := node("Dropout", ["x"], "d", "dropout"),
        node("Gather", ["d", "i"], "g", "g1", axis=1),
        node("Identity", ["g"], "y", "identity"),
    ]
    helper_node.output.append("mask")
    proto = build(nodes, {"x": (F, [2, 6, 4])}, {"y": F}, {"i": np.array([1, 4], np.int64)})
    model, _ = _optimize(proto)
    dropout = _node(model, "dropout")
    assert _producer(dropout.inputs[0]).op_type == "Gather"
    assert [_shape(o) for o in dropout.outputs] == [[2, 2, 4], [2, 2, 4]]
    assert_equivalent(proto, model)


def test_roberta_optimized_model_is_right_when_ort_runs_at_its_default_level():
    """Users run ORT_ENABLE_ALL, which fuses MatMul/Add/LayerNorm: the moved slices must survive that."""
    proto = cases.roberta_classifier()
    model = ir.serde.deserialize_model(proto)
    UpstreamSlice()(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    rng = np.random.default_rng(3)
    feeds = {
        "embeddings": rng.standard_normal((3, 6, 32)).astype(np.float32),
        "mask": np.zeros((3, 1, 1, 6), np.float32),
    }
    reference = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    optimized = ort.InferenceSession(to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(optimized.run(None, feeds)[0], reference.run(None, feeds)[0], **TOL)


# --- random graphs ------------------------------------------------------------------------------------


def _random_case(rng: np.random.Generator) -> onnx.ModelProto | None:
    """x -> 1..3 random ops (broadcast Add/Mul/Where, Transpose, Reshape, Softmax, LN, MatMul) -> slice."""
    shape = [int(d) for d in rng.integers(1, 5, int(rng.integers(2, 5)))]
    inputs: dict[str, tuple[int, list[int]]] = {"x": (F, shape)}
    inits: dict[str, np.ndarray] = {}
    nodes, cur = [], "x"
    for k in range(int(rng.integers(1, 4))):
        r, out, op = (
            len(shape),
            f"v{k}",
            str(rng.choice(["Add", "Mul", "Where", "Transpose", "Reshape", "Softmax", "LN", "MatMul"])),
        )
        other = [d if rng.random() < 0.7 else 1 for d in shape[r - int(rng.integers(0, r + 1)) :]]  # broadcasts
        if op in ("Add", "Mul"):
            inputs[f"o{k}"] = (F, other)
            nodes.append(node(op, [cur, f"o{k}"] if rng.random() < 0.5 else [f"o{k}", cur], out, f"n{k}"))
        elif op == "Where":
            inputs[f"c{k}"] = (BOOL, other)
            nodes.append(node("Where", [f"c{k}", cur, cur], out, f"n{k}"))
        elif op == "Transpose":
            perm = [int(p) for p in rng.permutation(r)]
            nodes.append(node("Transpose", [cur], out, f"n{k}", perm=perm))
            shape = [shape[p] for p in perm]
        elif op == "Reshape":  # merge two neighbours or split one dim; entries 0 and -1 at random
            j = int(rng.integers(0, r))
            if r >= 2 and j < r - 1 and rng.random() < 0.5:
                new = [*shape[:j], shape[j] * shape[j + 1], *shape[j + 2 :]]
            else:
                a = int(rng.choice([f for f in range(1, shape[j] + 1) if shape[j] % f == 0]))
                new = [*shape[:j], a, shape[j] // a, *shape[j + 1 :]]
            const = [0 if i < r and shape[i] == d and rng.random() < 0.3 else d for i, d in enumerate(new)]
            if rng.random() < 0.3:
                const[int(rng.integers(0, len(new)))] = -1
            inits[f"s{k}"] = np.array(const, np.int64)
            nodes.append(node("Reshape", [cur, f"s{k}"], out, f"n{k}"))
            shape = new
        elif op in ("Softmax", "LN"):
            axis = int(rng.integers(-r, r))
            if op == "Softmax":
                nodes.append(node("Softmax", [cur], out, f"n{k}", axis=axis))
            else:
                inits[f"g{k}"] = weights(*shape[axis % r :], seed=k)
                nodes.append(node("LayerNormalization", [cur, f"g{k}"], out, f"n{k}", axis=axis))
        else:
            n = int(rng.integers(1, 4))
            batch = [d if rng.random() < 0.7 else 1 for d in shape[: r - 2]][int(rng.integers(0, r - 1)) :]
            inputs[f"b{k}"] = (F, [*batch, shape[-1], n])
            nodes.append(node("MatMul", [cur, f"b{k}"], out, f"n{k}"))
            shape = [*shape[:-1], n]
        cur = out
    r = len(shape)
    axis = int(rng.integers(0, r))
    kind = rng.choice(["scalar", "indices", "slice"])
    if kind == "scalar":
        inits["i"] = np.array(int(rng.integers(0, shape[axis])), np.int64)
        nodes.append(node("Gather", [cur, "i"], "g", "slice", axis=axis - r * int(rng.random() < 0.5)))
    elif kind == "indices":
        count = int(rng.integers(1, max(shape[axis], 2)))
        inits["i"] = rng.integers(-shape[axis], shape[axis], count).astype(np.int64)
        nodes.append(node("Gather", [cur, "i"], "g", "slice", axis=axis))
    else:
        for name, value in (
            ("st", rng.integers(-3, 3)),
            ("en", rng.integers(-3, 5)),
            ("ax", axis),
            ("sp", rng.choice([1, 2, -1])),
        ):
            inits[name] = np.array([int(value)], np.int64)
        nodes.append(node("Slice", [cur, "st", "en", "ax", "sp"], "g", "slice"))
    nodes.append(node("Identity", ["g"], "y", "identity"))
    try:
        return build(nodes, inputs, {"y": F}, inits)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError):
        return None  # e.g. a Reshape whose -1 meets an empty dim: not a valid model to start from


def test_upstream_slice_is_exact_when_graphs_are_random():
    """150 random op chains ending in a random slice: every rewrite keeps the outputs (2,000 seeds ran clean)."""
    moved = 0
    for seed in range(150):
        proto = _random_case(np.random.default_rng(seed))
        if proto is None:
            continue
        model, result = _optimize(proto)
        moved += result.modified
        try:
            assert_equivalent(proto, model, n_random=2, **TOL)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from exc
    assert moved > 100


def test_hf_roberta_cls_gather_moves_into_the_last_layer_when_exported_by_torch():
    """The torch-exported HF RoBERTa classifier (tests/models): decomposed erf-Gelu, allowzero=1 Reshapes
    with computed shapes. With CSE between runs the cls Gather ends on layer 0's output and the mask."""
    path = MODELS / "hf_roberta_cls.onnx"
    if not path.exists():
        pytest.skip("tests/models/hf_roberta_cls.onnx not built")
    proto = onnx.load(str(path))
    model = ir.serde.deserialize_model(proto)
    for _ in range(6):
        moved = UpstreamSlice()(model).modified
        if not (CommonSubexpressionEliminationPass()(model).modified or moved):
            break
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    moved_gathers = [g for g in _ops(model, "Gather") if g.name.startswith("node_select")]
    assert sorted(g.inputs[0].name for g in moved_gathers) == ["layer_norm_2", "where"]
    assert_equivalent(proto, model, **TOL)


def _two_branches(second_index: int, extra_reader: bool = False) -> onnx.ModelProto:
    """x -> Relu = r; Add(Tanh(r), Sigmoid(r)) -> Gather(axis 1, [0, 2]); optionally Neg(r) as an output."""
    nodes = [
        node("Relu", ["x"], "r", "relu"),
        node("Tanh", ["r"], "t", "tanh"),
        node("Sigmoid", ["r"], "s", "sigmoid"),
        node("Add", ["t", "s"], "a", "add"),
        node("Gather", ["a", "i"], "g", "g1", axis=1),
        node("Identity", ["g"], "y", "identity"),
    ]
    outputs = {"y": F}
    inits = {"i": np.array([0, 2], np.int64)}
    if second_index >= 0:  # a second slice of r, with its own (maybe equal) indices constant
        nodes += [node("Gather", ["r", "j"], "g2", "g2", axis=1), node("Identity", ["g2"], "y2", "identity2")]
        outputs["y2"] = F
        inits["j"] = np.array([0, second_index], np.int64)
    if extra_reader:
        nodes.append(node("Neg", ["r"], "z", "neg"))
        outputs["z"] = F
    return build(nodes, {"x": (F, ["batch", 6, 4])}, outputs, inits)


def test_slice_copies_merge_and_move_on_when_every_reader_of_a_value_is_the_same_slice():
    """Both branches of r bring a copy of the Gather, and another Gather with equal indices reads r too:
    all three merge into one, which moves above Relu onto the graph input."""
    proto = _two_branches(second_index=2)
    model, result = _optimize(proto)
    assert result.counts == {"slices_moved": 1, "ops_crossed": 4, "squeezes_added": 0, "copies_merged": 2}
    (gather,) = _ops(model, "Gather")
    assert gather.inputs[0].name == "x"
    assert _shape(_node(model, "relu").outputs[0]) == ["batch", 2, 4]
    assert_equivalent(proto, model, **TOL)


@pytest.mark.parametrize(
    ("second_index", "extra_reader"),
    [pytest.param(3, False, id="other-indices"), pytest.param(-1, True, id="non-slice-reader")],
)
def test_slice_copies_stay_when_a_reader_of_the_value_differs(second_index, extra_reader):
    """A Gather with other indices, or a Neg, also reads r: the copies stop at Relu, unmerged."""
    proto = _two_branches(second_index, extra_reader)
    model, result = _optimize(proto)
    assert result.counts["copies_merged"] == 0
    assert any("stops at 'relu' (3 consumers)" in m.reason for m in result.non_matches)
    assert _node(model, "relu").inputs[0].name == "x"
    assert [g.inputs[0].name for g in _ops(model, "Gather")] == ["r"] * (3 if second_index >= 0 else 2)
    assert_equivalent(proto, model, **TOL)


def test_hf_roberta_cls_gather_reaches_the_last_layers_input_in_one_run_when_copies_merge():
    """Without CSE between runs: the copies that meet on shared values (GELU halves, the LayerNorm read by
    the FFN and the residual) merge, so one run of the pass gets as far as the CSE fixpoint."""
    path = MODELS / "hf_roberta_cls.onnx"
    if not path.exists():
        pytest.skip("tests/models/hf_roberta_cls.onnx not built")
    proto = onnx.load(str(path))
    model = ir.serde.deserialize_model(proto)
    result = UpstreamSlice()(model)
    assert result.counts["copies_merged"] >= 2
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    moved = [g for g in _ops(model, "Gather") if g.name.startswith("node_select")]
    assert sorted({g.inputs[0].name for g in moved}) == ["layer_norm_2", "where"]
    assert_equivalent(proto, model, **TOL)
