"""Held-out probe (issue 17), round 5: inputs of roles no probe had sent (a table encoder's 7 token-type ids, a
Chinese encoder's shape and pronunciation ids, float layout boxes, a reinforcement-learning trajectory) and
attention in forms none had (windowed with decomposed relative positions, variable-resolution patches with a
pixel mask, separable and additive linear attention, a scene-text recognizer's character queries).

Run ``python -m bench.heldout_round5 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; 2 layers, hidden 64, weights perturbed), exported
with the TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch at two other sizes:

======================  =================================================================================
tapas                   ``TapasModel``: ``input_ids``, ``attention_mask``, ``token_type_ids [batch, sequence,
                        7]`` (segment, column, row, rank... each below its own vocabulary)
roc_bert                ``RoCBertModel``: ``input_ids``, ``input_shape_ids``, ``input_pronunciation_ids``,
                        ``attention_mask``
bros                    ``BrosModel``: ``input_ids``, ``bbox [batch, sequence, 8]`` (float corners in 0-1),
                        ``attention_mask``
decision_transformer    ``DecisionTransformerModel``: ``states [batch, steps, 11]``, ``actions [.., 3]``,
                        ``returns_to_go [.., 1]``, ``timesteps`` (below the episode length), ``attention_mask``
sam_vision              ``SamVisionModel``: windowed attention with decomposed relative positions, a global
                        layer, ``pixel_values [batch, 3, 64, 64]`` (fixed: its position table is)
siglip2_vision          ``Siglip2VisionModel`` (NaFlex): ``pixel_values [batch, patches, 3*8*8]``,
                        ``pixel_attention_mask [batch, patches]``, ``spatial_shapes [batch, 2]``
swiftformer             ``SwiftFormerModel`` (additive attention): ``pixel_values [batch, 3, h, w]``
mobilevitv2             ``MobileViTV2Model`` (separable linear attention): ``pixel_values [batch, 3, 64, 64]``
aimv2_vision            ``Aimv2VisionModel`` (RMS norms, SwiGLU): ``pixel_values [batch, 3, 32, 32]``
ijepa                   ``IJepaModel``: ``pixel_values [batch, 3, 32, 32]``
prophetnet_encoder      ``ProphetNetEncoder``: ids and mask
bigbird_pegasus         ``BigBirdPegasusModel``'s encoder, full attention at these lengths: ids and mask
mgp_str                 ``MgpstrModel`` (character, BPE and word-piece queries on a ViT): ``pixel_values
                        [batch, 3, 32, 128]``
======================  =================================================================================
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round5"
VOCAB, HIDDEN = 256, 64


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module, fixed_images, taller_images, vision

    batch_seq = ((0, "batch"), (1, "sequence"))
    small = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128}  # fmt: skip

    def length(batch: int) -> int:
        return 4 + 3 * batch

    def ids_mask(batch: int) -> tuple:
        seq = length(batch)
        return torch.randint(3, VOCAB, (batch, seq)), torch.ones(batch, seq, dtype=torch.int64)

    def hidden(out):
        return out.last_hidden_state

    type_vocab = [3, 16, 16, 2, 16, 16, 10]

    def tapas():
        model = tf.TapasModel(tf.TapasConfig(**small, type_vocab_sizes=type_vocab, max_position_embeddings=256))
        return _module(lambda m, i, a, t: hidden(m(input_ids=i, attention_mask=a, token_type_ids=t)), 3)(model)

    def table(batch: int) -> tuple:
        ids, mask = ids_mask(batch)
        types = torch.stack([torch.randint(0, v, ids.shape) for v in type_vocab], -1)
        return ids, mask, types

    yield ("tapas", tapas, table, ("input_ids", "attention_mask", "token_type_ids"),
           (batch_seq, batch_seq, batch_seq))  # fmt: skip

    def roc_bert():
        model = tf.RoCBertModel(tf.RoCBertConfig(
            **small, shape_vocab_size=64, pronunciation_vocab_size=48, shape_embed_dim=16,
            pronunciation_embed_dim=16, max_position_embeddings=256,
        ))  # fmt: skip
        forward = lambda m, i, s, p, a: hidden(  # noqa: E731
            m(input_ids=i, input_shape_ids=s, input_pronunciation_ids=p, attention_mask=a)
        )
        return _module(forward, 4)(model)

    def chinese(batch: int) -> tuple:
        ids, mask = ids_mask(batch)
        return ids, torch.randint(0, 64, ids.shape), torch.randint(0, 48, ids.shape), mask

    yield ("roc_bert", roc_bert, chinese, ("input_ids", "input_shape_ids", "input_pronunciation_ids",
           "attention_mask"), (batch_seq,) * 4)  # fmt: skip

    def bros():
        model = tf.BrosModel(tf.BrosConfig(**small, max_position_embeddings=256, dim_bbox=8))
        return _module(lambda m, i, b, a: hidden(m(input_ids=i, bbox=b, attention_mask=a)), 3)(model)

    def boxes(batch: int) -> tuple:
        ids, mask = ids_mask(batch)
        corners = torch.rand(batch, ids.shape[1], 2) * 0.5
        size = torch.rand(batch, ids.shape[1], 2) * 0.5
        (x0, y0), (x1, y1) = corners.unbind(-1), (corners + size).unbind(-1)
        quad = torch.stack([x0, y0, x1, y0, x1, y1, x0, y1], -1)
        return ids, quad, mask

    yield "bros", bros, boxes, ("input_ids", "bbox", "attention_mask"), (batch_seq,) * 3

    def decision_transformer():
        model = tf.DecisionTransformerModel(tf.DecisionTransformerConfig(
            state_dim=11, act_dim=3, hidden_size=HIDDEN, max_ep_len=100, n_layer=2, n_head=4, n_inner=128,
            n_positions=256,
        ))  # fmt: skip

        def forward(m, *trajectory):
            names = ("states", "actions", "returns_to_go", "timesteps", "attention_mask")
            return m(**dict(zip(names, trajectory, strict=True))).action_preds

        return _module(forward, 5)(model)

    def trajectory(batch: int) -> tuple:
        steps = length(batch)
        timesteps = torch.arange(steps).expand(batch, -1).contiguous()
        mask = torch.ones(batch, steps, dtype=torch.int64)
        states, actions, returns = (torch.randn(batch, steps, width) for width in (11, 3, 1))
        return states, actions, returns, timesteps, mask

    yield ("decision_transformer", decision_transformer, trajectory,
           ("states", "actions", "returns_to_go", "timesteps", "attention_mask"), (batch_seq,) * 5)  # fmt: skip

    def sam_vision():
        model = tf.SamVisionModel(tf.SamVisionConfig(
            hidden_size=HIDDEN, output_channels=32, num_hidden_layers=2, num_attention_heads=4, image_size=64,
            patch_size=8, window_size=4, global_attn_indexes=[1], mlp_dim=128, use_rel_pos=True,
        ))  # fmt: skip
        return vision(model)

    yield "sam_vision", sam_vision, fixed_images(64), ("pixel_values",), ((0, "batch"),)

    def siglip2_vision():
        model = tf.Siglip2VisionModel(tf.Siglip2VisionConfig(
            hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, patch_size=8,
            num_patches=64,
        ))  # fmt: skip
        forward = lambda m, p, a, s: m(pixel_values=p, pixel_attention_mask=a, spatial_shapes=s).last_hidden_state  # noqa: E731
        return _module(forward, 3)(model)

    def naflex(batch: int) -> tuple:
        rows, cols = 4, 2 + batch
        patches = rows * cols + 2  # two padding patches past the image's
        mask = torch.ones(batch, patches, dtype=torch.int64)
        mask[:, rows * cols :] = 0
        shapes = torch.tensor([[rows, cols]] * batch)
        return torch.randn(batch, patches, 3 * 8 * 8), mask, shapes

    yield ("siglip2_vision", siglip2_vision, naflex, ("pixel_values", "pixel_attention_mask", "spatial_shapes"),
           ((0, "batch"),) * 3)  # fmt: skip  # the patch count fixed: spatial_shapes drive a resize of the table

    def swiftformer():
        model = tf.SwiftFormerModel(tf.SwiftFormerConfig(depths=[1, 1, 1, 1], embed_dims=[16, 24, 32, 48]))
        return vision(model)

    yield "swiftformer", swiftformer, taller_images, ("pixel_values",), (((0, "batch"), (2, "height")),)

    def mobilevitv2():
        model = tf.MobileViTV2Model(tf.MobileViTV2Config(image_size=64, width_multiplier=0.5))
        return vision(model)

    yield "mobilevitv2", mobilevitv2, taller_images, ("pixel_values",), (((0, "batch"), (2, "height")),)

    def aimv2_vision():
        model = tf.Aimv2VisionModel(tf.Aimv2VisionConfig(
            hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
            patch_size=8,
        ))  # fmt: skip
        return vision(model)

    yield "aimv2_vision", aimv2_vision, fixed_images(32), ("pixel_values",), ((0, "batch"),)

    def ijepa():
        model = tf.IJepaModel(tf.IJepaConfig(**{k: v for k, v in small.items() if k != "vocab_size"}, image_size=32,
                                             patch_size=8))  # fmt: skip
        return vision(model)

    yield "ijepa", ijepa, fixed_images(32), ("pixel_values",), ((0, "batch"),)

    def prophetnet_encoder():
        model = tf.ProphetNetEncoder(tf.ProphetNetConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, encoder_ffn_dim=128, num_encoder_layers=2,
            num_encoder_attention_heads=4, decoder_ffn_dim=128, num_decoder_layers=1, num_decoder_attention_heads=4,
            max_position_embeddings=256,
        ))  # fmt: skip
        return _module(lambda m, i, a: hidden(m(input_ids=i, attention_mask=a)), 2)(model)

    yield "prophetnet_encoder", prophetnet_encoder, ids_mask, ("input_ids", "attention_mask"), (batch_seq,) * 2

    def bigbird_pegasus():
        model = tf.BigBirdPegasusModel(tf.BigBirdPegasusConfig(
            vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=256,
            attention_type="original_full",
        )).get_encoder()  # fmt: skip
        return _module(lambda m, i, a: hidden(m(input_ids=i, attention_mask=a)), 2)(model)

    yield "bigbird_pegasus", bigbird_pegasus, ids_mask, ("input_ids", "attention_mask"), (batch_seq,) * 2

    def mgp_str():
        model = tf.MgpstrForSceneTextRecognition(tf.MgpstrConfig(
            image_size=[32, 128], patch_size=8, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
            mlp_ratio=2.0, max_token_length=12, num_character_labels=38, num_bpe_labels=100,
            num_wordpiece_labels=100,
        ))  # fmt: skip
        return _module(lambda m, p: m(pixel_values=p).logits[0], 1)(model)

    yield "mgp_str", mgp_str, fixed_images(32, 128), ("pixel_values",), ((0, "batch"),)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
