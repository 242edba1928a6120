"""constant_folding: constant subgraphs become initializers, unless the result would be too large.

The memory-bomb tests are structural only: running the original model would allocate terabytes, which is
the point. They would also hang or crash the test run if the pass evaluated the node before sizing it.
"""

from __future__ import annotations

import onnx
import pytest

from passes._infra import PassContext
from passes.cleanup.constant_folding import ConstantFolding
from tests.numerics import assert_equivalent
from tests.passes._util import MLP_CLEANUP, apply, checked, node_names, ops, parse

TERA = 2**40  # elements; 4 TiB as float32


def test_constant_folding_replaces_constant_subgraph_with_initializer_when_model_is_mlp_cleanup() -> None:
    """b1 + (2 * 3 - six) becomes one initializer; the Constants that fed it go too.

    The folder also forwards Identity outputs to their readers, so the two Identities, left unread, go.
    """
    original = onnx.load(MLP_CLEANUP)
    model, result = apply(ConstantFolding(), original)
    assert result.modified
    assert result.counts == {
        "nodes_removed": 7,
        "initializers_created": 1,
        "skipped_over_cap": 0,
        "skipped_size_unknown": 0,
    }
    assert result.notes["removed_by_op"] == {"Add": 1, "Constant": 2, "Identity": 2, "Mul": 1, "Sub": 1}
    for name in ("const_two", "const_three", "const_mul", "const_sub", "const_add"):
        assert name not in node_names(model)
    # The folded bias is an initializer read by the remaining bias Add; b1 and six are no longer needed.
    assert model.graph.node("add_bias_1").inputs[1].is_initializer()
    assert "b1" not in model.graph.initializers and "six" not in model.graph.initializers
    # Folding is not dead-code elimination: the unread Sigmoid was dead before and stays.
    assert "sigmoid_dead" in node_names(model)
    assert_equivalent(original, checked(model))


def test_constant_folding_leaves_graph_unmodified_when_every_node_reads_a_graph_input() -> None:
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) <float[4] w = {1.0, 2.0, 3.0, 4.0}> {
            [mul] m = Mul(x, w)
            [relu] y = Relu(m)
        }""")
    model, result = apply(ConstantFolding(), original)
    assert not result.modified
    assert ops(model) == {"Mul": 1, "Relu": 1}
    assert result.non_matches == []


@pytest.mark.parametrize(
    ("op", "body"),
    [
        (
            "ConstantOfShape",
            f"s = Constant <value = int64[1] {{{TERA}}}> ()\n [bomb] big = ConstantOfShape(s)",
        ),
        (
            "Expand",
            f"c = Constant <value = float {{1.0}}> ()\n s = Constant <value = int64[1] {{{TERA}}}> ()\n"
            "[bomb] big = Expand(c, s)",
        ),
        (
            "Tile",
            f"c = Constant <value = float[1] {{1.0}}> ()\n s = Constant <value = int64[1] {{{TERA}}}> ()\n"
            "[bomb] big = Tile(c, s)",
        ),
        (
            "Range",
            "a = Constant <value = float {0.0}> ()\n"
            f"b = Constant <value = float {{{float(TERA)}}}> ()\n"
            "d = Constant <value = float {1.0}> ()\n [bomb] big = Range(a, b, d)",
        ),
    ],
)
def test_constant_folding_declines_node_without_evaluating_when_output_would_be_terabytes(op: str, body: str) -> None:
    original = parse(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N] x) => (float[N] y) {{
            {body}
            [size] n = Size(big)
            [cast] nf = Cast <to = 1> (n)
            [add] y = Add(x, nf)
        }}""")
    model, result = apply(ConstantFolding(), original)
    assert op in ops(model) and "bomb" in node_names(model)
    assert result.counts["skipped_over_cap"] == 1 and result.counts["initializers_created"] == 0
    [non_match] = result.non_matches
    assert non_match.node == "bomb" and non_match.op_type == op
    assert f"{4 * TERA} bytes > max_output_bytes {PassContext().constant_fold_max_bytes}" in non_match.reason


_EXPAND_64x64 = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 64] x) => (float[N, 64] y) {
        c = Constant <value = float {0.5}> ()
        s = Constant <value = int64[2] {64, 64}> ()
        [expand] e = Expand(c, s)
        [matmul] y = MatMul(x, e)
    }"""


def test_constant_folding_folds_expand_when_output_fits_the_cap() -> None:
    """64x64 float32 is 16 KiB: within the default 1 MiB."""
    original = parse(_EXPAND_64x64)
    model, result = apply(ConstantFolding(), original)
    assert result.modified and result.counts["initializers_created"] == 1
    assert ops(model) == {"MatMul": 1}
    assert_equivalent(original, checked(model))


def test_constant_folding_keeps_expand_when_option_cap_is_below_output_size() -> None:
    original = parse(_EXPAND_64x64)
    model, result = apply(ConstantFolding({"max_output_bytes": 16 * 1024 - 1}), original)
    assert not result.modified
    assert ops(model) == {"Constant": 2, "Expand": 1, "MatMul": 1}
    [non_match] = result.non_matches
    assert non_match.reason == "folded outputs would take 16384 bytes > max_output_bytes 16383"
    assert_equivalent(original, checked(model))


def test_constant_folding_uses_context_cap_when_option_is_unset() -> None:
    original = parse(_EXPAND_64x64)
    model, result = apply(ConstantFolding(), original, PassContext(constant_fold_max_bytes=1024))
    assert "expand" in node_names(model)
    assert not result.modified and result.counts["skipped_over_cap"] == 1
    # An explicit option overrides the context.
    _, result = apply(
        ConstantFolding({"max_output_bytes": 1 << 20}), original, PassContext(constant_fold_max_bytes=1024)
    )
    assert result.modified


def test_constant_folding_declines_node_when_output_shape_depends_on_values() -> None:
    """NonZero's output length is known only after running it, so its size cannot be bounded first."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N] x) => (float[N] y) {
            c = Constant <value = float[4] {1.0, 0.0, 2.0, 0.0}> ()
            [nonzero] nz = NonZero(c)
            [size] n = Size(nz)
            [cast] nf = Cast <to = 1> (n)
            [add] y = Add(x, nf)
        }""")
    model, result = apply(ConstantFolding(), original)
    assert "nonzero" in node_names(model)
    assert result.counts["skipped_size_unknown"] == 1
    assert "no static shape" in result.non_matches[0].reason
    assert_equivalent(original, checked(model))


def test_constant_folding_inlines_then_branch_when_if_condition_is_constant() -> None:
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) {
            c = Constant <value = bool {1}> ()
            [if_node] y = If(c) <
                then_branch = then_g () => (float[4] t_out) { [then_neg] t_out = Neg(x) },
                else_branch = else_g () => (float[4] e_out) { [else_abs] e_out = Abs(x) }
            >
        }""")
    model, result = apply(ConstantFolding(), original)
    assert result.modified
    assert ops(model) == {"Neg": 1}
    assert_equivalent(original, checked(model))
