"""``shapes_by_dims`` with ``size_algebra`` where ONNX inference has no name for a size: ``passes.cleanup.
_symbolic_dims`` proves it a product of names (``Reshape``'s -1, torch's ``expand``, ``Range``), and refuses
what only holds for some inputs (two symbols broadcast, an inexact quotient, ``Equal`` against a size the input
may have)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from passes._infra import PassContext
from passes.cleanup.common_subexpression_elimination import CommonSubexpressionElimination
from passes.cleanup.shape_inference import ShapeInference
from tests.passes._util import apply, checked, ops, parse, session

_HEADER = '<ir_version: 8, opset_import: ["" : 17]>'
_ALGEBRA = {"size_algebra": True}


def _run(text: str) -> tuple[onnx.ModelProto, ir.Model, dict]:
    original = parse(f"{_HEADER}\n{text}")
    model, result = apply(CommonSubexpressionElimination(_ALGEBRA), original)
    checked(model)
    return original, model, result.notes


def _same_outputs(original: onnx.ModelProto, model: ir.Model, feeds: list[dict[str, np.ndarray]]) -> None:
    reference, candidate = session(ir.serde.deserialize_model(original)), session(model)
    for feed in feeds:
        for want, got in zip(reference.run(None, feed), candidate.run(None, feed), strict=True):
            np.testing.assert_array_equal(got, want, err_msg=str({k: v.shape for k, v in feed.items()}))


def _x(*shape: int) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


_FOLDS = """
    g (float[batch, seq, 32] x) => (int64[4] y) {
        shape = Constant <value = int64[2] {-1, 8}> ()
        [ra] a = Reshape(x, shape)
        [relu] r = Relu(x)
        [rb] b = Reshape(r, shape)
        [shape_a] sa = Shape(a)
        [shape_b] sb = Shape(b)
        [cat] y = Concat <axis = 0> (sa, sb)
    }"""


def test_reshape_minus_one_is_a_product_of_names_and_two_of_them_merge() -> None:
    """Both are [4*batch*seq, 8]; inference calls them unk__0 and unk__1."""
    original, model, notes = _run(_FOLDS)
    assert notes["shapes_merged_by_dims"] == 1
    assert ops(model)["Shape"] == 1
    _same_outputs(original, model, [{"x": _x(b, s, 32)} for b, s in ((1, 1), (3, 5), (2, 9))])


def test_without_size_algebra_only_inference_names_count_so_the_two_reshapes_stay_apart() -> None:
    original = parse(f"{_HEADER}\n{_FOLDS}")
    model, result = apply(CommonSubexpressionElimination(), original)
    assert "shapes_merged_by_dims" not in result.notes and ops(model)["Shape"] == 2


def test_an_inexact_quotient_is_not_a_size_when_the_coefficient_does_not_divide() -> None:
    """[n, 6] viewed as [-1, 4] has 6n/4 rows, not n (a floor of 6/4 would say n): its Shape(end=1) stays apart
    from x's."""
    original, model, notes = _run("""
        g (float[n, 6] x) => (int64[2] y) {
            shape = Constant <value = int64[2] {-1, 4}> ()
            [ra] a = Reshape(x, shape)
            [shape_a] sa = Shape <end = 1> (a)
            [shape_x] sx = Shape <end = 1> (x)
            [cat] y = Concat <axis = 0> (sa, sx)
        }""")
    assert "shapes_merged_by_dims" not in notes
    _same_outputs(original, model, [{"x": _x(n, 6)} for n in (2, 4, 6)])


