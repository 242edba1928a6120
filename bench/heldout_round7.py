"""Held-out probe (issue 17), round 7: encoders released after the earlier rounds were written, most with a
rotary embedding in a vision tower or a text encoder, and two detectors: DINOv3 (2-D rope, registers, layer
scale), Pixtral's and MLCD's vision towers (2-D rope), InternVL's vision tower (q/k norm, layer scale),
EuroBERT (a rope text encoder), ModernBERT's decoder (causal), DETR and ViTDet (windowed, decomposed relative
positions), and Parakeet's Conformer encoder (relative positions, log-mel input).

Run ``python -m bench.heldout_round7 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; tiny, weights perturbed), exported with the
TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch at two other sizes:

==================  ===========================================================================
dinov3_vit          ``DINOv3ViTModel``: ``pixel_values [batch, 3, 32, 32]``
pixtral_vision      ``PixtralVisionModel``: ``pixel_values [1, 3, 32, 32]`` (it loops over images: batch fixed)
mlcd_vision         ``MLCDVisionModel``: ``pixel_values [batch, 3, 32, 32]``
internvl_vision     ``InternVLVisionModel``: ``pixel_values [batch, 3, 32, 32]``
eurobert            ``EuroBertModel``: ``input_ids``, ``attention_mask [batch, sequence]``
modernbert_decoder  ``ModernBertDecoderModel``: ``input_ids``, ``attention_mask [batch, sequence]``
detr                ``DetrForObjectDetection`` (ResNet backbone): ``pixel_values [batch, 3, h, 64]``, logits
vitdet              ``VitDetModel``: ``pixel_values [batch, 3, 32, 32]``
parakeet_encoder    ``ParakeetEncoder``: ``input_features [batch, frames, 16]``
==================  ===========================================================================
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round7"
HIDDEN, VOCAB = 32, 128


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module, fixed_images, taller_images, vision

    small = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    batch_seq = ((0, "batch"), (1, "sequence"))

    def dinov3_vit():
        return vision(tf.DINOv3ViTModel(tf.DINOv3ViTConfig(
            **small, patch_size=8, image_size=32, num_register_tokens=2, layerscale_value=0.1,
        )))  # fmt: skip

    yield "dinov3_vit", dinov3_vit, fixed_images(32), ("pixel_values",), ((0, "batch"),)

    def pixtral_vision():
        return vision(tf.PixtralVisionModel(tf.PixtralVisionConfig(**small, head_dim=16, patch_size=8, image_size=32)))

    def one_image(batch: int) -> tuple:  # Pixtral loops over a list of images: both exporters fix the batch
        return (torch.randn(1, 3, 32, 32),)

    yield "pixtral_vision", pixtral_vision, one_image, ("pixel_values",), ((),)

    def mlcd_vision():
        return vision(tf.MLCDVisionModel(tf.MLCDVisionConfig(**small, patch_size=8, image_size=32)))

    yield "mlcd_vision", mlcd_vision, fixed_images(32), ("pixel_values",), ((0, "batch"),)

    def internvl_vision():
        return vision(tf.InternVLVisionModel(tf.InternVLVisionConfig(
            **small, patch_size=[8, 8], image_size=[32, 32], use_qk_norm=True, layer_scale_init_value=0.1,
        )))  # fmt: skip

    yield "internvl_vision", internvl_vision, fixed_images(32), ("pixel_values",), ((0, "batch"),)

    def ids_mask(batch: int) -> tuple:
        seq = 4 + 3 * batch
        return torch.randint(3, VOCAB, (batch, seq)), torch.ones(batch, seq, dtype=torch.int64)

    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

    def text(model):
        return _module(lambda m, i, a: m(input_ids=i, attention_mask=a).last_hidden_state, 2)(model)

    def eurobert():
        return text(tf.EuroBertModel(tf.EuroBertConfig(
            **small, **ids, vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=256,
        )))  # fmt: skip

    yield "eurobert", eurobert, ids_mask, ("input_ids", "attention_mask"), (batch_seq,) * 2

    def modernbert_decoder():
        return text(tf.ModernBertDecoderModel(tf.ModernBertDecoderConfig(
            **small, **ids, vocab_size=VOCAB, max_position_embeddings=256, local_attention=16,
            global_attn_every_n_layers=2, cls_token_id=1, sep_token_id=2,
        )))  # fmt: skip

    yield "modernbert_decoder", modernbert_decoder, ids_mask, ("input_ids", "attention_mask"), (batch_seq,) * 2

    def detr():
        backbone = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1],
                                   out_features=["stage4"])  # fmt: skip
        model = tf.DetrForObjectDetection(tf.DetrConfig(
            use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone, d_model=HIDDEN,
            encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=8, num_labels=5,
        ))  # fmt: skip
        return _module(lambda m, p: m(pixel_values=p).logits, 1)(model)

    yield "detr", detr, taller_images, ("pixel_values",), (((0, "batch"), (2, "height")),)

    def vitdet():
        return vision(tf.VitDetModel(tf.VitDetConfig(
            **small, patch_size=4, image_size=32, pretrain_image_size=32, window_size=4, window_block_indices=[0],
            use_relative_position_embeddings=True,
        )))  # fmt: skip

    yield "vitdet", vitdet, fixed_images(32), ("pixel_values",), ((0, "batch"),)

    def parakeet_encoder():
        model = tf.ParakeetEncoder(tf.ParakeetEncoderConfig(
            hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_mel_bins=16,
            subsampling_conv_channels=8, conv_kernel_size=9,
        ))  # fmt: skip
        return _module(lambda m, f: m(input_features=f).last_hidden_state, 1)(model)

    def mel(batch: int) -> tuple:
        return (torch.randn(batch, 40 + 16 * batch, 16),)

    yield "parakeet_encoder", parakeet_encoder, mel, ("input_features",), (((0, "batch"), (1, "frames")),)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
