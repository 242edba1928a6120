"""``_decoder_structure.detect`` on graphs built here: a learned position table is read where the graph indexes
it with positions it computes (a Range from the past length on, shifted by a constant, as BART does), by
``Gather`` or by ``GatherND`` on rows, and only there."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from passes.fusion import _decoder_structure
from tests.numerics import reference_session, run_named

HIDDEN, VOCAB, TABLE = 8, 50, 34


def _embedding_graph(index_ops: str, gather: str = "Gather", unsqueeze_axis: int = -1) -> onnx.ModelProto:
    """ids -> token table + position table[positions], positions = Range(past, past + S) then ``index_ops``."""
    rng = np.random.default_rng(0)
    inits = [
        helper.make_tensor("tokens", TensorProto.FLOAT, [VOCAB, HIDDEN], rng.standard_normal(VOCAB * HIDDEN)),
        helper.make_tensor("positions", TensorProto.FLOAT, [TABLE, HIDDEN], rng.standard_normal(TABLE * HIDDEN)),
        helper.make_tensor("one", TensorProto.INT64, [], [1]),
        helper.make_tensor("two", TensorProto.INT64, [], [2]),
        helper.make_tensor("zero_axis", TensorProto.INT64, [1], [0]),
        helper.make_tensor("last_axis", TensorProto.INT64, [1], [unsqueeze_axis]),
        helper.make_tensor("one_index", TensorProto.INT64, [1], [1]),
    ]
    nodes = [
        helper.make_node("Gather", ["tokens", "ids"], ["embedded"]),
        helper.make_node("Shape", ["ids"], ["ids_shape"]),
        helper.make_node("Gather", ["ids_shape", "one_index"], ["length_1d"]),
        helper.make_node("Squeeze", ["length_1d", "zero_axis"], ["length"]),
        helper.make_node("Add", ["past", "length"], ["end"]),
        helper.make_node("Range", ["past", "end", "one"], ["range"]),
    ]
    last = "range"
    for i, op in enumerate(index_ops.split()):
        if op == "shift":
            nodes.append(helper.make_node("Add", [last, "two"], [f"idx{i}"]))
        elif op == "scale":
            nodes.append(helper.make_node("Mul", [last, "two"], [f"idx{i}"]))
        else:  # unsqueeze: a batch axis
            nodes.append(helper.make_node("Unsqueeze", [last, "zero_axis"], [f"idx{i}"]))
        last = f"idx{i}"
    if gather == "GatherND":
        nodes += [
            helper.make_node("Unsqueeze", [last, "last_axis"], ["idx_nd"]),
            helper.make_node("GatherND", ["positions", "idx_nd"], ["placed"]),
        ]
    else:
        nodes.append(helper.make_node("Gather", ["positions", last], ["placed"]))
    nodes.append(helper.make_node("Add", ["embedded", "placed"], ["hidden"]))
    graph = helper.make_graph(
        nodes,
        "embedding",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "seq"]),
            helper.make_tensor_value_info("past", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, "seq", HIDDEN])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize(
    ("index_ops", "gather", "expected"),
    [
        ("unsqueeze", "Gather", TABLE),  # Whisper: the table from row 0
        ("unsqueeze shift", "Gather", TABLE - 2),  # BART: positions start at row 2
        ("unsqueeze", "GatherND", TABLE),  # dynamo's Whisper: GatherND on rows
        ("unsqueeze scale", "Gather", None),  # every other row: not a position table's reading
    ],
)
def test_position_table_length_is_read_when_the_graph_computes_the_positions(index_ops, gather, expected):
    proto = _embedding_graph(index_ops, gather)
    onnx.checker.check_model(proto, full_check=True)
    feeds = {"ids": np.array([[3, 4, 5]], np.int64), "past": np.array(5, np.int64)}
    assert run_named(reference_session(proto), feeds)["hidden"].shape == (1, 3, HIDDEN)  # a graph that runs
    found = _decoder_structure.detect(ir.serde.deserialize_model(proto))
    assert found["max_positions"] == expected
    assert (found["vocab"], found["hidden"]) == (VOCAB, HIDDEN)


def test_gather_nd_over_index_pairs_is_no_position_table_when_not_unsqueezed_last():
    """GatherND whose index tuples are not one long (Unsqueeze on axis 0) picks elements, not rows."""
    proto = _embedding_graph("unsqueeze", "GatherND", unsqueeze_axis=0)
    assert _decoder_structure.detect(ir.serde.deserialize_model(proto))["max_positions"] is None


def _one_attention(tokens: int) -> ir.Model:
    """x [B, tokens, 32] split to 4 heads of 8, self-attention, and the heads merged back by the same perm: an
    encoder over a fixed number of tokens (Gemma 4's vision tower: 81 patches), every dim static but the batch."""
    f = TensorProto.FLOAT
    rng = np.random.default_rng(1)
    inits = [
        helper.make_tensor("w", f, [32, 32], rng.standard_normal(32 * 32)),
        helper.make_tensor("split", TensorProto.INT64, [4], [0, 0, 4, 8]),
        helper.make_tensor("merge", TensorProto.INT64, [3], [0, 0, 32]),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["proj"]),
        helper.make_node("Reshape", ["proj", "split"], ["heads"]),
        helper.make_node("Transpose", ["heads"], ["q"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["q"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "q"], ["context"]),
        helper.make_node("Transpose", ["context"], ["merged"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["merged", "merge"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "attention", [helper.make_tensor_value_info("x", f, ["batch", tokens, 32])],
        [helper.make_tensor_value_info("y", f, ["batch", tokens, 32])], inits,
    )  # fmt: skip
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    from onnx_ir.passes.common import ShapeInferencePass

    ShapeInferencePass()(model)
    return model


@pytest.mark.parametrize("tokens", [81, 3])
def test_heads_are_read_from_the_split_not_from_the_merge_of_a_fixed_length(tokens: int) -> None:
    """The merge's Transpose(0, 2, 1, 3) has [B, tokens, 4, 8] as output: read as a split, it once made 81 the
    heads (the most seen) of an 81-token encoder."""
    structure = _decoder_structure.detect(_one_attention(tokens), [])
    assert (structure["heads"], structure["head_size"]) == (4, 8)
