"""fuse_gqa on soft-capped attention scores (issue 17, held-out decoders: ``bench/heldout_dec_nocache.py``).

Gemma 2 caps each layer's scaled scores as ``cap * tanh(scores / cap)`` before the mask and the Softmax; the
matcher expected the scale's Mul right under the mask ("expected MatMul(q, k^T) under the scale; found Tanh")
and the fast preset left both layers unfused on every exporter. GroupQueryAttention applies the same cap
(its ``softcap`` attribute) at the same point. The file is Gemma 2 without a cache from the dynamo exporter (2
layers, hidden 32, 4 heads / 2 kv heads of 8, ``attn_logit_softcapping=50``, ``final_logit_softcapping=30``,
a sliding window of 8 on layer 0, random weights: ``python -m bench.heldout_dec_nocache --only gemma2
--exporters dynamo``).

The tiny model's scores are far below a cap of 50, where the cap is nearly the identity; the numerics are
also run with the attention cap lowered to one the scores exceed, so that a fused graph without the cap fails.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import numpy_helper

from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_gqa import FuseGqa
from tests.numerics import reference_session, run_named
from tests.passes._util import MODELS

PATH = MODELS / "heldout_gemma2_softcap_dynamo.onnx"
LAYERS, HEADS, KV_HEADS, VOCAB, CAP = 2, 4, 2, 384, 50.0
SHAPES = ((1, 1), (1, 8), (1, 9), (3, 23), (2, 40))  # around and past the window of 8


def _capped(cap: float) -> onnx.ModelProto:
    """The export with its attention cap (the divisor of the scores under each Tanh, 50) set to ``cap``."""
    proto = onnx.load(PATH)
    producers = {o: n for n in proto.graph.node for o in n.output}
    caps = set()
    for node in proto.graph.node:
        div = producers.get(node.input[0]) if node.op_type == "Tanh" else None
        if div is not None and div.op_type == "Div":
            caps.add(div.input[1])
    found = 0
    for init in proto.graph.initializer:
        if init.name in caps and float(numpy_helper.to_array(init)) == CAP:
            init.CopyFrom(numpy_helper.from_array(np.array(cap, np.float32), init.name))
            found += 1
    assert found == 1, found  # one shared scalar for both layers in this export
    return proto


def _feeds(batch: int, seq: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    ids = rng.integers(5, VOCAB, (batch, seq)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((batch, seq), np.int64)}


@pytest.mark.parametrize("cap", [CAP, 0.005])
def test_fuse_gqa_fuses_soft_capped_attention_into_groupqueryattention_softcap(cap):
    # setup
    proto = _capped(cap)
    uncapped = reference_session(_capped(1e6))
    # execute
    result = FuseGqa()(ir.serde.deserialize_model(proto))
    # assert: every layer GQA with the cap; the Tanh left is the final logits' cap (30), not attention's
    ops = op_histogram(result.model)
    assert result.counts["fused_gqa"] == LAYERS and not result.non_matches, result.non_matches
    assert "Softmax" not in ops and ops["Tanh"] == 1 + LAYERS  # + GELU's Tanh per layer (fused later)
    gqa = [n for n in result.model.graph if n.op_type == "GroupQueryAttention"]
    assert [n.attributes.get_float("softcap") for n in gqa] == pytest.approx([cap] * LAYERS)
    assert {n.attributes.get_int("kv_num_heads") for n in gqa} == {KV_HEADS}
    reference, fused = reference_session(proto), reference_session(result.model)
    rng = np.random.default_rng(0)
    for batch, seq in SHAPES:
        feeds = _feeds(batch, seq, rng)
        want = run_named(reference, feeds)["logits"]
        np.testing.assert_allclose(run_named(fused, feeds)["logits"], want, rtol=1e-4, atol=1e-5)
        if cap < 1 and seq > 1:  # the lowered cap binds: without it the model computes something else
            assert np.max(np.abs(run_named(uncapped, feeds)["logits"] - want)) > 1e-4  # 10x the tolerance


def test_fuse_gqa_declines_multiheadattention_for_soft_capped_scores_when_samples_are_padded():
    # setup: a right-padded batch rules GroupQueryAttention out; MultiHeadAttention has no cap
    feeds = _feeds(3, 9, np.random.default_rng(1))
    feeds["attention_mask"][1, 5:] = 0
    # execute
    result = FuseGqa()(ir.load(PATH), PassContext(samples=[feeds]))
    # assert: left as exported, each layer with the reason
    ops = op_histogram(result.model)
    assert ops["Softmax"] == LAYERS and "com.microsoft::MultiHeadAttention" not in ops
    assert len(result.non_matches) == LAYERS
    assert all("soft-capped" in m.reason for m in result.non_matches), result.non_matches
    want = run_named(reference_session(PATH), feeds)["logits"]
    np.testing.assert_allclose(run_named(reference_session(result.model), feeds)["logits"], want, atol=1e-6)
