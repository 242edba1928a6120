"""OpenAI's privacy filter: bidirectional attention with sinks, left unfused with the measured reason (issue 17,
held-out decoder round 9).

Its scores take a sink column, ``Softmax(Concat(q @ k^T * s + mask, sink) - max)[..., :-1] @ v``, over a band of
keys either way. GroupQueryAttention takes sinks but causal only. ``_sink_column.as_extra_key`` writes the sink as
one more key (a zero row of k and v, the sink in that column of the mask), which fuse_transformer's rules then fuse
as MultiHeadAttention with an ``attention_bias`` of ``[B, H, S, T + 1]``, exactly; measured slower than the unfused
attention (``bench/sink_attention_ab.py``), so no pass applies it and the report says why.

``tests/models/heldout/openai_privacy_filter_{ts_eager,dynamo}.onnx``: ``python -m tests.models.build_heldout_probe
heldout_dec_round9 openai_privacy_filter`` (2 layers, hidden 32, 4 heads of 8, 2 kv heads, a window of 64).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from passes._infra import PassContext, op_histogram
from passes.fusion import _sink_column
from passes.fusion.fuse_transformer import FuseTransformer
from tests.numerics import assert_equivalent
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import session

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "heldout"


def _feeds(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    """Ids and a mask whose last row is padded from 60% of its length."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    if batch > 1:
        mask[-1, int(seq * 0.6) :] = 0
    return {"input_ids": rng.integers(5, 384, (batch, seq)).astype(np.int64), "attention_mask": mask}


@pytest.mark.parametrize("exporter", ["ts_eager", "dynamo"])
def test_the_privacy_filters_attention_is_left_with_the_measured_reason(exporter: str) -> None:
    path = HELDOUT / f"openai_privacy_filter_{exporter}.onnx"
    before, _ = fast_upto(path, through="fuse_gqa")
    result = FuseTransformer()(before, PassContext())
    assert not result.counts.get("fused_attention")
    missing = result.notes["missing"]["attention"]
    assert "left unfused by design" in missing and "attention sink as a softmax column" in missing, missing
    assert "bench/sink_attention_ab.py" in missing


@pytest.mark.parametrize("exporter", ["ts_eager", "dynamo"])
def test_written_as_one_more_key_the_attention_fuses_exactly(exporter: str) -> None:
    path = HELDOUT / f"openai_privacy_filter_{exporter}.onnx"
    model = ir.load(path)
    ir.passes.common.ShapeInferencePass()(model)
    assert _sink_column.as_extra_key(model) == 2
    fused = FuseTransformer()(model, PassContext())
    assert fused.counts["fused_attention"] == 2
    histogram = op_histogram(fused.model)
    assert histogram["com.microsoft::MultiHeadAttention"] == 2
    assert histogram["Softmax"] == 2  # the routers' only
    reference, candidate = session(path), session(fused.model, optimized=True)
    for batch, seq in ((1, 5), (2, 40), (3, 70)):  # 70: beyond the band of 64 either way
        feeds = _feeds(batch, seq, seed=seq)
        np.testing.assert_allclose(
            candidate.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-5, err_msg=f"{batch}x{seq}"
        )


def _sink_attention(*, masked: bool, cut: tuple[int, int] = (0, -1)) -> ir.Model:
    """``Softmax(Concat(q @ k^T / 2 (+ mask), sink) - max)[..., cut] @ v`` over q, k, v [B, 2, S, 4] and a sink
    per head; ``cut`` (1, end) keeps the other columns, which is no sink."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inits = [
        helper.make_tensor("half", f, [], [0.5]),
        helper.make_tensor("sinks", f, [1, 2, 1, 1], [0.3, -1.2]),
        helper.make_tensor("start", i64, [1], [cut[0]]),
        helper.make_tensor("end", i64, [1], [cut[1]]),
        helper.make_tensor("last", i64, [1], [-1]),
        helper.make_tensor("one", i64, [1], [1]),
    ]
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "half"], ["scores" if not masked else "scaled"]),
        helper.make_node("Shape", ["q"], ["rows"], start=0, end=3),
        helper.make_node("Concat", ["rows", "one"], ["column_shape"], axis=0),
        helper.make_node("Expand", ["sinks", "column_shape"], ["column"]),
        helper.make_node("Concat", ["scores", "column"], ["joined"], axis=-1),
        helper.make_node("ReduceMax", ["joined", "last"], ["top"], keepdims=1),
        helper.make_node("Sub", ["joined", "top"], ["shifted"]),
        helper.make_node("Softmax", ["shifted"], ["probs"], axis=-1),
        helper.make_node("Slice", ["probs", "start", "end", "last"], ["kept"]),
        helper.make_node("MatMul", ["kept", "v"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info(n, f, ["b", 2, "s", 4]) for n in ("q", "k", "v")]
    if masked:
        nodes.insert(3, helper.make_node("Add", ["scaled", "mask"], ["scores"]))
        inputs.append(helper.make_tensor_value_info("mask", f, ["b", 1, "s", "s"]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", f, None)], inits)
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    ir.passes.common.ShapeInferencePass()(model)
    return model


@pytest.mark.parametrize("masked", [True, False])
def test_a_sink_column_becomes_a_zero_key_computing_the_same(masked: bool) -> None:
    model = _sink_attention(masked=masked)
    assert _sink_column.as_extra_key(model) == 1
    histogram = op_histogram(model)
    assert "Slice" not in histogram and "ReduceMax" not in histogram
    shapes = [{"q": (b, 2, s, 4), "k": (b, 2, s, 4), "v": (b, 2, s, 4)} for b, s in ((1, 3), (2, 7))]
    if masked:
        shapes = [{**shape, "mask": (shape["q"][0], 1, shape["q"][2], shape["q"][2])} for shape in shapes]
    assert_equivalent(_sink_attention(masked=masked), model, shapes, rtol=1e-5, atol=1e-6)


def test_a_slice_that_keeps_the_other_columns_is_no_sink() -> None:
    model = _sink_attention(masked=False, cut=(1, 2**62))
    assert _sink_column.as_extra_key(model) == 0
    assert op_histogram(model)["Slice"] == 1
