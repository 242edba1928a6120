"""BLOOM's ALiBi attention becomes ``MultiHeadAttention`` with ALiBi + mask as ``attention_bias`` (issue 17/19).

The held-out probe (bench/heldout_dec_nocache.py) found BLOOM's attention fused in no export: its scores are
``baddbmm(alibi, q, k^T, beta=1, alpha=1/sqrt(d))`` on the heads folded into the batch, exported as
``Add(Mul(MatMul(q3, kT3), alpha), alibi [B*h, 1, T])`` and unfolded to ``[B, h, S, T]`` for the mask.
``_batched_heads`` now distributes the unfold over a term that broadcasts over the queries (reshaped to
``[B, h, 1, T]``) and moves a scalar applied to the folded product after the 4-D product, so onnxscript's
SDPA rule sees ``Softmax(scale * q k^T + alibi + mask) v``. ``heldout_bloom_{ts_eager,dynamo}.onnx`` are
``python -m bench.heldout_dec_nocache --only bloom --exporters ts_eager dynamo`` (2 layers, hidden 32, 4 heads).

With a cache (``heldout/bloom_past_ts.onnx``, ``python -m bench.heldout_dec_past --only bloom --exporters ts``)
the same fusion takes ``Concat(past, new)`` keys and values in ``[B, N, T, H]``; ``_mha_kv_layout`` hands them
to MultiHeadAttention as they are instead of the ``[B, T, N*H]`` copy onnxscript's rule makes of them.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from passes.fusion._batched_heads import unfold_batched_heads
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, parse, session

LAYERS = 2


def _feeds(batch: int, seq: int, seed: int, padding: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, 384, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    if padding == "right":
        mask[-1, seq // 2 :] = 0
    elif padding == "left":
        mask[0, : seq // 3] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("exporter", ["ts_eager", "dynamo"])
def test_bloom_alibi_attention_becomes_multi_head_attention(exporter):
    path = MODELS / f"heldout_bloom_{exporter}.onnx"
    result = FuseTransformer({"engines": ["onnxscript"]})(ir.load(path))
    ops = op_histogram(result.model)
    assert result.counts["fused_attention"] == LAYERS
    assert ops["com.microsoft::MultiHeadAttention"] == LAYERS and "Softmax" not in ops
    assert "attention" not in result.notes["missing"]
    reference, fused = session(str(path)), session(result.model)
    # lengths other than the export's (16), right and left padded rows
    for seed, (batch, seq, padding) in enumerate(((1, 5, "none"), (3, 23, "right"), (2, 40, "left"), (4, 9, "right"))):
        feeds = _feeds(batch, seq, seed, padding)
        want = reference.run(None, feeds)[0]
        got = fused.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{batch}x{seq} {padding}")


# the folded form alone: q3, k3, v3 = [B*h, S, d] folds of 4-D q, k, v; ``bias`` (folded as ALiBi is, from
# [B, h, 1, S], or a [1, 1, S] input) is added to the scaled scores
FOLDED = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, 4, S, 8] q, float[B, 4, S, 8] k, float[B, 4, S, 8] v, float[%s] alibi) => (float[B, 4, S, 8] y)
<float alpha = {0.35355339}, int64[1] minus = {-1}, int64[1] four = {4}> {
    %s
    tail = Shape <start = 2> (q)
    fold = Concat <axis = 0> (minus, tail)
    q3 = Reshape(q, fold)
    k3 = Reshape(k, fold)
    v3 = Reshape(v, fold)
    kt = Transpose <perm = [0, 2, 1]> (k3)
    s3 = MatMul(q3, kt)
    scaled = Mul(s3, alpha)
    biased = Add(scaled, bias)
    b = Shape <start = 0, end = 1> (q)
    rows = Shape <start = 2, end = 3> (q)
    unfold = Concat <axis = 0> (b, four, rows, rows)
    s4 = Reshape(biased, unfold)
    p4 = Softmax <axis = -1> (s4)
    p_tail = Shape <start = 2> (p4)
    p_fold = Concat <axis = 0> (minus, p_tail)
    p3 = Reshape(p4, p_fold)
    o3 = MatMul(p3, v3)
    q_shape = Shape(q)
    o4 = Reshape(o3, q_shape)
    y = Identity(o4)
}
"""
FOLD_ALIBI = """alibi_tail = Shape <start = 2> (alibi)
    alibi_fold = Concat <axis = 0> (minus, alibi_tail)
    bias = Reshape(alibi, alibi_fold)"""


def _folded(alibi_shape: str) -> ir.Model:
    import onnx_ir.passes.common as common_passes

    from passes.fusion import _symbolic_shapes as symbolic_shapes

    fold = FOLD_ALIBI if alibi_shape.count(",") == 3 else "bias = Identity(alibi)"
    model = ir.serde.deserialize_model(symbolic_shapes.infer(parse(FOLDED % (alibi_shape, fold)), {}))
    common_passes.ShapeInferencePass()(model)
    return model


def test_alibi_term_broadcast_over_queries_is_unfolded_per_head():
    original, model = _folded("B, 4, 1, S"), _folded("B, 4, 1, S")
    # both products become 4-D (scores and probabilities times v): no folded MatMul is left
    assert unfold_batched_heads(model) == 2
    matmuls = [n for n in model.graph if n.op_type == "MatMul"]
    assert len(matmuls) == 2 and all(n.outputs[0].shape.rank() == 4 for n in matmuls)
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    added = softmax.inputs[0].producer()
    assert added.op_type == "Add" and {v.producer().op_type for v in added.inputs} == {"Mul", "Reshape"}
    reference, rewritten = session(original), session(model)
    rng = np.random.default_rng(0)
    for batch, seq in ((1, 3), (2, 11), (3, 6)):
        feeds = {name: rng.standard_normal((batch, 4, seq, 8)).astype(np.float32) for name in ("q", "k", "v")}
        feeds["alibi"] = rng.standard_normal((batch, 4, 1, seq)).astype(np.float32)
        np.testing.assert_allclose(rewritten.run(None, feeds)[0], reference.run(None, feeds)[0], atol=1e-6)


