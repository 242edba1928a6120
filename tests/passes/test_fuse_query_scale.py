"""TimesFM's and TimesFM 2.5's queries scaled per head dimension fuse (issue 17, held-out round 16: attention 0/2 on
both exporters, each).

TimesFM multiplies its heads-first query by a learned vector over the head dimension; the attention rules take a
scalar scale only ("query_scale is not a scalar"). ``_query_scale`` moves the vector before the head split (tiled
over the heads), where the product is the same: both layers fuse as MultiHeadAttention. TimesFM 2.5 applies it
after its rope and query norm, where it cannot go before the split; it goes onto the keys, before the Transpose of
the scores' product (``move_head_dim_scales_to_keys``): both layers fuse too.

``tests/models/heldout/timesfm_{ts,dynamo}.onnx``: ``python -m tests.models.build_heldout_probe heldout_round16
timesfm`` (2 layers, hidden 64, 4 heads of 16, patches of 16 over a context of 64; inputs ``past_values``,
``past_values_padding`` and ``freq``); ``timesfm2_5_{ts,dynamo}.onnx``: the same with ``heldout_round16 timesfm2_5``
(inputs ``past_values`` and ``past_values_padding``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from passes._infra import PassContext, op_histogram
from passes.fusion._query_scale import move_head_dim_scales, move_head_dim_scales_to_keys
from passes.fusion.fuse_transformer import FuseTransformer
from tests.numerics import assert_equivalent
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import session

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "heldout"


@pytest.mark.parametrize("exporter", ["ts", "dynamo"])
def test_timesfm_attention_fuses_with_its_query_scaled_before_the_head_split(exporter: str) -> None:
    path = HELDOUT / f"timesfm_{exporter}.onnx"
    before, _ = fast_upto(path, through="fuse_gqa")
    result = FuseTransformer()(before, PassContext())
    assert result.counts["fused_attention"] == 2, result.non_matches
    assert result.notes["candidates"]["onnxscript"]["query_scales_moved"] == 2
    assert op_histogram(result.model)["com.microsoft::MultiHeadAttention"] == 2
    reference, candidate = session(path), session(result.model, optimized=True)
    rng = np.random.default_rng(0)
    for batch in (1, 3, 5):
        padding = np.zeros((batch, 64), np.float32)
        padding[-1, :20] = 1.0  # the last series' first 20 points are padding
        feeds = {
            "past_values": rng.standard_normal((batch, 64)).astype(np.float32),
            "past_values_padding": padding,
            "freq": rng.integers(0, 3, (batch, 1)).astype(np.int64),
        }
        np.testing.assert_allclose(
            candidate.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-5, err_msg=str(batch)
        )


def _scaled_query(*, into_scores: bool = True, vector: tuple[int, ...] = (1, 1, 1, 4)) -> ir.Model:
    """p [B, S, 8] split into 2 heads of 4, times a constant of shape ``vector``, then ``q @ k^T`` (or, without
    ``into_scores``, the scaled query is the output)."""
    f = TensorProto.FLOAT
    scale = np.linspace(0.5, 2.0, int(np.prod(vector)), dtype=np.float32)
    inits = [
        helper.make_tensor("heads", TensorProto.INT64, [4], [0, 0, 2, 4]),
        helper.make_tensor("scale", f, list(vector), scale),
    ]
    nodes = [
        helper.make_node("Reshape", ["p", "heads"], ["split"]),
        helper.make_node("Transpose", ["split"], ["q"], perm=[0, 2, 1, 3]),
        helper.make_node("Mul", ["q", "scale"], ["q_scaled"]),
    ]
    if into_scores:
        nodes.append(helper.make_node("MatMul", ["q_scaled", "kt"], ["y"]))
    inputs = [helper.make_tensor_value_info("p", f, ["b", "s", 8])]
    if into_scores:
        inputs.append(helper.make_tensor_value_info("kt", f, ["b", 2, 4, "t"]))
    out = "y" if into_scores else "q_scaled"
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(out, f, None)], inits)
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    ir.passes.common.ShapeInferencePass()(model)
    return model


def test_a_per_dimension_scale_moves_before_the_split_computing_the_same() -> None:
    model = _scaled_query()
    assert move_head_dim_scales(model) == 1
    mul = next(n for n in model.graph if n.op_type == "Mul")
    assert mul.inputs[0].name == "p" and mul.outputs[0].uses()[0].node.op_type == "Reshape"
    shapes = [{"p": (b, s, 8), "kt": (b, 2, 4, t)} for b, s, t in ((1, 3, 3), (2, 5, 7))]
    assert_equivalent(_scaled_query(), model, shapes, rtol=1e-6, atol=1e-6)


def test_a_scale_that_feeds_no_scores_or_is_not_per_dimension_is_left() -> None:
    assert move_head_dim_scales(_scaled_query(into_scores=False)) == 0
    assert move_head_dim_scales(_scaled_query(vector=(1, 2, 1, 4))) == 0  # per head too: not over the last axis


@pytest.mark.parametrize("exporter", ["ts", "dynamo"])
def test_timesfm2_5_attention_fuses_with_its_query_scale_moved_onto_the_keys(exporter: str) -> None:
    path = HELDOUT / f"timesfm2_5_{exporter}.onnx"
    before, _ = fast_upto(path, through="range_gather_to_slice")  # fuse_rotary's group is refused in a job
    result = FuseTransformer()(before, PassContext())
    assert result.counts["fused_attention"] == 2, result.non_matches
    onnxscript = result.notes["candidates"]["onnxscript"]
    assert onnxscript["query_scales_to_keys"] == 2 and not onnxscript["query_scales_moved"]
    reference, candidate = session(path), session(result.model, optimized=True)
    rng = np.random.default_rng(1)
    for batch in (1, 3, 4):
        padding = np.zeros((batch, 64), np.float32)
        padding[-1, :40] = 1.0  # two and a half patches of padding: rotary positions below zero
        feeds = {"past_values": rng.standard_normal((batch, 64)).astype(np.float32), "past_values_padding": padding}
        np.testing.assert_allclose(
            candidate.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-5, err_msg=str(batch)
        )


def _scaled_after_rope(*, key_read_twice: bool = False) -> tuple[ir.Model, object]:
    """``q * c[1, 1, 1, 4]`` (an odd function of q stands for the rope and norm before it) against
    ``Transpose(k, [0, 1, 3, 2])``; ``key_read_twice``: k^T is an output too."""
    f = TensorProto.FLOAT
    inits = [helper.make_tensor("scale", f, [1, 1, 1, 4], [0.5, 1.5, 2.0, 0.25])]
    nodes = [
        helper.make_node("Sin", ["q"], ["rotated"]),  # no scale moves through it
        helper.make_node("Mul", ["rotated", "scale"], ["q_scaled"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q_scaled", "kt"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info(n, f, ["b", 2, "s", 4]) for n in ("q", "k")]
    outputs = [helper.make_tensor_value_info("y", f, None)]
    if key_read_twice:
        outputs.append(helper.make_tensor_value_info("kt", f, None))
    proto = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs, inits), opset_imports=[helper.make_opsetid("", 18)]
    )
    model = ir.serde.deserialize_model(proto)
    ir.passes.common.ShapeInferencePass()(model)
    return model, proto


def test_a_scale_the_split_cannot_take_moves_onto_the_keys_computing_the_same() -> None:
    model, proto = _scaled_after_rope()
    assert move_head_dim_scales(model) == 0
    assert move_head_dim_scales_to_keys(model) == 1
    matmul = next(n for n in model.graph if n.op_type == "MatMul")
    assert matmul.inputs[0].name == "rotated"
    assert matmul.inputs[1].producer().inputs[0].producer().op_type == "Mul"  # Transpose(Mul(k, c))
    shapes = [{"q": (b, 2, s, 4), "k": (b, 2, s, 4)} for b, s in ((1, 3), (2, 7))]
    assert_equivalent(proto, model, shapes, rtol=1e-6, atol=1e-6)


def test_a_key_another_node_reads_keeps_the_scale_on_the_query() -> None:
    model, _ = _scaled_after_rope(key_read_twice=True)
    assert move_head_dim_scales_to_keys(model) == 0
