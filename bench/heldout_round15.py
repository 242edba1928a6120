"""Held-out probe (issue 17), round 15: vision and audio towers no round had sent: Gemma 4's vision encoder (patches
flattened by the caller, 2-D rope read from ``pixel_position_ids``), SmolVLM's and MetaCLIP 2's vision towers,
TIPSv2 (a ViT with register tokens), VideoPrism (factorised space then time attention over video), DINOv3's
ConvNeXt, Donut's Swin, and CLAP's audio tower (HTSAT: a Swin over a mel spectrogram).

Run ``python -m bench.heldout_round15 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; 2 layers or stages, hidden 64 or narrower, 4 heads,
weights perturbed), exported with the TorchScript exporter (opset 17) and dynamo (opset 18), each checked
against torch at two other batch sizes. Inputs: ``pixel_values [batch, 3, 64, 64]``; Gemma 4's ``pixel_values
[batch, 81, 192]`` (a 9 x 9 grid of 8 x 8 x 3 patches: its pooling takes 3 x 3) and ``pixel_position_ids [batch,
81, 2]`` (the patches' x, y on the grid); VideoPrism's ``pixel_values_videos [batch, 2, 3, 32, 32]``; CLAP's
``input_features [batch, 1, 64, 16]`` (64 frames of 16 mel bins).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round15"
_VIT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module, fixed_images, image_hidden

    batch_axis = ((0, "batch"),)

    images = {
        "smolvlm_vision": lambda: tf.SmolVLMVisionTransformer(
            tf.SmolVLMVisionConfig(**_VIT, image_size=64, patch_size=8)
        ),
        "metaclip2_vision": lambda: tf.MetaClip2VisionModel(
            tf.MetaClip2VisionConfig(**_VIT, image_size=64, patch_size=8)
        ),
        "tipsv2_vision": lambda: tf.Tipsv2VisionModel(tf.Tipsv2VisionConfig(**_VIT, image_size=64, patch_size=8)),
        "dinov3_convnext": lambda: tf.DINOv3ConvNextModel(
            tf.DINOv3ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], image_size=64)
        ),
        "donut_swin": lambda: tf.DonutSwinModel(
            tf.DonutSwinConfig(
                image_size=64, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4
            )
        ),
    }
    for name, make in images.items():
        yield name, (lambda make=make: image_hidden(make())), fixed_images(64), ("pixel_values",), (batch_axis,)

    def gemma4_vision():
        config = tf.Gemma4VisionConfig(**_VIT, num_key_value_heads=4, head_dim=16, patch_size=8,
                                       position_embedding_size=64)  # fmt: skip
        model = tf.Gemma4VisionModel(config)
        return _module(lambda m, p, ids: m(pixel_values=p, pixel_position_ids=ids).last_hidden_state, 2)(model.eval())

    def patches(batch: int) -> tuple:
        grid = torch.stack(torch.meshgrid(torch.arange(9), torch.arange(9), indexing="xy"), -1).reshape(1, 81, 2)
        return torch.rand(batch, 81, 192), grid.expand(batch, 81, 2).contiguous()

    yield "gemma4_vision", gemma4_vision, patches, ("pixel_values", "pixel_position_ids"), (batch_axis, batch_axis)

    def videoprism():
        config = tf.VideoPrismVisionConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                           image_size=32, num_frames=2, tubelet_size=[1, 8, 8], num_spatial_layers=1,
                                           num_temporal_layers=1, num_auxiliary_layers=1)  # fmt: skip
        model = tf.VideoPrismVisionModel(config)
        return _module(lambda m, v: m(pixel_values_videos=v).last_hidden_state, 1)(model.eval())

    def videos(batch: int) -> tuple:
        return (torch.randn(batch, 2, 3, 32, 32),)

    yield "videoprism", videoprism, videos, ("pixel_values_videos",), (batch_axis,)

    def clap_audio():
        config = tf.ClapAudioConfig(spec_size=64, patch_size=4, patch_embeds_hidden_size=16, depths=[1, 1],
                                    num_attention_heads=[2, 4], window_size=4, num_mel_bins=16,
                                    hidden_size=32)  # fmt: skip
        return _module(lambda m, f: m(input_features=f).pooler_output, 1)(tf.ClapAudioModel(config).eval())

    def mels(batch: int) -> tuple:
        return (torch.randn(batch, 1, 64, 16),)

    yield "clap_audio", clap_audio, mels, ("input_features",), (batch_axis,)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
