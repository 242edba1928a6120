"""Held-out probe (issue 17), round 17: model types no round had sent: two speech recognizers (Parakeet's and
LASR's CTC heads over conformer encoders, on log-mel features), ViLT (text and image patches in one encoder),
EoMT (a ViT whose last blocks attend over learned queries too, for segmentation), RADIO (a ViT distilled from
several teachers), ViTMatte (a ViTDet backbone, a four-channel image with its trimap), RT-DETR v2 and Table
Transformer (detection: a CNN backbone, an encoder, a query decoder), and two Paddle OCR models ported to
transformers (PP-LCNet v4, a backbone; PP-OCRv6 small, a text recognizer).

Run ``python -m bench.heldout_round17 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; 2 layers, hidden 64, 4 heads where the model has a
transformer, weights perturbed), exported with the TorchScript exporter (opset 17) and dynamo (opset 18), each
checked against torch at two other batch sizes. Inputs: ``input_features [batch, frames, 80]`` (log-mel, 200
frames in the examples);
``pixel_values [batch, 3, 64, 64]`` (ViTMatte's ``[batch, 4, 64, 64]``, PP-OCRv6's ``[batch, 3, 48, 160]``);
ViLT's ``input_ids [batch, 8]`` beside its image.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round17"
_VIT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
_CONFORMER = {**_VIT, "num_mel_bins": 80}
_RESNET = {"embedding_size": 16, "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1]}


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module, fixed_images, image_hidden

    batch_axis = ((0, "batch"),)

    def features(batch: int) -> tuple:
        return (torch.randn(batch, 200, 80),)

    speech = {
        "parakeet_ctc": lambda: tf.ParakeetForCTC(
            tf.ParakeetCTCConfig(encoder_config={**_CONFORMER, "subsampling_conv_channels": 32}, vocab_size=128)
        ),
        "lasr_ctc": lambda: tf.LasrForCTC(tf.LasrCTCConfig(encoder_config=_CONFORMER, vocab_size=128)),
    }
    for name, make in speech.items():

        def ctc(make=make):
            return _module(lambda m, f: m(input_features=f).logits, 1)(make().eval())

        yield name, ctc, features, ("input_features",), (((0, "batch"), (1, "frames")),)

    towers = {
        "eomt": lambda: tf.EomtForUniversalSegmentation(
            tf.EomtConfig(**_VIT, image_size=64, patch_size=16, num_queries=8, num_blocks=1, num_upscale_blocks=1)
        ),
        "radio": lambda: tf.RadioModel(tf.RadioConfig(**_VIT, image_size=64, patch_size=16)),
    }
    for name, make in towers.items():
        yield name, (lambda make=make: image_hidden(make())), fixed_images(64), ("pixel_values",), (batch_axis,)

    def detr(model):
        return _module(lambda m, p: m(pixel_values=p).last_hidden_state, 1)(model.eval())

    def rt_detr_v2():
        backbone = tf.RTDetrResNetConfig(**_RESNET, out_features=["stage2", "stage3", "stage4"])
        config = tf.RTDetrV2Config(
            backbone_config=backbone,
            encoder_hidden_dim=32,
            d_model=32,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            num_queries=16,
            decoder_layers=1,
            encoder_layers=1,
            decoder_attention_heads=4,
            encoder_attention_heads=4,
            num_feature_levels=3,
            decoder_in_channels=[32, 32, 32],
        )
        return detr(tf.RTDetrV2Model(config))

    def table_transformer():
        backbone = tf.ResNetConfig(**_RESNET, out_features=["stage4"])
        config = tf.TableTransformerConfig(
            use_timm_backbone=False,
            backbone_config=backbone,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            num_queries=8,
        )
        return detr(tf.TableTransformerModel(config))

    yield "rt_detr_v2", rt_detr_v2, fixed_images(64), ("pixel_values",), (batch_axis,)
    yield "table_transformer", table_transformer, fixed_images(64), ("pixel_values",), (batch_axis,)

    def vitmatte():
        backbone = tf.VitDetConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            mlp_ratio=2,
            num_channels=4,
            image_size=64,
            patch_size=16,
            out_features=["stage2"],
        )
        config = tf.VitMatteConfig(
            backbone_config=backbone,
            hidden_size=64,
            convstream_hidden_sizes=[16, 32, 64],
            fusion_hidden_sizes=[64, 32, 16, 8],
        )
        return _module(lambda m, p: m(pixel_values=p).alphas, 1)(tf.VitMatteForImageMatting(config).eval())

    def trimapped(batch: int) -> tuple:
        return (torch.randn(batch, 4, 64, 64),)

    yield "vitmatte", vitmatte, trimapped, ("pixel_values",), (batch_axis,)

    def vilt():
        config = tf.ViltConfig(**_VIT, image_size=64, patch_size=16, vocab_size=256, max_image_length=-1)
        return _module(lambda m, i, p: m(input_ids=i, pixel_values=p).last_hidden_state, 2)(tf.ViltModel(config).eval())

    def text_and_image(batch: int) -> tuple:
        return torch.randint(5, 256, (batch, 8)), torch.randn(batch, 3, 64, 64)

    yield "vilt", vilt, text_and_image, ("input_ids", "pixel_values"), (batch_axis, batch_axis)

    def pp_lcnet_v4():
        backbone = tf.AutoBackbone.from_config(tf.PPLCNetV4Config())
        return _module(lambda m, p: m(pixel_values=p).feature_maps[-1], 1)(backbone.eval())

    yield "pp_lcnet_v4", pp_lcnet_v4, fixed_images(64), ("pixel_values",), (batch_axis,)

    def pp_ocrv6_small_rec():
        return image_hidden(tf.PPOCRV6SmallRecModel(tf.PPOCRV6SmallRecConfig()))

    yield "pp_ocrv6_small_rec", pp_ocrv6_small_rec, fixed_images(48, 160), ("pixel_values",), (batch_axis,)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
