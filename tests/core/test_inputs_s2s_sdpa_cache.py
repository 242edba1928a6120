"""core/inputs on a held-out seq2seq decoder with a KV cache exported by dynamo with SDPA (issue 19 item 1).

``tests/models/heldout/m2m100_with_past_dynamo.onnx``: ``python -m bench.heldout_s2s_past --only m2m100
--exporters dynamo`` (tiny M2M100ForConditionalGeneration from its config: 2 layers, hidden 32, 4 heads; the
decoder_with_past file of Optimum's split export, transformers' SDPA attention, ``torch.onnx.export(dynamo=True)``).
Dynamo's decomposed SDPA reads each cached key as ``Mul(Reshape(Transpose(Reshape(k))), sqrt(scale))`` before
the scores' MatMul, where the values go to their MatMul as they are. The role reader followed three alias steps
and no scaling, so every ``past_key_values.N.encoder.key`` was read as a self-attention cache (its length the
decoder's past), the values as the cross cache, and the encoder mask, reaching no cross-attention scores, as a
mask over past + new tokens: every generated set fed an encoder mask longer than the cross cache it masks
(``1x16`` against ``1x4x8x8``), a call no generation makes, on every dynamo SDPA export of the probe's five
BART-family models.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from core.config import Tolerance
from core.inputs import analyze, generate_input_sets
from workers.verify import Verifier

MODEL = Path(__file__).resolve().parent.parent / "models" / "heldout" / "m2m100_with_past_dynamo.onnx"
LAYERS = 2


def test_every_encoder_cache_is_the_cross_cache_and_the_encoder_mask_masks_it() -> None:
    roles = analyze(onnx.load(str(MODEL))).roles
    for layer in range(LAYERS):
        for kv in ("key", "value"):
            assert roles[f"past_key_values.{layer}.encoder.{kv}"].role == "cross_key_values", (layer, kv)
            assert roles[f"past_key_values.{layer}.decoder.{kv}"].role == "past_key_values", (layer, kv)
    assert roles["encoder_attention_mask"].role == "attention_mask"
    assert roles["encoder_attention_mask"].cross


def test_generated_sets_give_the_mask_and_every_cross_cache_one_encoder_length_apart_from_the_past() -> None:
    sets = generate_input_sets(onnx.load(str(MODEL)), 4)
    assert Verifier(MODEL, sets, Tolerance()).check(MODEL).ok  # the original runs each set
    pasts, encoders = set(), set()
    for input_set in sets:
        feeds = input_set.feeds
        mask = feeds["encoder_attention_mask"]
        ids = feeds["input_ids"]
        for layer in range(LAYERS):
            for kv in ("key", "value"):
                cross = feeds[f"past_key_values.{layer}.encoder.{kv}"]
                own = feeds[f"past_key_values.{layer}.decoder.{kv}"]
                assert cross.shape == (ids.shape[0], 4, mask.shape[1], 8), (input_set.name, layer, kv)
                assert own.shape[2] == feeds["past_key_values.0.decoder.key"].shape[2]
        assert mask[:, 0].all()  # right padding: every row has a valid first encoder position
        pasts.add(feeds["past_key_values.0.decoder.key"].shape[2])
        encoders.add(mask.shape[1])
    assert 0 in pasts and max(pasts) > 0  # the first step after the prompt-less start, and a later one
    assert pasts.isdisjoint(encoders)  # the two lengths never tied, so a mixed-up axis would show
