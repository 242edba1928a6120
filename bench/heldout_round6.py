"""Held-out probe (issue 17), round 6: dense-prediction and generative heads no probe had sent: a neural audio
codec's encoder and decoder (DAC), a speech-to-text encoder on raw audio (SpeechT5), depth from a DINOv2
backbone (Depth Anything), segmentation over a ConvNeXt (UperNet), super-resolution (Swin2SR), a video
transformer (TimeSformer) and an open-vocabulary detector's image tower (OWLv2).

Run ``python -m bench.heldout_round6 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; tiny, weights perturbed), exported with the
TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch at two other sizes:

================  ===============================================================================
dac               ``DacModel`` encode and decode: ``input_values [batch, 1, samples]`` to the audio
speecht5_encoder  ``SpeechT5ForSpeechToText``'s encoder with its speech pre-net: ``input_values [batch,
                  samples]``
depth_anything    ``DepthAnythingForDepthEstimation`` (DINOv2 backbone): ``pixel_values [batch, 3, 28, 28]``
upernet           ``UperNetForSemanticSegmentation`` (ConvNeXt backbone): ``pixel_values [batch, 3, h, w]``
swin2sr           ``Swin2SRForImageSuperResolution``: ``pixel_values [batch, 3, 16, 16]``
timesformer       ``TimesformerModel``: ``pixel_values [batch, 2 frames, 3, 32, 32]``
owlv2_vision      ``Owlv2VisionModel``: ``pixel_values [batch, 3, 32, 32]``
================  ===============================================================================
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round6"
HIDDEN = 32


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module, fixed_images, taller_images, vision

    def dac():
        model = tf.DacModel(tf.DacConfig(
            encoder_hidden_size=8, downsampling_ratios=[2, 4], decoder_hidden_size=32, n_codebooks=2,
            codebook_size=64, codebook_dim=8, hidden_size=32, sampling_rate=8000,
        ))  # fmt: skip
        return _module(lambda m, x: m(input_values=x).audio_values, 1)(model)

    def audio(batch: int) -> tuple:
        return (torch.randn(batch, 1, 64 * (2 + batch)),)

    yield "dac", dac, audio, ("input_values",), (((0, "batch"), (2, "samples")),)

    def speecht5_encoder():
        model = tf.SpeechT5ForSpeechToText(tf.SpeechT5Config(
            vocab_size=64, hidden_size=HIDDEN, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
            decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=64, conv_dim=(16, 16),
            conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
            encoder_max_relative_position=16, mask_time_prob=0.0,
        )).get_encoder()  # fmt: skip
        return _module(lambda m, x: m(input_values=x).last_hidden_state, 1)(model)

    def waveform(batch: int) -> tuple:
        return (torch.randn(batch, 400 + 160 * batch),)

    yield "speecht5_encoder", speecht5_encoder, waveform, ("input_values",), (((0, "batch"), (1, "samples")),)

    def depth_anything():
        backbone = tf.Dinov2Config(
            hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, image_size=28,
            patch_size=14, out_features=["stage1", "stage2", "stage3", "stage4"], reshape_hidden_states=False,
        )  # fmt: skip
        model = tf.DepthAnythingForDepthEstimation(tf.DepthAnythingConfig(
            backbone_config=backbone, neck_hidden_sizes=[8, 16, 32, 32], fusion_hidden_size=16,
            head_hidden_size=8, reassemble_hidden_size=HIDDEN,
        ))  # fmt: skip
        return _module(lambda m, p: m(pixel_values=p).predicted_depth, 1)(model)

    yield "depth_anything", depth_anything, fixed_images(28), ("pixel_values",), ((0, "batch"),)

    def upernet():
        backbone = tf.ConvNextConfig(hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1],
                                     out_features=["stage1", "stage2", "stage3", "stage4"])  # fmt: skip
        model = tf.UperNetForSemanticSegmentation(tf.UperNetConfig(
            backbone_config=backbone, hidden_size=16, auxiliary_in_channels=24, auxiliary_channels=8, num_labels=5,
        ))  # fmt: skip
        return _module(lambda m, p: m(pixel_values=p).logits, 1)(model)

    yield "upernet", upernet, taller_images, ("pixel_values",), (((0, "batch"), (2, "height")),)

    def swin2sr():
        model = tf.Swin2SRForImageSuperResolution(tf.Swin2SRConfig(
            image_size=16, embed_dim=16, depths=[2], num_heads=[2], window_size=4, upscale=2,
            upsampler="pixelshuffle",
        ))  # fmt: skip
        return _module(lambda m, p: m(pixel_values=p).reconstruction, 1)(model)

    yield "swin2sr", swin2sr, fixed_images(16), ("pixel_values",), ((0, "batch"),)

    def timesformer():
        model = tf.TimesformerModel(tf.TimesformerConfig(
            image_size=32, patch_size=8, num_frames=2, hidden_size=HIDDEN, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=64,
        ))  # fmt: skip
        return vision(model)

    def video(batch: int) -> tuple:
        return (torch.randn(batch, 2, 3, 32, 32),)

    yield "timesformer", timesformer, video, ("pixel_values",), ((0, "batch"),)

    def owlv2_vision():
        model = tf.Owlv2VisionModel(tf.Owlv2VisionConfig(
            hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            patch_size=8,
        ))  # fmt: skip
        return vision(model)

    yield "owlv2_vision", owlv2_vision, fixed_images(32), ("pixel_values",), ((0, "batch"),)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
