"""common_subexpression_elimination's ``shapes_by_dims``: Shape nodes over different values merge where a fresh
ONNX shape inference proves the returned sizes equal, never on the model's own annotations or unknown sizes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from passes.cleanup.common_subexpression_elimination import CommonSubexpressionElimination
from tests.models import corpus
from tests.numerics import assert_equivalent
from tests.passes._util import apply, checked, ops, parse, session

# Two projections of one activation, each with the TorchScript-style head split computed from its own Shape:
# Shape -> Gather(0), Gather(1) -> Unsqueeze -> Concat(.., 4, -1) -> Reshape. q and k are different values of
# one proven shape [batch, seq, 8].
_PER_PROJECTION = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[batch, seq, 8] x, float[8, 8] wq, float[8, 8] wk) => (float[batch, seq, 4, 2] y) {
        [q_mm] q = MatMul(x, wq)
        [k_mm] k = MatMul(x, wk)
        zero = Constant <value = int64[1] {0}> ()
        one = Constant <value = int64[1] {1}> ()
        tail = Constant <value = int64[2] {4, -1}> ()
        [q_shape] qs = Shape(q)
        [q_b] qb = Gather <axis = 0> (qs, zero)
        [q_s] qn = Gather <axis = 0> (qs, one)
        [q_cat] qt = Concat <axis = 0> (qb, qn, tail)
        [q_rs] q4 = Reshape(q, qt)
        [k_shape] ks = Shape(k)
        [k_b] kb = Gather <axis = 0> (ks, zero)
        [k_s] kn = Gather <axis = 0> (ks, one)
        [k_cat] kt = Concat <axis = 0> (kb, kn, tail)
        [k_rs] k4 = Reshape(k, kt)
        [add] y = Add(q4, k4)
    }"""


def _shapes_read(model: ir.Model) -> list[str | None]:
    return [n.inputs[0].name for n in model.graph if n.op_type == "Shape"]


def test_shapes_of_equal_dims_merge_and_their_chains_collapse_when_two_projections_split_heads() -> None:
    original = parse(_PER_PROJECTION)
    model, result = apply(CommonSubexpressionElimination(), original)
    assert result.notes["shapes_merged_by_dims"] == 1
    # k's Shape, both Gathers and the Concat follow it: one head-split shape for both projections
    assert result.counts == {"nodes_merged": 4}
    assert _shapes_read(model) == ["q"]
    assert ops(model) == {"MatMul": 2, "Constant": 3, "Shape": 1, "Gather": 2, "Concat": 1, "Reshape": 2, "Add": 1}
    q_rs, k_rs = model.graph.node("q_rs"), model.graph.node("k_rs")
    assert q_rs.inputs[1] is k_rs.inputs[1]
    assert_equivalent(original, checked(model), shapes=[{"x": (5, 11, 8), "wq": (8, 8), "wk": (8, 8)}], n_random=4)


def test_shapes_stay_apart_when_option_is_off() -> None:
    model, result = apply(CommonSubexpressionElimination({"shapes_by_dims": False}), parse(_PER_PROJECTION))
    assert not result.modified and "shapes_merged_by_dims" not in result.notes
    assert ops(model)["Shape"] == 2


@pytest.mark.parametrize(
    ("attrs", "merged"),
    [
        ("start = 0, end = 1", True),  # only batch is read, and both have it
        ("end = -1", True),  # [batch, seq] of both
        ("start = -3, end = -2", True),  # negative axes count from the back: batch again
        ("start = 2", False),  # 8 against 6
        ("", False),  # the whole shape: [batch, seq, 8] against [batch, seq, 6]
    ],
)
def test_shape_slices_merge_only_when_the_returned_sizes_are_equal(attrs: str, merged: bool) -> None:
    original = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, seq, 8] a, float[batch, seq, 6] b) => (int64[n] y) {{
            [shape_a] sa = Shape <{attrs}> (a)
            [shape_b] sb = Shape <{attrs}> (b)
            [cat] y = Concat <axis = 0> (sa, sb)
        }}""".replace("<>", "")
    )
    model, result = apply(CommonSubexpressionElimination(), original)
    assert result.notes.get("shapes_merged_by_dims", 0) == int(merged)
    assert ops(model)["Shape"] == (1 if merged else 2)
    assert_equivalent(original, checked(model), n_random=3)


def test_shapes_of_different_symbolic_dims_stay_apart() -> None:
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, seq, 8] a, float[batch, other, 8] b) => (int64[6] y) {
            [shape_a] sa = Shape(a)
            [shape_b] sb = Shape(b)
            [cat] y = Concat <axis = 0> (sa, sb)
        }""")
    model, result = apply(CommonSubexpressionElimination(), original)
    assert not result.modified
    assert_equivalent(original, checked(model), shapes=[{"a": (2, 3, 8), "b": (2, 5, 8)}])


