"""Held-out probe (issue 17), round 18: model types no round had sent: DAB-DETR (anchor boxes as decoder queries),
Mask2Former (masked attention over a Swin backbone), UDOP's encoder (a T5 encoder over text, layout boxes and image
patches), MusicGen's decoder (several codebooks' tokens summed per step, no cache), Granite Speech 5's CTC
recognizer, and SpeechT5's HiFi-GAN vocoder (a CNN from a spectrogram to a waveform).

Run ``python -m bench.heldout_round18 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; 1-2 layers, hidden 32-64, 4 heads, weights
perturbed), exported with the TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch
at two other batch sizes. Inputs: ``pixel_values [batch, 3, 64, 64]``; UDOP's ``input_ids [batch, 8]``, ``bbox
[batch, 8, 4]`` and image; MusicGen's ``input_ids [batch * 2 codebooks, sequence]``; Granite Speech's
``input_features [batch, frames, 320]`` (its projection's width); HiFi-GAN's ``spectrogram [batch, frames, 80]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round18"
_RESNET = {"embedding_size": 16, "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1]}
_DETR = {"encoder_layers": 1, "decoder_layers": 1, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
         "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_queries": 8}  # fmt: skip


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module, fixed_images

    batch_axis = ((0, "batch"),)
    timed = ((0, "batch"), (1, "frames"))

    def dab_detr():
        backbone = tf.ResNetConfig(**_RESNET, out_features=["stage4"])
        config = tf.DabDetrConfig(use_timm_backbone=False, backbone_config=backbone, hidden_size=32, **_DETR)
        return _module(lambda m, p: m(pixel_values=p).last_hidden_state, 1)(tf.DabDetrModel(config).eval())

    yield "dab_detr", dab_detr, fixed_images(64), ("pixel_values",), (batch_axis,)

    def mask2former():
        swin = tf.SwinConfig(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], image_size=64,
                             out_features=["stage1", "stage2", "stage3", "stage4"])  # fmt: skip
        config = tf.Mask2FormerConfig(backbone_config=swin, hidden_dim=32, mask_feature_size=32, feature_size=32,
                                      encoder_layers=1, decoder_layers=2, num_queries=8, dim_feedforward=64,
                                      num_attention_heads=4, encoder_feedforward_dim=64)  # fmt: skip
        model = tf.Mask2FormerForUniversalSegmentation(config).eval()
        return _module(lambda m, p: m(pixel_values=p).masks_queries_logits, 1)(model)

    yield "mask2former", mask2former, fixed_images(64), ("pixel_values",), (batch_axis,)

    def udop_encoder():
        config = tf.UdopConfig(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=256,
                               image_size=64, patch_size=16)  # fmt: skip
        model = tf.UdopEncoderModel(config).eval()
        return _module(lambda m, i, b, p: m(input_ids=i, bbox=b, pixel_values=p).last_hidden_state, 3)(model)

    def document(batch: int) -> tuple:
        boxes = torch.sort(torch.rand(batch, 8, 4), dim=-1).values
        return torch.randint(5, 256, (batch, 8)), boxes[..., [0, 1, 2, 3]], torch.randn(batch, 3, 64, 64)

    yield "udop_encoder", udop_encoder, document, ("input_ids", "bbox", "pixel_values"), (batch_axis,) * 3

    def musicgen():
        config = tf.MusicgenDecoderConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                                          vocab_size=64, num_codebooks=2, max_position_embeddings=128,
                                          use_cache=False)  # fmt: skip
        return _module(lambda m, i: m(input_ids=i).logits, 1)(tf.MusicgenForCausalLM(config).eval())

    def codes(batch: int) -> tuple:
        return (torch.randint(0, 64, (batch * 2, 12)),)

    yield "musicgen", musicgen, codes, ("input_ids",), (((0, "batch_codebooks"), (1, "sequence")),)

    def granite_speech5_ctc():
        encoder = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 4, "head_dim": 16, "context_size": 16, "vocab_size": 128}  # fmt: skip
        config = tf.GraniteSpeech5CTCConfig(encoder_config=encoder, vocab_size=128)
        model = tf.GraniteSpeech5ForCTC(config).eval()
        return _module(lambda m, f: m(input_features=f).logits, 1)(model)

    def features(batch: int) -> tuple:
        return (torch.randn(batch, 100, 320),)

    yield "granite_speech5_ctc", granite_speech5_ctc, features, ("input_features",), (timed,)

    def hifigan():
        config = tf.SpeechT5HifiGanConfig(upsample_initial_channel=32, upsample_rates=[4, 4],
                                          upsample_kernel_sizes=[8, 8], resblock_kernel_sizes=[3],
                                          resblock_dilation_sizes=[[1, 3]])  # fmt: skip
        return _module(lambda m, s: m(s), 1)(tf.SpeechT5HifiGan(config).eval())

    def spectrogram(batch: int) -> tuple:
        return (torch.randn(batch, 20, 80),)

    yield "hifigan", hifigan, spectrogram, ("spectrogram",), (timed,)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
