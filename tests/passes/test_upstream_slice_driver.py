"""Tests of upstream_slice's driver: slices that are graph outputs, shape inference first, opsets, ORT at its
default level, random graphs, the torch exports in tests/models, and the merging of copies that meet.

Each test asserts where the slice ended up and that the optimized model computes the same outputs as the
original under ORT with graph optimizations off, on several inputs, at other sizes of the symbolic dims too.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx_ir.passes.common import CommonSubexpressionEliminationPass

from passes.compute_order.upstream_slice import UpstreamSlice
from tests.models.build_hf import make_inputs
from tests.numerics import assert_equivalent, to_proto
from tests.passes import _ort_cases as cases
from tests.passes._ort_cases import BOOL, I64, F, build, node, weights
from tests.passes._slice_helpers import (
    MODELS,
    TOL,
    assert_unchanged,
    dims_of,
    named,
    ops_of,
    optimize,
    producer_of,
)
from tests.passes._util import HF_SHAPES, session

# --- driver ---------------------------------------------------------------------------------------------


def test_scalar_slice_hands_its_output_name_to_the_squeeze_when_its_output_is_a_graph_output():
    """Add(x[B,S,H], m[B,1,H]) -> Gather(axis 1, 2) = y, a graph output that Relu also reads: the Gather moves
    above Add (m broadcasts on the axis, so one Squeeze follows Add), the Squeeze takes the name y and Relu
    reads it."""
    nodes = [
        node("Add", ["x", "m"], "a", "add"),
        node("Gather", ["a", "i"], "y", "g1", axis=1),
        node("Relu", ["y"], "z", "relu"),
    ]
    inputs = {"x": (F, ["batch", 6, 4]), "m": (F, ["batch", 1, 4])}
    proto = build(nodes, inputs, {"y": F, "z": F}, {"i": np.array(2, np.int64)})
    model, result = optimize(proto)
    assert result.counts == {
        "slices_moved": 1,
        "ops_crossed": 1,
        "squeezes_added": 1,
        "copies_merged": 0,
        "conv_crops_folded": 0,
    }
    y, z = model.graph.outputs
    assert (y.name, z.name) == ("y", "z")
    assert producer_of(y).op_type == "Squeeze" and producer_of(producer_of(y).inputs[0]) is named(model, "add")
    assert named(model, "relu").inputs[0] is y
    assert dims_of(y) == ["batch", 4]
    assert_equivalent(proto, model, **TOL)


def _cls_pool_inputs(batch: int, seq: int, pad: float) -> dict[str, np.ndarray]:
    return make_inputs("bert_encoder", batch, seq, pad_fraction=pad, size="tiny")


@pytest.mark.parametrize("exporter", ["", "_legacy"], ids=["dynamo", "torchscript"])
def test_cls_pooling_output_moves_into_the_last_layer_when_exported_by_torch(exporter):
    """A sentence encoder exported with ``last_hidden_state[:, 0]`` as its graph output (tests/models/
    bert_cls_pool*.onnx): the CLS Gather moves into the last layer, past its FFN and LayerNorms, and the
    output keeps its name, type and shape; outputs match the export on padded batches of several shapes."""
    path = MODELS / f"bert_cls_pool{exporter}.onnx"
    proto = onnx.load(str(path))
    model, result = optimize(proto)
    assert result.modified and result.counts["slices_moved"] == 1 and result.counts["ops_crossed"] >= 10
    (out,) = model.graph.outputs
    assert out.name == "cls_embedding" and dims_of(out) == ["batch", 32]
    last_norm = [n for n in model.graph if n.op_type == "LayerNormalization"][-1]
    assert producer_of(out) is last_norm or producer_of(producer_of(out).inputs[0]) is last_norm
    assert all(isinstance(d, int) for d in last_norm.inputs[0].shape[1:])  # no sequence axis left: one token
    reference, candidate = session(str(path)), session(model)
    for batch, seq, pad in HF_SHAPES:
        feeds = _cls_pool_inputs(batch, seq, pad)
        (expected,), (got,) = reference.run(None, feeds), candidate.run(None, feeds)
        assert got.shape == expected.shape == (batch, 32)
        np.testing.assert_allclose(got, expected, err_msg=f"{batch}x{seq}", **TOL)


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
    model, result = optimize(proto)
    assert producer_of(named(model, "tanh").inputs[0]).inputs[0].name == "y"
    assert producer_of(named(model, "add").inputs[0]).inputs[0].name == "x"
    assert result.counts == {
        "slices_moved": 1,
        "ops_crossed": 3,
        "squeezes_added": 0,
        "copies_merged": 0,
        "conv_crops_folded": 0,
    }
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
    result = assert_unchanged(proto)
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
    model, result = optimize(proto)
    assert result.counts["ops_crossed"] == 6
    assert producer_of(named(model, "sub").inputs[0]).op_type == "Gather"
    assert named(model, "sub").inputs[1].name == "c"  # a [1] constant broadcasts: not sliced
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
    model, _ = optimize(proto)
    gemm = named(model, "gemm")
    sliced = {i: producer_of(v).attributes.get_int("axis") for i, v in enumerate(gemm.inputs) if v.producer()}
    assert sliced == ({0: 0} if axis == 0 else {1: 0 if trans_b else 1, 2: 0})
    assert_equivalent(proto, model)


def test_gather_stays_when_indices_are_not_fewer_than_the_axis():
    """Gather of 8 indices from an axis of 8 shrinks nothing: not an entry."""
    nodes = [node("Relu", ["x"], "r", "relu"), node("Gather", ["r", "i"], "g", "g1", axis=1)]
    nodes.append(node("Identity", ["g"], "y", "identity"))
    result = assert_unchanged(build(nodes, {"x": (F, [2, 8])}, {"y": F}, {"i": np.arange(8, dtype=np.int64)}))
    assert "not known to be fewer" in result.non_matches[0].reason


def test_shape_inference_runs_first_when_values_lack_shapes():
    proto = cases.gather_layer_norm(-1, scalar=True)
    del proto.graph.value_info[:]
    model, result = optimize(proto)
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
    model, _ = optimize(proto)
    axes = [producer_of(v).attributes.get_int("axis") for v in named(model, "where").inputs]
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
    model, _ = optimize(proto)
    (unsqueeze,) = ops_of(model, "Unsqueeze")
    (squeeze,) = ops_of(model, "Squeeze")
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
    model, _ = optimize(proto)
    assert named(model, "softmax").attributes.get_int("axis") == 1
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
    model, _ = optimize(proto)
    moved = producer_of(named(model, "relu").inputs[0])
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
    model, _ = optimize(proto)
    dropout = named(model, "dropout")
    assert producer_of(dropout.inputs[0]).op_type == "Gather"
    assert [dims_of(o) for o in dropout.outputs] == [[2, 2, 4], [2, 2, 4]]
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
    output = "g"  # half the slices are the graph output themselves; drawn last, so earlier draws are unchanged
    if rng.random() < 0.5:
        nodes.append(node("Identity", ["g"], "y", "identity"))
        output = "y"
    try:
        return build(nodes, inputs, {output: F}, inits)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError):
        return None  # e.g. a Reshape whose -1 meets an empty dim: not a valid model to start from


def test_upstream_slice_is_exact_when_graphs_are_random():
    """150 random op chains ending in a random slice, half of them a graph output: every rewrite keeps the
    outputs and their names (2,000 seeds ran clean)."""
    moved = 0
    for seed in range(150):
        proto = _random_case(np.random.default_rng(seed))
        if proto is None:
            continue
        model, result = optimize(proto)
        moved += result.modified
        assert [o.name for o in model.graph.outputs] == [o.name for o in proto.graph.output], f"seed {seed}"
        try:
            assert_equivalent(proto, model, n_random=2, **TOL)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from exc
    assert moved > 100


def test_hf_roberta_cls_gather_moves_into_the_last_layer_when_exported_by_torch():
    """The torch-exported HF RoBERTa classifier (tests/models): decomposed erf-Gelu, allowzero=1 Reshapes
    with computed shapes. With CSE between runs the cls Gather ends on layer 0's output and the mask."""
    path = MODELS / "hf_roberta_cls.onnx"
    proto = onnx.load(str(path))
    model = ir.serde.deserialize_model(proto)
    for _ in range(6):
        moved = UpstreamSlice()(model).modified
        if not (CommonSubexpressionEliminationPass()(model).modified or moved):
            break
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    moved_gathers = [g for g in ops_of(model, "Gather") if g.name.startswith("node_select")]
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
    model, result = optimize(proto)
    assert result.counts == {
        "slices_moved": 1,
        "ops_crossed": 4,
        "squeezes_added": 0,
        "copies_merged": 2,
        "conv_crops_folded": 0,
    }
    (gather,) = ops_of(model, "Gather")
    assert gather.inputs[0].name == "x"
    assert dims_of(named(model, "relu").outputs[0]) == ["batch", 2, 4]
    assert_equivalent(proto, model, **TOL)