def test_shapes_of_unknown_dims_stay_apart_even_when_both_are_unknown() -> None:
    """Inputs without dim names: ONNX leaves each size unknown (None), and None equals nothing."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[?, 8] a, float[?, 8] b) => (int64[4] y) {
            [shape_a] sa = Shape(a)
            [shape_b] sb = Shape(b)
            [cat] y = Concat <axis = 0> (sa, sb)
        }""")
    model, result = apply(CommonSubexpressionElimination(), original)
    assert not result.modified
    assert_equivalent(original, checked(model), shapes=[{"a": (2, 8), "b": (5, 8)}])


def test_names_invented_by_one_inference_run_merge_when_inference_copied_them() -> None:
    """NonZero's count is data-dependent: inference names it unk__N once and copies it through Cast and Neg,
    so the two Shapes read one size whatever the data."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[n] x) => (int64[4] y) {
            [nz] idx = NonZero(x)
            [cast] f = Cast <to = 1> (idx)
            [neg] g = Neg(idx)
            [shape_f] sf = Shape(f)
            [shape_g] sg = Shape(g)
            [cat] y = Concat <axis = 0> (sf, sg)
        }""")
    model, result = apply(CommonSubexpressionElimination(), original)
    assert result.notes["shapes_merged_by_dims"] == 1
    assert ops(model)["Shape"] == 1
    reference, candidate = session(ir.serde.deserialize_model(original)), session(model)
    rng = np.random.default_rng(0)
    for n in (1, 6, 13):
        x = np.where(rng.random(n) < 0.5, 0.0, rng.standard_normal(n)).astype(np.float32)
        np.testing.assert_array_equal(candidate.run(None, {"x": x})[0], reference.run(None, {"x": x})[0])


@pytest.mark.parametrize("options", [{}, {"size_algebra": True}], ids=["names", "algebra"])
def test_model_annotations_are_never_trusted_when_they_claim_equal_sizes(options: dict) -> None:
    """value_info says b is [n, m] like a, and an earlier inference's unk__0 on c and d; both are false (b is
    the transpose, d is c's transpose). The pass infers afresh and merges nothing; trusting the annotations
    would return a's shape for b's and fail the numerics whenever n != m."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[n, m] x) => (int64[8] y) {
            [relu] a = Relu(x)
            [tr] b = Transpose <perm = [1, 0]> (x)
            [nz] idx = NonZero(x)
            [cast] c = Cast <to = 1> (idx)
            [tr_c] d = Transpose <perm = [1, 0]> (c)
            [shape_a] sa = Shape(a)
            [shape_b] sb = Shape(b)
            [shape_c] sc = Shape(c)
            [shape_d] sd = Shape(d)
            [cat] y = Concat <axis = 0> (sa, sb, sc, sd)
        }""")
    for name, dims in (("a", ["n", "m"]), ("b", ["n", "m"]), ("c", ["unk__0", "unk__0"]), ("d", ["unk__0", "unk__0"])):
        elem = onnx.TensorProto.FLOAT
        original.graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem, dims))
    model, result = apply(CommonSubexpressionElimination(options), original)
    assert result.counts == {"nodes_merged": 0} and "shapes_merged_by_dims" not in result.notes
    assert ops(model)["Shape"] == 4
    # the false annotation is replaced by the proven one
    assert [str(d) for d in model.graph.node("tr").outputs[0].shape] == ["m", "n"]
    assert_equivalent(original, checked(model), shapes=[{"x": (2, 5)}, {"x": (4, 3)}], n_random=0)


