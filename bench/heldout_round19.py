"""Held-out probe (issue 17), round 19: inputs beside the image that no round had synthesized: DETR with its
``pixel_mask`` (which pixels are image, not padding), SAM end to end (``input_points`` in pixels and their
``input_labels``: 1 a point on the object, 0 off it), and Grounding DINO (an image and the text naming what to find,
``input_ids`` with its ``attention_mask``).

Run ``python -m bench.heldout_round19 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; 1-2 layers, hidden 32-64, 4 heads, weights
perturbed), exported with the TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch
at two other batch sizes. Inputs: ``pixel_values [batch, 3, 64, 64]``; DETR's ``pixel_mask [batch, 64, 64]`` (the
right quarter padding in the examples); SAM's ``input_points [batch, 1, 2, 2]`` and ``input_labels [batch, 1, 2]``;
Grounding DINO's ``input_ids [batch, 6]`` and ``attention_mask [batch, 6]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round19"


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module
    from bench.heldout_round18 import _DETR, _RESNET  # round 18's backbone and DETR sizes

    batch_axis = ((0, "batch"),)

    def detr():
        backbone = tf.ResNetConfig(**_RESNET, out_features=["stage4"])
        config = tf.DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone,
                               d_model=32, **_DETR)  # fmt: skip
        model = tf.DetrForObjectDetection(config).eval()
        return _module(lambda m, p, k: m(pixel_values=p, pixel_mask=k).logits, 2)(model)

    def masked_images(batch: int) -> tuple:
        mask = torch.ones(batch, 64, 64, dtype=torch.long)
        mask[:, :, 48:] = 0
        return torch.randn(batch, 3, 64, 64), mask

    yield "detr_pixel_mask", detr, masked_images, ("pixel_values", "pixel_mask"), (batch_axis, batch_axis)

    def sam():
        vision = {"hidden_size": 64, "output_channels": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "image_size": 64, "patch_size": 16, "mlp_dim": 128, "global_attn_indexes": [1], "window_size": 2,
                  "num_pos_feats": 16}  # fmt: skip
        prompt = {"hidden_size": 32, "image_size": 64, "patch_size": 16, "mask_input_channels": 4}
        decoder = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "mlp_dim": 64,
                   "iou_head_hidden_dim": 32, "num_multimask_outputs": 3}  # fmt: skip
        config = tf.SamConfig(vision_config=vision, prompt_encoder_config=prompt, mask_decoder_config=decoder)
        model = tf.SamModel(config).eval()
        return _module(lambda m, p, q, r: m(pixel_values=p, input_points=q, input_labels=r).pred_masks, 3)(model)

    def prompted(batch: int) -> tuple:
        return torch.randn(batch, 3, 64, 64), torch.rand(batch, 1, 2, 2) * 64, torch.ones(batch, 1, 2, dtype=torch.long)

    yield "sam", sam, prompted, ("pixel_values", "input_points", "input_labels"), (batch_axis,) * 3

    def grounding_dino():
        swin = tf.SwinConfig(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], image_size=64,
                             out_features=["stage2", "stage3", "stage4"])  # fmt: skip
        text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64,
                "vocab_size": 128}  # fmt: skip
        config = tf.GroundingDinoConfig(backbone_config=swin, text_config=text, d_model=32, num_feature_levels=3,
                                        encoder_n_points=2, decoder_n_points=2, max_text_len=16, **_DETR)  # fmt: skip
        model = tf.GroundingDinoModel(config).eval()
        return _module(lambda m, p, i, a: m(pixel_values=p, input_ids=i, attention_mask=a).last_hidden_state, 3)(model)

    def image_and_text(batch: int) -> tuple:
        return torch.randn(batch, 3, 64, 64), torch.randint(5, 128, (batch, 6)), torch.ones(batch, 6, dtype=torch.long)

    names = ("pixel_values", "input_ids", "attention_mask")
    yield "grounding_dino", grounding_dino, image_and_text, names, (batch_axis,) * 3


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
