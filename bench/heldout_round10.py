"""Held-out probe (issue 17), round 10: dense-prediction and detection towers no round had sent: DPT (a ViT with a
readout token and a reassemble neck), ViTPose (a plain ViT backbone and a heatmap decoder), RT-DETR (hybrid
encoder, deformable decoder attention over grid samples), Janus's vision tower (SigLIP-like), and
BridgeTower (a RoBERTa text tower, a CLIP image tower and cross-modal layers attending both ways).

Run ``python -m bench.heldout_round10 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; tiny, weights perturbed), exported with the
TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch at two other sizes:

============  ===============================================================================================
dpt           ``DPTForDepthEstimation``: ``pixel_values [batch, 3, 32, 32]`` -> depth
vitpose       ``VitPoseForPoseEstimation``: ``pixel_values [batch, 3, 64, 48]`` -> heatmaps
rt_detr       ``RTDetrModel`` (ResNet backbone): ``pixel_values [batch, 3, 64, 64]``
janus_vision  ``JanusVisionModel``: ``pixel_values [batch, 3, 32, 32]``
bridgetower   ``BridgeTowerModel``: ``input_ids [batch, sequence]``, ``pixel_values [batch, 3, 32, 32]``
============  ===============================================================================================
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round10"
HIDDEN, VOCAB = 32, 128
_LAYER = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module, fixed_images, vision

    batch_axis = ((0, "batch"),)

    def dpt():
        model = tf.DPTForDepthEstimation(tf.DPTConfig(
            **_LAYER, image_size=32, patch_size=8, backbone_out_indices=[0, 1], neck_hidden_sizes=[8, 16],
            reassemble_factors=[2, 1], fusion_hidden_size=16, head_in_index=-1,
        ))  # fmt: skip
        return _module(lambda m, p: m(pixel_values=p).predicted_depth, 1)(model)

    yield "dpt", dpt, fixed_images(32), ("pixel_values",), (batch_axis,)

    def vitpose():
        backbone = tf.VitPoseBackboneConfig(image_size=[64, 48], patch_size=[16, 16], hidden_size=HIDDEN,
                                            num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                                            out_indices=[2])  # fmt: skip
        model = tf.VitPoseForPoseEstimation(tf.VitPoseConfig(backbone_config=backbone, num_labels=4))
        return _module(lambda m, p: m(pixel_values=p).heatmaps, 1)(model)

    yield "vitpose", vitpose, fixed_images(64, 48), ("pixel_values",), (batch_axis,)

    def rt_detr():
        backbone = tf.RTDetrResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1],
                                         out_features=["stage2", "stage3", "stage4"])  # fmt: skip
        model = tf.RTDetrModel(tf.RTDetrConfig(
            backbone_config=backbone, encoder_in_channels=[16, 24, 32], encoder_hidden_dim=16, encoder_ffn_dim=32,
            encoder_attention_heads=2, d_model=16, num_queries=8, decoder_in_channels=[16, 16, 16],
            decoder_ffn_dim=32, decoder_layers=1, decoder_attention_heads=2, decoder_n_points=2, num_denoising=0,
            anchor_image_size=[64, 64], disable_custom_kernels=True,
        ))  # fmt: skip
        return _module(lambda m, p: m(pixel_values=p).last_hidden_state, 1)(model.eval())

    yield "rt_detr", rt_detr, fixed_images(64), ("pixel_values",), (batch_axis,)

    def janus_vision():
        model = tf.JanusVisionModel(tf.JanusVisionConfig(
            hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
            mlp_ratio=2.0, use_qk_norm=False, projection_dim=HIDDEN, num_image_tokens=16,
        ))  # fmt: skip
        return vision(model.eval())

    yield "janus_vision", janus_vision, fixed_images(32), ("pixel_values",), (batch_axis,)

    def bridgetower():
        wide = 64  # the image tower has hidden / 64 heads
        text = tf.BridgeTowerTextConfig(
            vocab_size=VOCAB, hidden_size=wide, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64,
        )  # fmt: skip
        image = tf.BridgeTowerVisionConfig(hidden_size=wide, num_hidden_layers=2, patch_size=8, image_size=32)
        model = tf.BridgeTowerModel(tf.BridgeTowerConfig(
            text_config=text.to_dict(), vision_config=image.to_dict(), hidden_size=wide, num_hidden_layers=2,
            num_attention_heads=2,
        ))  # fmt: skip
        return _module(lambda m, i, p: m(input_ids=i, pixel_values=p).pooler_output, 2)(model.eval())

    def ids_images(batch: int) -> tuple:
        return torch.randint(3, VOCAB, (batch, 4 + 3 * batch)), torch.randn(batch, 3, 32, 32)

    yield ("bridgetower", bridgetower, ids_images, ("input_ids", "pixel_values"),
           (((0, "batch"), (1, "sequence")), batch_axis))  # fmt: skip


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
