"""common_subexpression_elimination: equal nodes merge; nodes differing in anything, or random, do not."""

from __future__ import annotations

import onnx
import pytest

from passes.cleanup.common_subexpression_elimination import CommonSubexpressionElimination
from tests.numerics import assert_equivalent
from tests.passes._util import MLP_CLEANUP, apply, checked, node_names, ops, parse


def test_cse_merges_duplicate_relu_when_model_is_mlp_cleanup() -> None:
    original = onnx.load(MLP_CLEANUP)
    model, result = apply(CommonSubexpressionElimination(), original)
    assert result.modified
    assert result.counts == {"nodes_merged": 1}
    assert result.notes == {"merged_by_op": {"Relu": 1}}
    assert "relu_b_duplicate" not in node_names(model) and "relu_a" in node_names(model)
    add = model.graph.node("add_branches")
    assert add.inputs[0] is add.inputs[1]
    assert_equivalent(original, checked(model))


def test_cse_collapses_whole_chain_when_duplicates_feed_duplicates() -> None:
    """Relu -> Transpose twice over: merging the Relus makes the Transposes equal too."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[4, N] y) {
            [relu_1] a1 = Relu(x)
            [relu_2] a2 = Relu(x)
            [tr_1] t1 = Transpose <perm = [1, 0]> (a1)
            [tr_2] t2 = Transpose <perm = [1, 0]> (a2)
            [add] y = Add(t1, t2)
        }""")
    model, result = apply(CommonSubexpressionElimination(), original)
    assert result.counts == {"nodes_merged": 2}
    assert node_names(model) == ["relu_1", "tr_1", "add"]
    assert_equivalent(original, checked(model))


@pytest.mark.parametrize(
    ("attrs_1", "attrs_2"),
    [
        ("alpha = 0.1", "alpha = 0.2"),
        ("alpha = 0.0", "alpha = -0.0"),  # equal under ==, different bits: not the same node
        ("alpha = 0.1", ""),  # an explicit value vs the default is not compared by meaning
    ],
)
def test_cse_keeps_both_nodes_when_attributes_differ(attrs_1: str, attrs_2: str) -> None:
    second = f"<{attrs_2}>" if attrs_2 else ""
    original = parse(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {{
            [leaky_1] a = LeakyRelu <{attrs_1}> (x)
            [leaky_2] b = LeakyRelu {second} (x)
            [add] y = Add(a, b)
        }}""")
    model, result = apply(CommonSubexpressionElimination(), original)
    assert not result.modified
    assert result.counts == {"nodes_merged": 0}
    assert ops(model) == {"LeakyRelu": 2, "Add": 1}
    assert_equivalent(original, checked(model))


def test_cse_keeps_both_nodes_when_inputs_are_in_different_order() -> None:
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x, float[N, 4] z) => (float[N, 4] y) {
            [sub_1] a = Sub(x, z)
            [sub_2] b = Sub(z, x)
            [add] y = Add(a, b)
        }""")
    model, result = apply(CommonSubexpressionElimination(), original)
    assert not result.modified
    assert ops(model) == {"Sub": 2, "Add": 1}


def test_cse_inserts_identity_when_both_duplicates_are_graph_outputs() -> None:
    """y1 and y2 are both outputs: the kept value keeps y1, an Identity carries the name y2."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y1, float[N, 4] y2) {
            [relu_1] y1 = Relu(x)
            [relu_2] y2 = Relu(x)
        }""")
    model, result = apply(CommonSubexpressionElimination(), original)
    assert result.counts == {"nodes_merged": 1}
    assert ops(model) == {"Relu": 1, "Identity": 1}
    assert [o.name for o in model.graph.outputs] == ["y1", "y2"]
    assert_equivalent(original, checked(model))


def test_cse_renames_kept_value_when_only_the_dropped_duplicate_is_a_graph_output() -> None:
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) {
            [relu_1] a = Relu(x)
            [neg] z = Neg(a)
            [relu_2] y = Relu(x)
        }""")
    model, result = apply(CommonSubexpressionElimination(), original)
    assert result.counts == {"nodes_merged": 1}
    assert ops(model) == {"Relu": 1, "Neg": 1}
    assert [o.name for o in model.graph.outputs] == ["y", "z"]
    assert model.graph.node("neg").inputs[0].name == "y"
    assert_equivalent(original, checked(model))


def test_cse_keeps_random_nodes_when_they_look_identical() -> None:
    """Two RandomNormalLike draws with equal attributes are two different tensors (no numerics: random)."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
            [rand_1] a = RandomNormalLike(x)
            [rand_2] b = RandomNormalLike(x)
            [sub] y = Sub(a, b)
        }""")
    model, result = apply(CommonSubexpressionElimination(), original)
    assert not result.modified
    [non_match] = result.non_matches
    assert non_match.node == "rand_2" and "random" in non_match.reason
    assert ops(model) == {"RandomNormalLike": 2, "Sub": 1}


def test_cse_keeps_custom_ops_unless_option_allows_them() -> None:
    text = """
        <ir_version: 8, opset_import: ["" : 17, "vendor" : 1]>
        g (float[N, 4] x) => (float[N, 4] y) {
            [custom_1] a = vendor.Step(x)
            [custom_2] b = vendor.Step(x)
            [add] y = Add(a, b)
        }"""
    original = parse(text, check=False)  # the checker has no schema for vendor.Step
    model, result = apply(CommonSubexpressionElimination(), original)
    assert not result.modified
    assert "stateful" in result.non_matches[0].reason
    model, result = apply(CommonSubexpressionElimination({"include_custom_domains": True}), original)
    assert result.counts == {"nodes_merged": 1}
    assert ops(model) == {"vendor::Step": 1, "Add": 1}


def test_cse_merges_inside_if_branch_when_duplicates_share_a_subgraph() -> None:
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (bool c, float[4] x) => (float[4] y) {
            [if_node] y = If(c) <
                then_branch = then_g () => (float[4] t_out) {
                    [then_exp_1] t1 = Exp(x)
                    [then_exp_2] t2 = Exp(x)
                    [then_add] t_out = Add(t1, t2)
                },
                else_branch = else_g () => (float[4] e_out) {
                    [else_neg] e_out = Neg(x)
                }
            >
        }""")
    model, result = apply(CommonSubexpressionElimination(), original)
    assert result.counts == {"nodes_merged": 1}
    assert "then_exp_2" not in node_names(model)
    assert_equivalent(original, checked(model), n_random=6)


def test_cse_merges_small_constants_but_not_large_ones_when_values_are_equal() -> None:
    small = ", ".join(["1.0"] * 4)
    original = parse(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {{
            [c_1] k1 = Constant <value = float[4] {{{small}}}> ()
            [c_2] k2 = Constant <value = float[4] {{{small}}}> ()
            [add_1] a = Add(x, k1)
            [add_2] y = Add(a, k2)
        }}""")
    model, result = apply(CommonSubexpressionElimination(), original)
    assert result.counts == {"nodes_merged": 1}
    assert_equivalent(original, checked(model))
    model, result = apply(CommonSubexpressionElimination({"max_constant_elements": 3}), original)
    assert not result.modified and result.non_matches == []
