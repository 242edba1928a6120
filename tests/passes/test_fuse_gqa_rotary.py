"""fuse_gqa and fuse_rotary compose in either order: fuse_gqa treats rotated q and k as opaque values, so the
RotaryEmbedding nodes fuse_rotary makes (before or after it) feed GroupQueryAttention unchanged. Checked on
TorchScript and dynamo exports, full and partial rotary (Phi-3), a window (Mistral), with and without a
cache, against the original under ORT with graph optimizations off at lengths other than the export's."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from passes.fusion.fuse_gqa import FuseGqa
from tests.models.build_decoders import OUT, Signature, decoder_feeds, presents_as_past
from tests.passes.test_fuse_gqa import ATOL, run, session

rotary = pytest.importorskip("passes.fusion.fuse_rotary")
NAMES = ["llama_past_ts", "llama_past_dynamo", "phi3_past_ts", "mistral_past_dynamo", "qwen2_nopast_ts"]


@pytest.mark.parametrize("rotary_first", [True, False], ids=["rotary_then_gqa", "gqa_then_rotary"])
@pytest.mark.parametrize("name", NAMES)
def test_fuse_gqa_composes_with_fuse_rotary_when_run_in_either_order(name, rotary_first):
    # setup
    path = OUT / f"{name}.onnx"
    model = ir.load(path)
    passes = [rotary.FuseRotary(), FuseGqa()]
    # execute
    for p in passes if rotary_first else passes[::-1]:
        model = p(model).model
    # assert
    ops = op_histogram(model)
    assert ops["com.microsoft::GroupQueryAttention"] == 2 and ops["com.microsoft::RotaryEmbedding"] > 0
    assert "Softmax" not in ops
    signature = Signature.of(path)
    reference, candidate = session(str(path)), session(model)
    for index, (batch, seq, past) in enumerate(((2, 5, 0), (1, 1, 17), (1, 3, 9))):
        feeds = decoder_feeds(signature, batch, seq, past if signature.layers else 0, seed=index)
        want, got = run(reference, feeds), run(candidate, feeds)
        for key, expected in want.items():
            np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=f"{key} at {batch}x{seq}+{past}")


@pytest.mark.parametrize("name", ["llama_past_ts", "qwen2_past_dynamo", "phi3_past_ts", "mistral_past_ts"])
def test_fuse_gqa_rotates_flat_q_and_k_without_transposes_when_rotary_fused_first(name):
    # setup: fuse_rotary makes heads-first RotaryEmbedding on Transpose(0,2,1,3) of [B,S,N,D]
    path = OUT / f"{name}.onnx"
    model = rotary.FuseRotary()(ir.load(path)).model
    # execute
    model = FuseGqa()(model).model
    # assert: every RotaryEmbedding reads the flat [B,S,N*D] projection (num_heads set) and feeds GQA directly
    gqa_inputs = {id(v) for n in model.graph if n.op_type == "GroupQueryAttention" for v in n.inputs[:2]}
    rotaries = [n for n in model.graph if n.op_type == "RotaryEmbedding"]
    assert rotaries and all(n.attributes.get_int("num_heads", 0) > 0 for n in rotaries)
    assert all(id(n.outputs[0]) in gqa_inputs for n in rotaries)
    assert not any(n.op_type == "Transpose" for r in rotaries for n in [r.inputs[0].producer()] if n is not None)
    assert "Transpose" not in op_histogram(model)  # v, q and k all enter GQA through Reshapes only
    # and exact: prefill, a prompt after a cache, then decode steps on the fused model's own cache
    signature = Signature.of(path)
    reference, candidate = session(str(path)), session(model)
    feeds = decoder_feeds(signature, 2, 6, 0, seed=3)
    want, got = run(reference, feeds), run(candidate, feeds)
    for past in range(6, 9):
        for key, expected in want.items():
            np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=f"{key} at past {past}")
        ids = np.random.default_rng(past).integers(0, signature.vocab, size=(2, 1), dtype=np.int64)
        want = run(reference, decoder_feeds(signature, 2, 1, past, tokens=ids, past_values=presents_as_past(want)))
        got = run(candidate, decoder_feeds(signature, 2, 1, past, tokens=ids, past_values=presents_as_past(got)))
    feeds = decoder_feeds(signature, 1, 4, 11, seed=4)
    want, got = run(reference, feeds), run(candidate, feeds)
    for key, expected in want.items():
        np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=f"{key} prompt after past")
