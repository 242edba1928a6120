"""Conditional DETR's attention fuses (issue 17, held-out probe round 9: 0 of 3 under both exporters).

Its decoder adds a position term to each projection (``q = q_content + q_pos``, ``k = k_content + k_pos``: tensors
of rank 3, not 1-D biases). onnxscript's ``mha_bias`` rule read those Adds as projection biases and concatenated
them with 1-D ones into MultiHeadAttention's ``bias``: a Concat of ranks 3 and 1, so the whole onnxscript candidate
failed to load and every fusion in it, attention and SkipLayerNormalization alike, was lost. The adapter's
``mha_bias`` rule now fuses only 1-D biases (``_mha_bias_order.not_projection_biases``).

``tests/models/heldout/conditional_detr_{ts,dynamo}.onnx``: ``python -m tests.models.build_heldout_round9`` (a
ResNet backbone, 1 encoder and 1 decoder layer, hidden 32, 2 heads, 8 queries, 64 x 64 images). Compared with the
original under ORT, graph optimizations off, at batches other than the export's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx_ir.passes.common import ShapeInferencePass

from passes._infra import PassContext, op_histogram
from passes.fusion import _onnxscript_adapter as adapter
from passes.fusion.fuse_transformer import FuseTransformer
from tests.numerics import assert_equivalent
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import parse, session

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "heldout"


def _images(batch: int, seed: int) -> dict[str, np.ndarray]:
    return {"pixel_values": np.random.default_rng(seed).standard_normal((batch, 3, 64, 64)).astype(np.float32)}


@pytest.mark.parametrize("stem", ["conditional_detr_ts", "conditional_detr_dynamo"])
def test_every_attention_and_residual_norm_fuses(stem: str) -> None:
    path = HELDOUT / f"{stem}.onnx"
    model, _ = fast_upto(path)
    samples = [_images(batch, batch) for batch in (1, 2)]
    result = FuseTransformer({"engines": ["onnxscript"]})(model, PassContext(samples=samples))
    ops = op_histogram(result.model)
    assert result.counts["fused_attention"] == 3 and result.counts["fused_skip_layer_norm"] == 5
    assert "Softmax" not in ops
    assert ops["com.microsoft::MultiHeadAttention"] + ops["com.microsoft::Attention"] == 3
    shapes = [{"pixel_values": (batch, 3, 64, 64)} for batch in (1, 3)]
    assert_equivalent(path, result.model, shapes, rtol=1e-4, atol=1e-5, n_random=0)


MHA = """
<ir_version: 9, opset_import: ["" : 18, "com.microsoft" : 1]>
g (float[B, S, 8] x, float[B, S, 8] pos) => (float[B, S, 8] y)
  <float[8, 8] wq = {%s}, float[8, 8] wk = {%s}, float[8, 8] wv = {%s}, float[8] bq = {%s}> {
    q0 = MatMul(x, wq)
    q = Add(q0, bq)
    k0 = MatMul(x, wk)
    k = Add(k0, %s)
    v = MatMul(x, wv)
    y = com.microsoft.MultiHeadAttention <num_heads = 2> (q, k, v)
}
"""


def _mha(key_term: str) -> ir.Model:
    rng = np.random.default_rng(0)
    values = [", ".join(f"{v:.3f}" for v in rng.standard_normal(n)) for n in (64, 64, 64, 8)]
    model = ir.serde.deserialize_model(parse(MHA % (*values, key_term), check=False))
    ShapeInferencePass()(model)  # the rule reads the projections' shapes, as fuse_for_ort runs it
    return model


@pytest.mark.parametrize(("key_term", "fused"), [("pos", 0), ("bq", 1)])
def test_only_one_dimensional_biases_join_multi_head_attention(key_term: str, fused: int) -> None:
    model = _mha(key_term)
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((2, 5, 8)).astype(np.float32) for n in ("x", "pos")}
    want = session(model).run(None, feeds)[0]
    assert adapter.rule_set("mha_bias").apply_to_model(model) == fused
    np.testing.assert_allclose(session(model).run(None, feeds)[0], want, rtol=1e-5, atol=1e-5)