def test_term_broadcast_over_the_folded_heads_is_not_distributed():
    # [1, 1, S] is the same for every (batch, head): reshaping it as [-1, 4, 1, S] would fail; it stays folded
    model = _folded("1, 1, S")
    unfold_batched_heads(model)
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    assert softmax.inputs[0].producer().op_type == "Reshape"
    assert softmax.inputs[0].producer().inputs[0].producer().op_type == "Add"


def _past_feeds(model: ir.Model, batch: int, seq: int, cached: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, cached + seq), np.int64)
    mask[0, : (cached + seq) // 3] = 0  # left padding, as a batch of unequal prompts is generated
    feeds = {"input_ids": rng.integers(5, 256, size=(batch, seq), dtype=np.int64), "attention_mask": mask}
    for value in model.graph.inputs:
        if value.name.startswith("past_key_values."):
            heads, dim = value.shape[1], value.shape[3]
            feeds[value.name] = rng.standard_normal((batch, heads, cached, dim)).astype(np.float32)
    return feeds


def test_bloom_with_a_cache_reads_its_cache_in_place():
    # Optimum's text-generation-with-past signature (no position_ids), ``python -m bench.heldout_dec_past
    # --only bloom --exporters ts``: the keys and values are Concat(past, new) in [B, N, T, H]
    path = MODELS / "heldout" / "bloom_past_ts.onnx"
    original = ir.load(path)
    result = FuseTransformer({"engines": ["onnxscript"]})(ir.load(path))
    ops = op_histogram(result.model)
    assert result.counts["fused_attention"] == LAYERS
    assert ops["com.microsoft::MultiHeadAttention"] == LAYERS and "Softmax" not in ops
    assert result.notes["candidates"]["onnxscript"]["onnxscript_counts"]["heads_first_kv"] == LAYERS
    for node in result.model.graph:
        if node.op_type == "MultiHeadAttention":
            # the cache Concat itself, not a [B, T, N*H] copy of it
            assert [node.inputs[i].producer().op_type for i in (1, 2)] == ["Concat", "Concat"]
            assert node.inputs[1].shape.rank() == 4
    reference, fused = session(str(path)), session(result.model)
    # a prefill on an empty cache, a prefill after a cache, decode steps after short and long caches
    for seed, (batch, seq, cached) in enumerate(((1, 5, 0), (3, 11, 0), (2, 4, 9), (2, 1, 7), (4, 1, 40))):
        feeds = _past_feeds(original, batch, seq, cached, seed)
        for got, want in zip(fused.run(None, feeds), reference.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{batch}x{seq}+{cached}")


HEADS_FIRST = """
<ir_version: 9, opset_import: ["" : 18, "com.microsoft" : 1]>
g (float[B, S, 32] q, float[B, 4, T, 8] k4, float[B, 4, T, 8] v4) => (float[B, S, 32] y)
<int64[3] merged = {0, 0, 32}> {
    kt = Transpose <perm = %s> (k4)
    k = Reshape(kt, merged)
    vt = Transpose <perm = [0, 2, 1, 3]> (v4)
    v = Reshape(vt, merged)
    y = com.microsoft.MultiHeadAttention <num_heads = %d> (q, k, v)
}
"""


def _heads_first(perm: str, heads: int) -> ir.Model:
    import onnx_ir.passes.common as common_passes

    model = ir.serde.deserialize_model(parse(HEADS_FIRST % (perm, heads), check=False))
    common_passes.ShapeInferencePass()(model)
    return model


def test_multi_head_attention_reads_heads_first_key_and_value():
    from passes.fusion._mha_kv_layout import read_heads_first_kv

    original, model = _heads_first("[0, 2, 1, 3]", 4), _heads_first("[0, 2, 1, 3]", 4)
    assert read_heads_first_kv(model) == 1
    assert "Transpose" not in op_histogram(model) and "Reshape" not in op_histogram(model)
    reference, rewritten = session(original), session(model)
    rng = np.random.default_rng(0)
    for batch, seq, total in ((1, 1, 9), (3, 5, 5), (2, 1, 33)):
        feeds = {
            "q": rng.standard_normal((batch, seq, 32)).astype(np.float32),
            "k4": rng.standard_normal((batch, 4, total, 8)).astype(np.float32),
            "v4": rng.standard_normal((batch, 4, total, 8)).astype(np.float32),
        }
        np.testing.assert_allclose(rewritten.run(None, feeds)[0], reference.run(None, feeds)[0], atol=1e-6)


@pytest.mark.parametrize(("perm", "heads"), [("[0, 2, 1, 3]", 2), ("[0, 1, 2, 3]", 4)])
def test_other_layouts_keep_their_transpose(perm, heads):
    from passes.fusion._mha_kv_layout import read_heads_first_kv

    # num_heads not the source's dim 1, or a Transpose that does not put the heads first: not [B, N, T, H]
    model = _heads_first(perm, heads)
    assert read_heads_first_kv(model) == 0
    assert op_histogram(model)["Transpose"] == 2
