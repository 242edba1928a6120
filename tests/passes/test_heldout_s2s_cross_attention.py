"""A held-out seq2seq decoder with a KV cache (dynamo, SDPA) through the ``fast`` preset's passes up to
fuse_transformer (issue 19 item 1).

``tests/models/heldout/m2m100_with_past_dynamo.onnx``: ``python -m bench.heldout_s2s_past --only m2m100
--exporters dynamo``, the decoder_with_past file of Optimum's split export of a tiny M2M100 (2 layers, hidden
32, 4 heads, LM head tied to the embedding). Each layer's self attention concatenates its cache with the new
keys; its cross attention reads the encoder's cache as it is, fixed. Both become MultiHeadAttention: the self
attention with ``past_key``/``past_value`` returning the presents, the cross attention with the cached keys
and values as its BNSH key/value inputs (no copy, no Concat). Dynamo's tied head reads
``Transpose(weight, [1, 0])`` straight into a MatMul: a rewrite that reads every Transpose as 3-D must leave it
(one such step made every onnxscript candidate fail and 0 of 4 attentions fuse in the held-out probe).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from passes import registry
from passes._infra import PassContext, op_histogram
from tests.models.build_seq2seq import Arch, seq2seq_feeds
from tests.passes._util import session

MODEL = Path(__file__).resolve().parent.parent / "models" / "heldout" / "m2m100_with_past_dynamo.onnx"
ARCH = Arch("m2m100", "M2M100Config", "M2M100ForConditionalGeneration", layers=2, hidden=32, heads=4, vocab=384)


@pytest.fixture(scope="module")
def fused() -> ir.Model:
    model = ir.load(MODEL)
    specs = registry.PRESETS["fast"].specs
    names = [s.name for s in specs]
    upto = [s for s in specs[: names.index("fuse_transformer") + 1] if s.name != "padding_elimination"]
    for p in registry.build_passes(upto):
        model = p(model, PassContext()).model
    return model


def test_self_attention_with_past_and_cross_attention_on_the_fixed_cache_both_fuse(fused) -> None:
    ops = op_histogram(fused)
    assert ops["com.microsoft::MultiHeadAttention"] == 2 * ARCH.layers
    assert "Softmax" not in ops
    inputs = {
        n.name: [v.name if v is not None else "" for v in n.inputs]
        for n in fused.graph
        if n.op_type == "MultiHeadAttention"
    }
    for layer in range(ARCH.layers):
        self_attn = [i for i in inputs.values() if f"past_key_values.{layer}.decoder.key" in i]
        cross = [i for i in inputs.values() if f"past_key_values.{layer}.encoder.key" in i]
        assert len(self_attn) == 1 and self_attn[0][6:8] == [
            f"past_key_values.{layer}.decoder.{kv}" for kv in ("key", "value")
        ]
        assert len(cross) == 1 and cross[0][1:3] == [f"past_key_values.{layer}.encoder.{kv}" for kv in ("key", "value")]
    onnx.checker.check_model(ir.serde.serialize_model(fused), full_check=True)


def replay_generation(candidate: ir.Model, steps: int) -> dict[str, np.ndarray]:
    """``steps`` decoder calls of the export and ``candidate`` side by side, outputs equal at each: three tokens
    on an empty self cache, then one token at a time on the returned one; the last call's feeds."""
    reference, fused = session(MODEL), session(candidate, optimized=True)
    names = [o.name for o in reference.get_outputs()]
    # batch 2, the encoder's second row a third padding; 9 encoder positions, never the self cache's length
    feeds = seq2seq_feeds(ARCH, "decoder_with_past", 2, dec=3, past=0, enc=9, seed=5)
    cross = {k: v for k, v in feeds.items() if ".encoder." in k}
    for step in range(steps):
        want = dict(zip(names, reference.run(names, feeds), strict=True))
        got = dict(zip(names, fused.run(names, feeds), strict=True))
        for name in names:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=f"{name} step {step}")
        tokens = want["logits"][:, -1:].argmax(-1).astype(np.int64)
        own = {k.replace("present.", "past_key_values.", 1): v for k, v in want.items() if k.startswith("present.")}
        feeds = {"input_ids": tokens, "encoder_attention_mask": feeds["encoder_attention_mask"], **own, **cross}
    return feeds


def test_fused_decoder_computes_what_the_export_does_on_a_growing_self_cache_and_a_fixed_cross_cache(fused) -> None:
    feeds = replay_generation(fused, 5)
    assert feeds["past_key_values.0.decoder.key"].shape[2] == 3 + 4  # the self cache grew, the cross one did not