def test_torch_expand_of_a_shape_is_that_shape_when_equal_compares_it_with_minus_one() -> None:
    """``t.expand(x.size())`` exports Where(Equal(size, -1), 1, size): a size is never -1, so the Expand is
    [batch, seq], which inference's data propagation does not see."""
    original, model, notes = _run("""
        g (float[batch, seq] x, float[1, 1] t) => (int64[4] y) {
            [shape_x] s = Shape(x)
            ones = Constant <value = int64[2] {1, 1}> ()
            minus = Constant <value = int64[2] {-1, -1}> ()
            [eq] is_minus = Equal(s, minus)
            [where] target = Where(is_minus, ones, s)
            [expand] e = Expand(t, target)
            [relu] r = Relu(x)
            [shape_e] se = Shape(e)
            [shape_r] sr = Shape(r)
            [cat] y = Concat <axis = 0> (se, sr)
        }""")
    assert notes["shapes_merged_by_dims"] >= 1
    assert ops(model)["Shape"] == 1
    _same_outputs(original, model, [{"x": _x(b, s), "t": _x(1, 1)} for b, s in ((1, 1), (3, 5))])


def test_equal_with_a_size_the_input_may_have_is_unknown_so_nothing_merges() -> None:
    """Equal(size, 3) is true when n is 3: the Expand is then [1], else [n]. Read as false, its Shape would merge
    with x's and be wrong at n = 3."""
    original, model, notes = _run("""
        g (float[n] x, float[1] t) => (int64[2] y) {
            [shape_x] s = Shape(x)
            ones = Constant <value = int64[1] {1}> ()
            three = Constant <value = int64[1] {3}> ()
            [eq] is_three = Equal(s, three)
            [where] target = Where(is_three, ones, s)
            [expand] e = Expand(t, target)
            [relu] r = Relu(x)
            [shape_e] se = Shape(e)
            [shape_r] sr = Shape(r)
            [cat] y = Concat <axis = 0> (se, sr)
        }""")
    assert notes["shapes_merged_by_dims"] == 1  # Relu(x)'s Shape is x's; the Expand's stays its own
    assert [n.inputs[0].name for n in model.graph if n.op_type == "Shape"] == ["x", "e"]
    _same_outputs(original, model, [{"x": _x(n), "t": _x(1)} for n in (3, 5)])


def test_two_symbols_broadcast_to_an_unknown_size_because_either_may_be_one() -> None:
    """Add([n], [m]) is [m] when n is 1 and [n] when m is 1: its Shape merges with neither operand's."""
    original, model, notes = _run("""
        g (float[n] p, float[m] q) => (int64[3] y) {
            [add] c = Add(p, q)
            [shape_c] sc = Shape(c)
            [shape_p] sp = Shape(p)
            [shape_q] sq = Shape(q)
            [cat] y = Concat <axis = 0> (sc, sp, sq)
        }""")
    assert "shapes_merged_by_dims" not in notes
    _same_outputs(original, model, [{"p": _x(1), "q": _x(4)}, {"p": _x(4), "q": _x(1)}, {"p": _x(3), "q": _x(3)}])


def test_range_from_zero_by_one_has_its_limit_as_length_and_other_steps_do_not() -> None:
    original, model, notes = _run("""
        g (float[n, 4] x) => (int64[3] y) {
            [shape_x] s = Shape(x)
            zero = Constant <value = int64 {0}> ()
            one = Constant <value = int64 {1}> ()
            two = Constant <value = int64 {2}> ()
            [first] n = Gather <axis = 0> (s, zero)
            [range_1] r1 = Range(zero, n, one)
            [range_2] r2 = Range(zero, n, two)
            [shape_1] s1 = Shape(r1)
            [shape_2] s2 = Shape(r2)
            [shape_n] sn = Shape <end = 1> (x)
            [cat] y = Concat <axis = 0> (s1, s2, sn)
        }""")
    assert notes["shapes_merged_by_dims"] == 1  # x's first axis is Range by 1's length; Range by 2 apart
    assert [n.name for n in model.graph if n.op_type == "Shape"] == ["shape_x", "shape_1", "shape_2"]
    _same_outputs(original, model, [{"x": _x(n, 4)} for n in (1, 4, 7)])


