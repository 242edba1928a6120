"""fuse_gqa on keys transposed once from [B,S,N,D] after a partial rotary joined them on the head dim (issue 17,
held-out decoders: ``bench/heldout_dec_nocache.py``).

GPT-J rotates the first ``rotary_dim`` channels of q and k in the [B,S,N,D] layout and joins them to the rest
with ``Concat(axis=-1)`` before its permute; the dynamo export then reaches k^T with one
``Transpose(0,2,3,1)``. The matcher declined any Concat under such keys as a cache ("found keys transposed
straight from [B,S,N,D] but repeated or concatenated with a cache"), so the fast preset fell back to
onnxscript's MultiHeadAttention and the job measured a tie and returned the upload. A Concat on the head dim
is not a cache. The file is GPT-J without a cache from the dynamo exporter (2 layers, hidden 32, 4 heads of 8,
``rotary_dim=4``, random weights: ``python -m bench.heldout_dec_nocache --only gptj --exporters dynamo``);
numerics against the export under ORT with graph optimizations off at batches and lengths other than the
export's (2 x 16).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes._infra import op_histogram
from passes.fusion.fuse_gqa import FuseGqa
from tests.numerics import reference_session, run_named
from tests.passes._util import MODELS

PATH = MODELS / "heldout_gptj_partial_rotary_dynamo.onnx"
LAYERS, HEADS, VOCAB = 2, 4, 384
SHAPES = ((1, 1), (1, 9), (3, 23), (2, 64))


def test_fuse_gqa_fuses_keys_transposed_from_bsnd_when_partial_rotary_joins_the_head_dim():
    # setup
    model = ir.load(PATH)
    # execute
    result = FuseGqa()(model)
    # assert: one GroupQueryAttention per layer, no Softmax left
    ops = op_histogram(result.model)
    assert result.counts["fused_gqa"] == LAYERS and not result.non_matches, result.non_matches
    assert ops["com.microsoft::GroupQueryAttention"] == LAYERS and "Softmax" not in ops
    for node in (n for n in result.model.graph if n.op_type == "GroupQueryAttention"):
        assert node.attributes.get_int("num_heads") == node.attributes.get_int("kv_num_heads") == HEADS
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
