"""OpenAI's privacy filter rotates its channel pairs and stacks the two results back in place (issues 17/19,
held-out decoder round 9): ``stack((x1*c - x2*s, x2*c + x1*s), -1).flatten(-2)`` with x1, x2 the even and odd
channels and c, s half-width tables. That is ``RotaryEmbedding(interleaved=1)`` of x; before, fuse_rotary found no
form it reads ("Cos feeds no q*cos + rotate_half(q)*sin").

``tests/models/heldout/openai_privacy_filter_{ts_eager,dynamo}.onnx``: ``python -m tests.models.build_heldout_probe
heldout_dec_round9 openai_privacy_filter`` (a bidirectional token classifier, 2 layers, hidden 32, 4 heads of 8,
2 key/value heads, YaRN-scaled rope, attention sinks, 4 experts).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_rotary import FuseRotary
from tests.numerics import assert_equivalent

HELDOUT = Path(__file__).resolve().parent.parent / "models" / "heldout"


@pytest.mark.parametrize("exporter", ["ts_eager", "dynamo"])
def test_the_privacy_filters_stacked_pairs_are_interleaved_rotary(exporter: str) -> None:
    path = HELDOUT / f"openai_privacy_filter_{exporter}.onnx"
    result = FuseRotary()(ir.load(path), PassContext())
    assert result.counts["rotary_embeddings"] == 4, result.non_matches
    assert result.counts["interleaved_rotary"] == 4
    nodes = [n for n in result.model.graph if n.op_type == "RotaryEmbedding"]
    assert [n.attributes["interleaved"].as_int() for n in nodes] == [1, 1, 1, 1]
    assert {"Sin", "Cos"}.isdisjoint(op_histogram(result.model))
    shapes = [{"input_ids": (b, s), "attention_mask": (b, s)} for b, s in ((1, 5), (2, 37), (3, 70))]
    assert_equivalent(ir.load(path), result.model, shapes, rtol=1e-5, atol=1e-5)


def _stacked_rope(odd_first: bool) -> ir.Model:
    """The stacked form over x [B, 2, S, 8] with [16, 4] tables read at ``position_ids``; ``odd_first`` stacks
    the odd channels' result first, which is no rope (the pairs come back swapped)."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    angles = np.arange(16, dtype=np.float32)[:, None] * np.array([1.0, 0.1, 0.01, 0.001], np.float32)
    inits = [
        helper.make_tensor("cos", f, [16, 4], np.cos(angles).ravel()),
        helper.make_tensor("sin", f, [16, 4], np.sin(angles).ravel()),
        *(helper.make_tensor(n, i64, [1], [v]) for n, v in (("zero", 0), ("one", 1), ("two", 2), ("end", 2**63 - 1))),
        helper.make_tensor("last", i64, [1], [-1]),
        helper.make_tensor("flat", i64, [4], [0, 0, 0, 8]),
    ]
    pair = ["second_u", "first_u"] if odd_first else ["first_u", "second_u"]
    nodes = [
        helper.make_node("Gather", ["cos", "position_ids"], ["c_rows"]),
        helper.make_node("Gather", ["sin", "position_ids"], ["s_rows"]),
        helper.make_node("Unsqueeze", ["c_rows", "one"], ["c"]),
        helper.make_node("Unsqueeze", ["s_rows", "one"], ["s"]),
        helper.make_node("Slice", ["x", "zero", "end", "last", "two"], ["x1"]),
        helper.make_node("Slice", ["x", "one", "end", "last", "two"], ["x2"]),
        helper.make_node("Mul", ["x1", "c"], ["x1c"]),
        helper.make_node("Mul", ["x2", "s"], ["x2s"]),
        helper.make_node("Sub", ["x1c", "x2s"], ["first"]),
        helper.make_node("Mul", ["x2", "c"], ["x2c"]),
        helper.make_node("Mul", ["x1", "s"], ["x1s"]),
        helper.make_node("Add", ["x2c", "x1s"], ["second"]),
        helper.make_node("Unsqueeze", ["first", "last"], ["first_u"]),
        helper.make_node("Unsqueeze", ["second", "last"], ["second_u"]),
        helper.make_node("Concat", pair, ["stacked"], axis=-1),
        helper.make_node("Reshape", ["stacked", "flat"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", f, ["b", 2, "s", 8]),
                     helper.make_tensor_value_info("position_ids", i64, ["b", "s"])],
        [helper.make_tensor_value_info("y", f, None)], inits,
    )  # fmt: skip
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_stacked_pairs_fuse_and_swapped_ones_are_left() -> None:
    result = FuseRotary()(_stacked_rope(odd_first=False), PassContext())
    assert result.counts["interleaved_rotary"] == 1, result.non_matches
    shapes = [{"x": (b, 2, s, 8), "position_ids": (b, s)} for b, s in ((1, 3), (2, 16))]
    assert_equivalent(_stacked_rope(odd_first=False), result.model, shapes, rtol=1e-5, atol=1e-5)
    swapped = FuseRotary()(_stacked_rope(odd_first=True), PassContext())
    assert not swapped.counts.get("rotary_embeddings")
    assert "RotaryEmbedding" not in op_histogram(swapped.model)
