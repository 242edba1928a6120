"""Held-out probe (issue 17), round 14: encoders no round had sent: ESM-C (protein language model), SigLIP 2's
and AIMv2's text towers, FlauBERT, the encoders of Blenderbot (norms before each block), MVP, PLBart and LED
(Longformer's windowed and global attention), PVT v1 (keys and values spatially reduced, a class token on its
last stage), SAM's image encoder (windowed attention with decomposed relative positions), Pixio and Sapiens 2
(ViTs with several class or register tokens; Sapiens 2 with rope, q/k norms and a gated MLP), and the GLM-ASR
and LASR speech encoders (log-mel features).

Run ``python -m bench.heldout_round14 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; 2 layers, hidden 64, 4 heads, weights perturbed),
exported with the TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch at two other
sizes. Text models take ``input_ids`` and ``attention_mask [batch, sequence]`` (a padded row); the image models
``pixel_values [batch, 3, 64, 64]``; the speech encoders ``input_features``, GLM-ASR's ``[batch, 16, 128]``
(Whisper's fixed length), LASR's ``[batch, frames, 16]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round14"
VOCAB, HIDDEN = 256, 64
_SMALL = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "max_position_embeddings": 128}  # fmt: skip
_SEQ2SEQ = {"vocab_size": VOCAB, "d_model": HIDDEN, "encoder_layers": 2, "decoder_layers": 2,
            "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128}  # fmt: skip
_IMAGE = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 64, "patch_size": 8}


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module, fixed_images, image_hidden
    from bench.heldout_round12 import hidden, padded

    batch_seq = ((0, "batch"), (1, "sequence"))
    batch_axis = ((0, "batch"),)
    names = ("input_ids", "attention_mask")

    encoders = {
        "esmc": lambda: tf.EsmcModel(tf.EsmcConfig(**_SMALL)),
        "siglip2_text": lambda: tf.Siglip2TextModel(tf.Siglip2TextConfig(**_SMALL)),
        "aimv2_text": lambda: tf.Aimv2TextModel(tf.Aimv2TextConfig(**_SMALL)),
        "flaubert": lambda: tf.FlaubertModel(
            tf.FlaubertConfig(vocab_size=VOCAB, emb_dim=HIDDEN, n_layers=2, n_heads=4, max_position_embeddings=128)
        ),
        "blenderbot": lambda: tf.BlenderbotModel(tf.BlenderbotConfig(**_SEQ2SEQ, max_position_embeddings=128)).encoder,
        "mvp": lambda: tf.MvpModel(tf.MvpConfig(**_SEQ2SEQ, max_position_embeddings=128)).encoder,
        "plbart": lambda: tf.PLBartModel(tf.PLBartConfig(**_SEQ2SEQ, max_position_embeddings=128)).encoder,
        "led": lambda: (
            tf.LEDModel(
                tf.LEDConfig(
                    **_SEQ2SEQ,
                    max_encoder_position_embeddings=128,
                    max_decoder_position_embeddings=128,
                    attention_window=[4, 4],
                )
            ).encoder
        ),
    }
    for name, make in encoders.items():
        yield name, (lambda make=make: hidden(make())), padded, names, (batch_seq, batch_seq)

    images = {
        "pvt": lambda: tf.PvtModel(
            tf.PvtConfig(
                image_size=64,
                num_encoder_blocks=4,
                depths=[1, 1, 1, 1],
                hidden_sizes=[16, 16, 32, 32],
                num_attention_heads=[1, 1, 2, 2],
                sequence_reduction_ratios=[4, 2, 1, 1],
                patch_sizes=[4, 2, 2, 2],
                strides=[4, 2, 2, 2],
                mlp_ratios=[2, 2, 2, 2],
            )
        ),
        "sam_vision": lambda: tf.SamVisionModel(
            tf.SamVisionConfig(**_IMAGE, output_channels=32, mlp_dim=128, window_size=4, global_attn_indexes=[1])
        ),
        "pixio": lambda: tf.PixioModel(tf.PixioConfig(**_IMAGE, n_cls_tokens=2)),
        "sapiens2": lambda: tf.Sapiens2Model(tf.Sapiens2Config(**_IMAGE, intermediate_size=128, num_register_tokens=2)),
    }
    for name, make in images.items():
        yield name, (lambda make=make: image_hidden(make())), fixed_images(64), ("pixel_values",), (batch_axis,)

    speech = {"hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "num_mel_bins": 16}  # fmt: skip

    def glm_asr():
        encoder = tf.GlmAsrEncoder(tf.GlmAsrEncoderConfig(**speech, max_position_embeddings=64))
        return _module(lambda m, f: m(input_features=f).last_hidden_state, 1)(encoder.eval())

    def mels(batch: int) -> tuple:
        return (torch.randn(batch, 16, 128),)

    def lasr():
        encoder = tf.LasrEncoder(tf.LasrEncoderConfig(**speech, subsampling_conv_channels=16, conv_kernel_size=8))
        return _module(lambda m, f: m(input_features=f).last_hidden_state, 1)(encoder.eval())

    def frames(batch: int) -> tuple:
        return (torch.randn(batch, 60 + 20 * batch, 16),)

    yield "glm_asr", glm_asr, mels, ("input_features",), (batch_axis,)
    yield "lasr", lasr, frames, ("input_features",), (batch_seq,)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