_TWO_LAYERS = """
    g (float[batch, seq, 8] x) => (float[batch, seq, 8] out) {
        fold = Constant <value = int64[3] {-1, 0, 4}> ()
        minus = Constant <value = int64[3] {-1, -1, -1}> ()
        ones = Constant <value = int64[3] {1, 1, 1}> ()
        unfold = Constant <value = int64[3] {-1, 0, 8}> ()
        [f0] q0 = Reshape(x, fold)
        [s0] sh0 = Shape(q0)
        [e0] is0 = Equal(sh0, minus)
        [w0] t0 = Where(is0, ones, sh0)
        [x0] big0 = Expand(q0, t0)
        [c0] c = Reshape(big0, unfold)
        [res0] h1 = Add(c, x)
        [f1] q1 = Reshape(h1, fold)
        [s1] sh1 = Shape(q1)
        [e1] is1 = Equal(sh1, minus)
        [w1] t1 = Where(is1, ones, sh1)
        [x1] big1 = Expand(q1, t1)
        [c1] d = Reshape(big1, unfold)
        [res1] out = Add(d, h1)
    }"""


def test_a_layer_below_a_lost_name_recovers_it_when_its_batch_is_proven_again() -> None:
    """Each layer folds two heads into the batch (view(-1, S, 4)), expands torch-style and unfolds (view(-1, S,
    8)). Inference cannot divide symbols: layer 0's unfold is [unk, seq, 8], so the residual h1 and layer 1's
    fold are unk__N too. The rules prove c = [batch, seq, 8] (2*batch*seq*4 / (seq*8)), so layer 1's fold is
    [2*batch, seq, 4] like layer 0's: its Shape and the Equal/Where target computed from it merge."""
    original, model, notes = _run(_TWO_LAYERS)
    assert notes["shapes_merged_by_dims"] == 1
    assert ops(model)["Shape"] == 1 and ops(model)["Where"] == 1 and ops(model)["Equal"] == 1
    assert ops(model)["Expand"] == 2  # different data, one shared target
    assert model.graph.node("x1").inputs[1] is model.graph.node("x0").inputs[1]
    _same_outputs(original, model, [{"x": _x(b, s, 8)} for b, s in ((1, 1), (3, 5), (2, 9))])


def test_proven_names_replace_the_invented_ones_in_the_annotations_when_shape_inference_ran_first() -> None:
    """shape_inference annotates layer 0's residual sum h1 [unk__N, seq, 8]; CSE writes the proven batch there,
    which later passes compare by name. The folded [2*batch, seq, 4] has no name and keeps inference's."""
    model = ir.serde.deserialize_model(parse(f"{_HEADER}\n{_TWO_LAYERS}"))
    ShapeInference()(model, PassContext())
    h1 = model.graph.node("res0").outputs[0]
    assert str(h1.shape[0]) != "batch"
    result = CommonSubexpressionElimination(_ALGEBRA)(model, PassContext())
    assert result.notes["values_annotated"] > 0
    assert [str(d) for d in h1.shape] == ["batch", "seq", "8"]
    folded = model.graph.node("f1").outputs[0]
    assert str(folded.shape[0]).startswith("unk__") and str(folded.shape[1]) == "seq"


def test_a_slice_keeps_an_axis_only_when_it_takes_all_of_it() -> None:
    """[0:INT64_MAX] and [0:n] keep n; [0:2] is min(2, n), which merges with neither."""
    original, model, notes = _run("""
        g (float[n, 4] x) => (int64[4] y) {
            zero = Constant <value = int64[1] {0}> ()
            two = Constant <value = int64[1] {2}> ()
            end = Constant <value = int64[1] {9223372036854775807}> ()
            [shape_x] s = Shape <end = 1> (x)
            [all] a = Slice(x, zero, end, zero)
            [upto_n] b = Slice(x, zero, s, zero)
            [head] c = Slice(x, zero, two, zero)
            [shape_a] sa = Shape <end = 1> (a)
            [shape_b] sb = Shape <end = 1> (b)
            [shape_c] sc = Shape <end = 1> (c)
            [cat] y = Concat <axis = 0> (s, sa, sb, sc)
        }""")
    assert notes["shapes_merged_by_dims"] == 2
    assert [n.name for n in model.graph if n.op_type == "Shape"] == ["shape_x", "shape_c"]
    _same_outputs(original, model, [{"x": _x(n, 4)} for n in (1, 2, 5)])
