"""Held-out probe (issue 17), round 9: families no round had sent: the Audio Spectrogram Transformer, Speech2Text's
convolution-subsampled encoder, Mimi's codec encoder (causal convolutions, a windowed rope transformer, residual
vector quantization), GroupViT (grouping blocks with a hard Gumbel assignment), X-CLIP's video tower (message
tokens across frames), Idefics3's SigLIP-like tower, FLAVA's image encoder, BLIP-2's Q-Former (learned queries
cross-attending image features), VisualBERT and LXMERT (text and region features), LUKE, Conditional DETR
(conditional cross-attention, ResNet backbone), SegGPT (in-context segmentation over three images) and TextNet.

Run ``python -m bench.heldout_round9 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; tiny, weights perturbed), exported with the
TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch at two other sizes:

=================  ===========================================================================================
ast                ``ASTModel``: ``input_values [batch, 32 frames, 16 mels]``
speech2text        ``Speech2TextModel``'s encoder: ``input_features [batch, frames, 16]``
mimi_encoder       ``MimiModel.encode``: ``input_values [batch, 1, samples]`` -> codes (int64)
groupvit_vision    ``GroupViTVisionModel``: ``pixel_values [batch, 3, 32, 32]``
xclip_vision       ``XCLIPVisionModel``: ``pixel_values [batch x 2 frames, 3, 32, 32]``
idefics3_vision    ``Idefics3VisionTransformer``: ``pixel_values [batch, 3, 32, 32]``
flava_image        ``FlavaImageModel``: ``pixel_values [batch, 3, 32, 32]``
blip2_qformer      ``Blip2QFormerModel``: ``query_embeds [batch, 8, 32]``, ``encoder_hidden_states [batch, n, 24]``
visual_bert        ``VisualBertModel``: ``input_ids [batch, sequence]``, ``visual_embeds [batch, regions, 24]``
lxmert             ``LxmertModel``: ``input_ids``, ``visual_feats [batch, regions, 24]``, ``visual_pos [.., 4]``
luke               ``LukeModel``: ``input_ids``, ``attention_mask [batch, sequence]``
conditional_detr   ``ConditionalDetrModel`` (ResNet backbone): ``pixel_values [batch, 3, 64, 64]``
seggpt             ``SegGptModel``: ``pixel_values``, ``prompt_pixel_values``, ``prompt_masks [batch, 3, 32, 16]``
textnet            ``TextNetModel``: ``pixel_values [batch, 3, h, 64]``
=================  ===========================================================================================
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round9"
HIDDEN, VOCAB = 32, 128
_LAYER = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module, fixed_images, taller_images, vision

    batch_axis = ((0, "batch"),)
    batch_seq = ((0, "batch"), (1, "sequence"))

    def ast():
        model = tf.ASTModel(tf.ASTConfig(**_LAYER, patch_size=8, frequency_stride=8, time_stride=8, max_length=32,
                                         num_mel_bins=16))  # fmt: skip
        return _module(lambda m, x: m(input_values=x).last_hidden_state, 1)(model)

    def spectrogram(batch: int) -> tuple:
        return (torch.randn(batch, 32, 16),)

    yield "ast", ast, spectrogram, ("input_values",), (batch_axis,)

    def speech2text():
        model = tf.Speech2TextModel(tf.Speech2TextConfig(
            vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=64,
            max_target_positions=32, conv_channels=32, input_feat_per_channel=16, input_channels=1,
        ))  # fmt: skip
        return _module(lambda m, f: m.get_encoder()(input_features=f).last_hidden_state, 1)(model.eval())

    def frames(batch: int) -> tuple:
        return (torch.randn(batch, 12 + 8 * batch, 16),)

    yield "speech2text", speech2text, frames, ("input_features",), (((0, "batch"), (1, "frames")),)

    def mimi_encoder():
        model = tf.MimiModel(tf.MimiConfig(
            hidden_size=HIDDEN, num_filters=4, upsampling_ratios=[4, 2], codebook_size=16, codebook_dim=HIDDEN,
            num_quantizers=4, num_semantic_quantizers=1, vector_quantization_hidden_dimension=HIDDEN,
            num_hidden_layers=2, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
            sliding_window=16, use_cache=False, upsample_groups=HIDDEN,
        ))  # fmt: skip
        return _module(lambda m, x: m.encode(x).audio_codes, 1)(model.eval())

    def audio(batch: int) -> tuple:
        return (torch.randn(batch, 1, 256 + 128 * batch),)

    yield "mimi_encoder", mimi_encoder, audio, ("input_values",), (((0, "batch"), (2, "samples")),)

    def groupvit_vision():
        model = tf.GroupViTVisionModel(tf.GroupViTVisionConfig(
            hidden_size=HIDDEN, intermediate_size=64, depths=[1, 1], num_hidden_layers=2, num_group_tokens=[8, 4],
            num_output_groups=[8, 4], num_attention_heads=2, image_size=32, patch_size=8,
        ))  # fmt: skip
        return vision(model.eval())

    yield "groupvit_vision", groupvit_vision, fixed_images(32), ("pixel_values",), (batch_axis,)

    def xclip_vision():
        model = tf.XCLIPVisionModel(tf.XCLIPVisionConfig(
            **_LAYER, mit_hidden_size=HIDDEN, mit_intermediate_size=64, mit_num_hidden_layers=1,
            mit_num_attention_heads=2, image_size=32, patch_size=8, num_frames=2,
        ))  # fmt: skip
        return vision(model.eval())

    def clips(batch: int) -> tuple:  # the tower takes frames flattened into the batch, a fixed number per clip
        return (torch.randn(2 * batch, 3, 32, 32),)

    yield "xclip_vision", xclip_vision, clips, ("pixel_values",), ((0, "frames"),)

    def idefics3_vision():
        model = tf.Idefics3VisionTransformer(tf.Idefics3VisionConfig(**_LAYER, image_size=32, patch_size=8))
        return vision(model.eval())

    yield "idefics3_vision", idefics3_vision, fixed_images(32), ("pixel_values",), (batch_axis,)

    def flava_image():
        model = tf.FlavaImageModel(tf.FlavaImageConfig(**_LAYER, image_size=32, patch_size=8))
        return vision(model.eval())

    yield "flava_image", flava_image, fixed_images(32), ("pixel_values",), (batch_axis,)

    def blip2_qformer():
        model = tf.Blip2QFormerModel(tf.Blip2QFormerConfig(**_LAYER, encoder_hidden_size=24,
                                                           cross_attention_frequency=1))  # fmt: skip
        return _module(lambda m, q, e: m(query_embeds=q, encoder_hidden_states=e).last_hidden_state, 2)(model)

    def queries(batch: int) -> tuple:
        return torch.randn(batch, 8, HIDDEN), torch.randn(batch, 5 + 4 * batch, 24)

    yield ("blip2_qformer", blip2_qformer, queries, ("query_embeds", "encoder_hidden_states"),
           (batch_axis, ((0, "batch"), (1, "patches"))))  # fmt: skip

    def visual_bert():
        model = tf.VisualBertModel(tf.VisualBertConfig(**_LAYER, vocab_size=VOCAB, visual_embedding_dim=24,
                                                       max_position_embeddings=64))  # fmt: skip
        return _module(lambda m, i, v: m(input_ids=i, visual_embeds=v).last_hidden_state, 2)(model)

    def ids_regions(batch: int) -> tuple:
        return torch.randint(3, VOCAB, (batch, 4 + 3 * batch)), torch.randn(batch, 2 + batch, 24)

    yield ("visual_bert", visual_bert, ids_regions, ("input_ids", "visual_embeds"),
           (batch_seq, ((0, "batch"), (1, "regions"))))  # fmt: skip

    def lxmert():
        model = tf.LxmertModel(tf.LxmertConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=2, intermediate_size=64, l_layers=1,
            x_layers=1, r_layers=1, visual_feat_dim=24, visual_pos_dim=4, max_position_embeddings=64,
        ))  # fmt: skip
        return _module(lambda m, i, f, p: m(input_ids=i, visual_feats=f, visual_pos=p).pooled_output, 3)(model)

    def ids_feats(batch: int) -> tuple:
        regions = 2 + batch
        return (torch.randint(3, VOCAB, (batch, 4 + 3 * batch)), torch.randn(batch, regions, 24),
                torch.rand(batch, regions, 4))  # fmt: skip

    regions = ((0, "batch"), (1, "regions"))
    yield "lxmert", lxmert, ids_feats, ("input_ids", "visual_feats", "visual_pos"), (batch_seq, regions, regions)

    def luke():
        model = tf.LukeModel(tf.LukeConfig(**_LAYER, vocab_size=VOCAB, entity_vocab_size=32, entity_emb_size=16,
                                           max_position_embeddings=64))  # fmt: skip
        return _module(lambda m, i, a: m(input_ids=i, attention_mask=a).last_hidden_state, 2)(model)

    def ids_mask(batch: int) -> tuple:
        seq = 4 + 3 * batch
        return torch.randint(3, VOCAB, (batch, seq)), torch.ones(batch, seq, dtype=torch.int64)

    yield "luke", luke, ids_mask, ("input_ids", "attention_mask"), (batch_seq, batch_seq)

    def conditional_detr():
        backbone = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 16, 16], depths=[1, 1, 1, 1],
                                   out_features=["stage4"])  # fmt: skip
        model = tf.ConditionalDetrModel(tf.ConditionalDetrConfig(
            use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False, num_queries=8,
            d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64,
        ))  # fmt: skip
        return _module(lambda m, p: m(pixel_values=p).last_hidden_state, 1)(model.eval())

    yield "conditional_detr", conditional_detr, fixed_images(64), ("pixel_values",), (batch_axis,)

    def seggpt():
        model = tf.SegGptModel(tf.SegGptConfig(
            hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, mlp_dim=64, image_size=[64, 16],
            patch_size=8, pretrain_image_size=16, decoder_hidden_size=16, merge_index=0,
            intermediate_hidden_state_indices=[0, 1],
        ))  # fmt: skip
        return _module(lambda m, p, q, k: m(pixel_values=p, prompt_pixel_values=q, prompt_masks=k)
                       .last_hidden_state, 3)(model.eval())  # fmt: skip

    def prompts(batch: int) -> tuple:
        return tuple(torch.randn(batch, 3, 32, 16) for _ in range(3))

    yield ("seggpt", seggpt, prompts, ("pixel_values", "prompt_pixel_values", "prompt_masks"),
           (batch_axis,) * 3)  # fmt: skip

    def textnet():
        model = tf.TextNetModel(tf.TextNetConfig(
            stem_out_channels=8, conv_layer_kernel_sizes=[[[3, 3], [3, 1]], [[1, 3], [3, 3]]],
            conv_layer_strides=[[1, 2], [1, 2]], hidden_sizes=[8, 16, 32],
        ))  # fmt: skip
        return _module(lambda m, p: m(pixel_values=p).last_hidden_state, 1)(model.eval())

    yield "textnet", textnet, taller_images, ("pixel_values",), (((0, "batch"), (2, "height")),)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