def test_an_if_output_is_not_merged_when_its_branches_declare_a_size_one_branch_does_not_keep() -> None:
    """Both branches declare their output float[n] like x, but the else branch doubles it. ONNX inference merges
    a branch's declaration into what it infers (Concat's size is unknown, the declared n stays), so trusting
    the declarations would give the If output x's size. Subgraph declarations are dropped and values computed
    from an op with a graph attribute are not proven: nothing merges."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[n] x, bool c) => (int64[2] y) {
            [branch] out = If(c) <
                then_branch = then_g () => (float[n] t_out) {
                    [same] t_out = Identity(x)
                },
                else_branch = else_g () => (float[n] e_out) {
                    [twice] e_out = Concat <axis = 0> (x, x)
                }
            >
            [shape_x] sx = Shape(x)
            [shape_out] so = Shape(out)
            [cat] y = Concat <axis = 0> (sx, so)
        }""")
    model, result = apply(CommonSubexpressionElimination(), original)
    assert "shapes_merged_by_dims" not in result.notes
    assert ops(model)["Shape"] == 2
    reference, candidate = session(ir.serde.deserialize_model(original)), session(model)
    for n, c in ((3, False), (3, True), (5, False)):
        feeds = {"x": np.ones(n, np.float32), "c": np.array(c)}
        np.testing.assert_array_equal(candidate.run(None, feeds)[0], reference.run(None, feeds)[0])


# DeBERTa-v3 (TorchScript export, committed): every projection and attention reshape reads its own Shape, and
# each layer expands the shared relative-position indices to [4*batch, seq, seq] from its own folded query's
# Shape. ONNX inference names layer 0's sizes batch and sequence but calls layer 1's unk__N (it loses them at
# layer 0's residual Add): by inference's names alone the Shapes merge within each layer. With size_algebra
# the rules prove layer 1's sizes batch and sequence again, and layer 1's c2p and p2c Expands are layer 0's.
_DEBERTA_LAYERS = 2
_DEBERTA_SHAPES = ((1, 5), (3, 37), (2, 70))  # the export's is 2 x 16; 37 and 70 reach the log buckets


def _assert_deberta_outputs(path, model: ir.Model) -> None:
    reference, candidate = session(str(path)), session(model)
    for batch, seq in _DEBERTA_SHAPES:
        feeds = corpus.feeds("deberta_v3", "tiny", batch, seq, seed=seq, pad=True)
        for want, got in zip(reference.run(None, feeds), candidate.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{batch}x{seq}")


def test_deberta_v3_torchscript_export_shares_shapes_within_each_layer_by_inference_names() -> None:
    path = corpus.committed_path("deberta_v3", "ts_eager")
    original = onnx.load(path)
    plain, plain_result = apply(CommonSubexpressionElimination({"shapes_by_dims": False}), original)
    model, result = apply(CommonSubexpressionElimination(), original)
    assert result.notes["shapes_merged_by_dims"] >= 8
    assert ops(model)["Shape"] <= ops(plain)["Shape"] - 8
    assert ops(model)["Expand"] == ops(plain)["Expand"]  # per layer still: layer 1's sizes have no name
    # the Gather/Unsqueeze/Concat arithmetic over the merged Shapes merges too: more than the Shapes alone
    merged_more = result.counts["nodes_merged"] - plain_result.counts["nodes_merged"]
    assert merged_more > result.notes["shapes_merged_by_dims"]
    _assert_deberta_outputs(path, model)


def test_deberta_v3_torchscript_export_shares_relative_position_expands_across_layers_with_size_algebra() -> None:
    path = corpus.committed_path("deberta_v3", "ts_eager")
    original = onnx.load(path)
    plain, _ = apply(CommonSubexpressionElimination({"shapes_by_dims": False}), original)
    names, _ = apply(CommonSubexpressionElimination(), original)
    model, _ = apply(CommonSubexpressionElimination({"size_algebra": True}), original)
    assert ops(model)["Shape"] < ops(names)["Shape"]
    # c2p and p2c: one pair of index Expands (and of their Where/Equal targets) for all layers
    assert ops(model)["Expand"] == ops(plain)["Expand"] - 2 * (_DEBERTA_LAYERS - 1)
    assert ops(model)["GatherElements"] == ops(plain)["GatherElements"] == 2 * _DEBERTA_LAYERS
    gathered = {n.inputs[1] for n in model.graph if n.op_type == "GatherElements"}
    assert len(gathered) == 2  # every layer gathers with layer 0's expanded indices
    _assert_deberta_outputs(path, model)
