"""identity_elimination: which Identity nodes go, which stay and why, and that nothing else changes."""

from __future__ import annotations

import onnx

from passes.cleanup.identity_elimination import IdentityElimination
from tests.numerics import assert_equivalent
from tests.passes._util import MLP_CLEANUP, apply, checked, node_names, ops, parse


def test_identity_elimination_removes_both_identities_when_model_is_mlp_cleanup() -> None:
    """identity_in (x -> MatMul) and identity_mid (Add -> MatMul) only feed nodes: both go."""
    original = onnx.load(MLP_CLEANUP)
    model, result = apply(IdentityElimination(), original)
    assert result.modified
    assert result.counts == {"identities_removed": 2, "identities_kept": 0}
    assert result.non_matches == []
    assert "Identity" not in ops(model)
    assert "identity_in" not in node_names(model) and "identity_mid" not in node_names(model)
    assert model.graph.node("matmul_1").inputs[0].name == "x"
    assert_equivalent(original, checked(model))


def test_identity_elimination_renames_producer_when_identity_output_is_graph_output() -> None:
    """y = Identity(r), r = Relu(x), y a graph output: Relu now writes y directly (rule 2)."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
            [relu] r = Relu(x)
            [id] y = Identity(r)
        }""")
    model, result = apply(IdentityElimination(), original)
    assert result.modified
    assert result.counts == {"identities_removed": 1, "identities_kept": 0, "values_renamed": 1}
    assert ops(model) == {"Relu": 1}
    assert [o.name for o in model.graph.outputs] == ["y"]
    assert model.graph.outputs[0].producer() is model.graph.node("relu")
    assert_equivalent(original, checked(model))


def test_identity_elimination_keeps_identity_when_graph_input_feeds_graph_output() -> None:
    """y = Identity(x) with x a graph input and y a graph output: ONNX cannot name x twice (rule 3)."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
            [id] y = Identity(x)
        }""")
    model, result = apply(IdentityElimination(), original)
    assert not result.modified
    assert result.counts == {"identities_removed": 0, "identities_kept": 1}
    [non_match] = result.non_matches
    assert non_match.node == "id" and non_match.op_type == "Identity"
    assert "graph input" in non_match.reason and "'x'" in non_match.reason
    assert ops(model) == {"Identity": 1}
    assert_equivalent(original, checked(model))


def test_identity_elimination_keeps_identity_when_initializer_feeds_graph_output() -> None:
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y, float[4] c_out) <float[4] c = {1.0, 2.0, 3.0, 4.0}> {
            [relu] y = Relu(x)
            [id] c_out = Identity(c)
        }""")
    model, result = apply(IdentityElimination(), original)
    assert not result.modified
    [non_match] = result.non_matches
    assert "initializer" in non_match.reason
    assert_equivalent(original, checked(model))


def test_identity_elimination_keeps_identity_when_input_is_also_a_graph_output() -> None:
    """outputs (r, y) with y = Identity(r): renaming r to y would leave two outputs named y.

    onnx-ir 1.1.0's IdentityEliminationPass does exactly that; this pass keeps the copy.
    """
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] r, float[N, 4] y) {
            [relu] r = Relu(x)
            [id] y = Identity(r)
        }""")
    model, result = apply(IdentityElimination(), original)
    assert not result.modified
    [non_match] = result.non_matches
    assert "both graph outputs" in non_match.reason
    assert [o.name for o in model.graph.outputs] == ["r", "y"]
    assert_equivalent(original, checked(model))


def test_identity_elimination_keeps_last_identity_when_chain_links_graph_input_to_output() -> None:
    """x -> Identity -> a -> Identity -> y: the first goes, which makes the second rule 3."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
            [id_1] a = Identity(x)
            [id_2] y = Identity(a)
        }""")
    model, result = apply(IdentityElimination(), original)
    assert result.modified
    assert result.counts == {"identities_removed": 1, "identities_kept": 1}
    assert node_names(model) == ["id_2"]
    assert model.graph.node("id_2").inputs[0].name == "x"
    assert [nm.node for nm in result.non_matches] == ["id_2"]
    assert_equivalent(original, checked(model))


def test_identity_elimination_keeps_branch_output_identity_when_input_comes_from_outer_graph() -> None:
    """In an If branch, out = Identity(r) with r computed outside: the branch needs its own value.

    The Identity inside the branch that only feeds a node is removed as usual.
    """
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (bool c, float[4] x) => (float[4] y) {
            [relu] r = Relu(x)
            [if_node] y = If(c) <
                then_branch = then_g () => (float[4] t_out) {
                    [then_id] t_out = Identity(r)
                },
                else_branch = else_g () => (float[4] e_out) {
                    [else_id] e_mid = Identity(r)
                    [else_neg] e_out = Neg(e_mid)
                }
            >
        }""")
    model, result = apply(IdentityElimination(), original)
    assert result.modified
    assert result.counts == {"identities_removed": 1, "identities_kept": 1}
    [non_match] = result.non_matches
    assert non_match.node == "then_id" and "enclosing graph" in non_match.reason
    assert "else_id" not in node_names(model)
    assert_equivalent(original, checked(model), n_random=6)  # enough draws of c for both branches


def test_identity_elimination_reports_unmodified_when_graph_has_no_identity() -> None:
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
            [relu] y = Relu(x)
        }""")
    model, result = apply(IdentityElimination(), original)
    assert not result.modified
    assert result.counts == {"identities_removed": 0, "identities_kept": 0}
    assert ops(model) == {"Relu": 1}