@pytest.mark.parametrize(
    ("second_index", "extra_reader"),
    [pytest.param(3, False, id="other-indices"), pytest.param(-1, True, id="non-slice-reader")],
)
def test_slice_copies_stay_when_a_reader_of_the_value_differs(second_index, extra_reader):
    """A Gather with other indices, or a Neg, also reads r: the copies stop at Relu, unmerged."""
    proto = _two_branches(second_index, extra_reader)
    model, result = optimize(proto)
    assert result.counts["copies_merged"] == 0
    assert any("stops at 'relu' (3 consumers)" in m.reason for m in result.non_matches)
    assert named(model, "relu").inputs[0].name == "x"
    assert [g.inputs[0].name for g in ops_of(model, "Gather")] == ["r"] * (3 if second_index >= 0 else 2)
    assert_equivalent(proto, model, **TOL)


def test_hf_roberta_cls_gather_reaches_the_last_layers_input_in_one_run_when_copies_merge():
    """Without CSE between runs: the copies that meet on shared values (GELU halves, the LayerNorm read by
    the FFN and the residual) merge, so one run of the pass gets as far as the CSE fixpoint."""
    path = MODELS / "hf_roberta_cls.onnx"
    proto = onnx.load(str(path))
    model = ir.serde.deserialize_model(proto)
    result = UpstreamSlice()(model)
    assert result.counts["copies_merged"] >= 2
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    moved = [g for g in ops_of(model, "Gather") if g.name.startswith("node_select")]
    assert sorted({g.inputs[0].name for g in moved}) == ["layer_norm_2", "where"]
    assert_equivalent(proto, model, **TOL)
