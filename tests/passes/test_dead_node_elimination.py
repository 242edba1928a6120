"""dead_node_elimination: what is dead, what only looks dead (subgraph captures, signature), counts."""

from __future__ import annotations

import onnx
from onnx import helper

from passes.cleanup.dead_node_elimination import DeadNodeElimination
from tests.numerics import assert_equivalent
from tests.passes._util import MLP_CLEANUP, apply, checked, node_names, ops, parse


def test_dead_node_elimination_removes_sigmoid_when_model_is_mlp_cleanup() -> None:
    original = onnx.load(MLP_CLEANUP)
    model, result = apply(DeadNodeElimination(), original)
    assert result.modified
    assert result.counts == {
        "nodes_removed": 1,
        "initializers_removed": 0,
        "functions_removed": 0,
        "opsets_removed": 0,
    }
    assert result.notes["removed_by_op"] == {"Sigmoid": 1}
    assert "sigmoid_dead" not in node_names(model)
    assert_equivalent(original, checked(model))


def test_dead_node_elimination_removes_whole_chain_and_its_initializer_when_nothing_reads_it() -> None:
    """dead_mul reads W_dead and feeds dead_exp, which nothing reads: all three go, Relu stays."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) <float[4] w_dead = {1.0, 2.0, 3.0, 4.0}> {
            [relu] y = Relu(x)
            [dead_mul] d1 = Mul(x, w_dead)
            [dead_exp] d2 = Exp(d1)
        }""")
    model, result = apply(DeadNodeElimination(), original)
    assert result.modified
    assert result.counts["nodes_removed"] == 2 and result.counts["initializers_removed"] == 1
    assert ops(model) == {"Relu": 1}
    assert list(model.graph.initializers) == []
    assert_equivalent(original, checked(model))


def test_dead_node_elimination_keeps_node_when_only_an_if_branch_reads_its_output() -> None:
    """r = Relu(x) has no reader in the main graph, but the then-branch captures it."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (bool c, float[4] x) => (float[4] y) {
            [relu] r = Relu(x)
            [if_node] y = If(c) <
                then_branch = then_g () => (float[4] t_out) {
                    [then_neg] t_out = Neg(r)
                },
                else_branch = else_g () => (float[4] e_out) {
                    [else_abs] e_out = Abs(x)
                    [else_dead] e_dead = Exp(x)
                }
            >
        }""")
    model, result = apply(DeadNodeElimination(), original)
    assert "relu" in node_names(model)
    # The dead node inside the else branch is found and removed.
    assert result.modified and result.counts["nodes_removed"] == 1
    assert "else_dead" not in node_names(model)
    assert_equivalent(original, checked(model), n_random=6)


def test_dead_node_elimination_keeps_signature_when_inputs_and_initializer_inputs_are_unread() -> None:
    """An unread graph input, and an initializer listed as a graph input (overridable), both stay."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x, float[N, 4] unused, float[4] bias) => (float[N, 4] y)
          <float[4] bias = {1.0, 2.0, 3.0, 4.0}> {
            [relu] y = Relu(x)
        }""")
    model, result = apply(DeadNodeElimination(), original)
    assert not result.modified
    assert [v.name for v in model.graph.inputs] == ["x", "unused", "bias"]
    assert list(model.graph.initializers) == ["bias"]
    assert_equivalent(original, checked(model))


def test_dead_node_elimination_removes_function_and_opset_when_no_node_calls_them() -> None:
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17, "custom" : 1]>
        g (float[N, 4] x) => (float[N, 4] y) {
            [relu] y = Relu(x)
        }""")
    original.functions.append(
        helper.make_function(
            "custom",
            "Double",
            ["a"],
            ["b"],
            [helper.make_node("Add", ["a", "a"], ["b"])],
            [helper.make_opsetid("", 17)],
        )
    )
    model, result = apply(DeadNodeElimination(), original)
    assert result.counts["functions_removed"] == 1 and result.counts["opsets_removed"] == 1
    assert dict(model.opset_imports) == {"": 17}
    assert len(model.functions) == 0
    assert_equivalent(original, checked(model))


def test_dead_node_elimination_keeps_function_and_opset_when_options_turn_them_off() -> None:
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17, "custom" : 1]>
        g (float[N, 4] x) => (float[N, 4] y) {
            [relu] y = Relu(x)
        }""")
    original.functions.append(
        helper.make_function(
            "custom",
            "Double",
            ["a"],
            ["b"],
            [helper.make_node("Add", ["a", "a"], ["b"])],
            [helper.make_opsetid("", 17)],
        )
    )
    options = {"remove_unused_functions": False, "remove_unused_opsets": False}
    model, result = apply(DeadNodeElimination(options), original)
    assert not result.modified
    assert len(model.functions) == 1 and "custom" in model.opset_imports


def test_dead_node_elimination_reports_unmodified_when_every_node_is_live() -> None:
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) {
            [relu] y = Relu(x)
            [neg] z = Neg(y)
        }""")
    model, result = apply(DeadNodeElimination(), original)
    assert not result.modified
    assert ops(model) == {"Relu": 1, "Neg": 1}
    assert "removed_by_op" not in result.notes
