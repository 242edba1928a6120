"""fuse_gqa on multi-query attention whose single key/value head is never repeated (issue 17, held-out
decoders: ``bench/heldout_dec_nocache.py``).

Falcon's eager attention (``multi_query=True``, the Falcon-7B layout) multiplies q [B, H, S, D] by k^T
[B, 1, D, S] and lets MatMul broadcast the head axis; there is no repeat_kv for the matcher to find. The probe
declined every layer ("repeated key/value (1, 1, 3, 8) are not (1, 4, 3, 8) from 1 kv heads") and the fast
preset left the Softmax attention. The file is that model without a cache (2 layers, hidden 32, 4 query
heads, 1 kv head, rotary, random weights: ``python -m bench.heldout_dec_nocache --only falcon --exporters
ts_eager``); numerics against the export under ORT with graph optimizations off at batches and lengths other
than the export's (2 x 16).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_gqa import FuseGqa
from tests.numerics import reference_session, run_named
from tests.passes._util import MODELS

PATH = MODELS / "heldout_falcon_mqa_ts_eager.onnx"
LAYERS, HEADS, VOCAB = 2, 4, 384
SHAPES = ((1, 1), (1, 9), (3, 23), (2, 64))


def test_fuse_gqa_fuses_multi_query_attention_when_the_kv_head_is_broadcast_by_matmul():
    # setup
    model = ir.load(PATH)
    # execute
    result = FuseGqa()(model)
    # assert: one GroupQueryAttention per layer reading the single kv head, no Softmax left
    ops = op_histogram(result.model)
    assert result.counts["fused_gqa"] == LAYERS and not result.non_matches, result.non_matches
    assert ops["com.microsoft::GroupQueryAttention"] == LAYERS and "Softmax" not in ops
    for node in (n for n in result.model.graph if n.op_type == "GroupQueryAttention"):
        assert node.attributes.get_int("num_heads") == HEADS
        assert node.attributes.get_int("kv_num_heads") == 1
    reference, fused = reference_session(PATH), reference_session(result.model)
    rng = np.random.default_rng(0)
    for batch, seq in SHAPES:
        feeds = {
            "input_ids": rng.integers(5, VOCAB, (batch, seq)).astype(np.int64),
            "attention_mask": np.ones((batch, seq), np.int64),
        }
        want, got = run_named(reference, feeds)["logits"], run_named(fused, feeds)["logits"]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"at {batch} x {seq}")


def test_fuse_gqa_leaves_multi_query_layers_unfused_when_samples_are_padded():
    """Padded samples rule GroupQueryAttention out (it places each row's tokens by its count); the fallback,
    MultiHeadAttention, needs one key/value head per query head, which this graph never builds: each layer
    stays as exported, with both reasons, and the model computes what it did."""
    # setup: a right-padded batch as a user uploads it
    feeds = {
        "input_ids": np.random.default_rng(1).integers(5, VOCAB, (3, 9)).astype(np.int64),
        "attention_mask": np.ones((3, 9), np.int64),
    }
    feeds["attention_mask"][1, 5:] = 0
    # execute
    result = FuseGqa()(ir.load(PATH), PassContext(samples=[feeds]))
    # assert
    ops = op_histogram(result.model)
    assert not result.counts.get("fused_gqa") and not result.counts.get("fused_mha"), result.counts
    assert ops["Softmax"] == LAYERS and "com.microsoft::MultiHeadAttention" not in ops
    assert len(result.non_matches) == LAYERS
    assert all("padded" in m.reason and "broadcast" in m.reason for m in result.non_matches), result.non_matches
    want = run_named(reference_session(PATH), feeds)["logits"]
    np.testing.assert_allclose(run_named(reference_session(result.model), feeds)["logits"], want, atol=1e-6)
