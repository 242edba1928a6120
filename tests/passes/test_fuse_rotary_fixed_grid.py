"""DINOv3's 2-D rope over a fixed grid of patches, as dynamo folds it (issue 17, held-out round 7).

``tests/models/heldout/dinov3_vit_dynamo.onnx``: ``python -m tests.models.build_heldout_probe heldout_round7
dinov3_vit`` (2 layers, hidden 64, 4 heads, 32 x 32 images of 4 x 4 patches after a class token and registers).
The image size is fixed, so dynamo folds the rope's angles into ``[P, D]`` cos and sin constants that multiply
the patch tokens' q and k (split from the prefix tokens) by broadcasting, with no Unsqueeze and no Slice: no
rotation fused before ("cos is not unsqueezed on a heads axis"). Such a table is rows 0..P-1 (the broadcast
needs x's sequence to be its P rows): RotaryEmbedding from position 0, 4/4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper

from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_rotary import FuseRotary
from tests.numerics import assert_equivalent

PATH = Path(__file__).resolve().parent.parent / "models" / "heldout" / "dinov3_vit_dynamo.onnx"


def test_a_folded_grid_table_is_rotary_embedding_from_position_zero() -> None:
    result = FuseRotary()(ir.load(PATH), PassContext())
    assert result.counts["rotary_embeddings"] == 4, result.non_matches
    nodes = [n for n in result.model.graph if n.op_type == "RotaryEmbedding"]
    assert len(nodes) == 4
    assert all(n.inputs[1].const_value.numpy().tolist() == [0] for n in nodes)  # rows 0..P-1
    assert "Neg" not in op_histogram(result.model)  # every rotate_half went
    shapes = [{"pixel_values": (b, 3, 32, 32)} for b in (1, 3)]
    assert_equivalent(ir.load(PATH), result.model, shapes, rtol=1e-5, atol=1e-5)


def _table_rope(rows: int) -> ir.Model:
    """``x * cos + rotate_half(x) * sin`` with constant [rows, 8] tables over x [B, 2, S, 8]: S is ``rows``, or
    any length where one row serves every position (which no kernel start reproduces: RotaryEmbedding would read
    rows 0..S-1)."""
    f = TensorProto.FLOAT
    angles = np.arange(rows, dtype=np.float32)[:, None] * np.array([1.0, 0.1, 0.01, 0.001], np.float32)
    table = np.concatenate([angles, angles], -1)
    inits = [
        helper.make_tensor("cos", f, [rows, 8], np.cos(table).ravel()),
        helper.make_tensor("sin", f, [rows, 8], np.sin(table).ravel()),
        helper.make_tensor("lo", TensorProto.INT64, [1], [0]),
        helper.make_tensor("mid", TensorProto.INT64, [1], [4]),
        helper.make_tensor("hi", TensorProto.INT64, [1], [8]),
        helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
    ]
    nodes = [
        helper.make_node("Slice", ["x", "lo", "mid", "last"], ["x1"]),
        helper.make_node("Slice", ["x", "mid", "hi", "last"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["neg"]),
        helper.make_node("Concat", ["neg", "x1"], ["rot"], axis=-1),
        helper.make_node("Mul", ["x", "cos"], ["a"]),
        helper.make_node("Mul", ["rot", "sin"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", f, ["b", 2, rows if rows > 1 else "s", 8])],
        [helper.make_tensor_value_info("y", f, None)], inits,
    )  # fmt: skip
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_a_table_of_the_sequences_rows_fuses_and_a_one_row_table_is_left() -> None:
    grid = FuseRotary()(_table_rope(5), PassContext())
    assert grid.counts["rotary_embeddings"] == 1
    assert_equivalent(_table_rope(5), grid.model, [{"x": (3, 2, 5, 8)}], rtol=1e-5, atol=1e-5)
    one = FuseRotary()(_table_rope(1), PassContext())
    assert not one.counts.get("rotary_embeddings")
    assert "RotaryEmbedding" not in op_histogram(one.model)
