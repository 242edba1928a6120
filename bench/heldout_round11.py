"""Held-out probe (issue 17), round 11: encoders of translation and long-document models no round had sent
(PEGASUS-X's block-local attention with global tokens, FSMT's, NLLB-MoE's with its top-2 experts), ZoeDepth on a
BEiT backbone (relative position bias per layer, metric bins), and Llama 3.2 Vision's tiled image tower (gated
global layers, aspect-ratio embeddings).

Run ``python -m bench.heldout_round11 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; tiny, weights perturbed), exported with the
TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch at two other sizes:

==============  ============================================================================================
pegasus_x       ``PegasusXModel``'s encoder: ``input_ids``, ``attention_mask [batch, sequence]``
fsmt            ``FSMTModel``'s encoder: ``input_ids``, ``attention_mask [batch, sequence]``
nllb_moe        ``NllbMoeModel``'s encoder: ``input_ids``, ``attention_mask [batch, sequence]``
zoedepth        ``ZoeDepthForDepthEstimation`` (BEiT backbone): ``pixel_values [batch, 3, 64, 64]`` -> depth
mllama_vision   ``MllamaVisionModel``: ``pixel_values [batch, 1 image, 1 tile, 3, 32, 32]``, aspect-ratio ids
                and mask
==============  ============================================================================================
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round11"
HIDDEN, VOCAB = 32, 128
_SEQ2SEQ = {"d_model": HIDDEN, "encoder_layers": 2, "decoder_layers": 1, "encoder_attention_heads": 2,
            "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}  # fmt: skip


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module, fixed_images

    batch_seq = ((0, "batch"), (1, "sequence"))

    def encoder_of(model):
        return _module(lambda m, i, a: m.get_encoder()(input_ids=i, attention_mask=a).last_hidden_state, 2)(
            model.eval()
        )

    def ids_mask(batch: int) -> tuple:
        seq = 8 + 8 * batch
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[0, seq - 3 :] = 0  # a padded row
        return torch.randint(3, VOCAB, (batch, seq)), mask

    def pegasus_x():
        return encoder_of(tf.PegasusXModel(tf.PegasusXConfig(
            vocab_size=VOCAB, max_position_embeddings=256, num_global_tokens=4, block_size=8,
            stagger_local_blocks=True, pad_token_id=0, **_SEQ2SEQ,
        )))  # fmt: skip

    def fsmt():
        return encoder_of(tf.FSMTModel(tf.FSMTConfig(
            langs=["en", "de"], src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, max_position_embeddings=64,
            pad_token_id=1, **_SEQ2SEQ,
        )))  # fmt: skip

    def nllb_moe():
        return encoder_of(tf.NllbMoeModel(tf.NllbMoeConfig(
            vocab_size=VOCAB, max_position_embeddings=64, num_experts=4, expert_capacity=64, encoder_sparse_step=2,
            decoder_sparse_step=2, pad_token_id=1, **_SEQ2SEQ,
        )))  # fmt: skip

    for name, make in (("pegasus_x", pegasus_x), ("fsmt", fsmt), ("nllb_moe", nllb_moe)):
        yield name, make, ids_mask, ("input_ids", "attention_mask"), (batch_seq, batch_seq)

    def zoedepth():
        backbone = tf.BeitConfig(
            image_size=64, patch_size=16, hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=2,
            intermediate_size=64, use_relative_position_bias=True, use_absolute_position_embeddings=False,
            out_indices=[1, 2, 3, 4], reshape_hidden_states=False,
        )  # fmt: skip
        model = tf.ZoeDepthForDepthEstimation(tf.ZoeDepthConfig(
            backbone_config=backbone, neck_hidden_sizes=[8, 16, 16, 16], fusion_hidden_size=16,
            bottleneck_features=16, num_attractors=[4, 2, 1, 1], bin_embedding_dim=16, num_relative_features=8,
            patch_transformer_hidden_size=16, patch_transformer_intermediate_size=32,
            patch_transformer_num_attention_heads=2, bin_configurations=[{"n_bins": 8, "min_depth": 0.001,
                                                                          "max_depth": 10.0}],
        ))  # fmt: skip
        return _module(lambda m, p: m(pixel_values=p).predicted_depth, 1)(model.eval())

    yield "zoedepth", zoedepth, fixed_images(64), ("pixel_values",), (((0, "batch"),),)

    def mllama_vision():
        model = tf.MllamaVisionModel(tf.MllamaVisionConfig(
            hidden_size=HIDDEN, num_hidden_layers=2, num_global_layers=1, attention_heads=2, intermediate_size=64,
            vision_output_dim=3 * HIDDEN, image_size=32, patch_size=8, max_num_tiles=2, intermediate_layers_indices=[0],
            supported_aspect_ratios=[[1, 1], [1, 2]],
        ))  # fmt: skip
        return _module(lambda m, p, r, k: m(pixel_values=p, aspect_ratio_ids=r, aspect_ratio_mask=k)
                       .last_hidden_state, 3)(model.eval())  # fmt: skip

    def tiles(batch: int) -> tuple:
        return (torch.randn(batch, 1, 1, 3, 32, 32), torch.ones(batch, 1, dtype=torch.int64),
                torch.tensor([[[1, 0]]] * batch, dtype=torch.int64))  # fmt: skip

    yield ("mllama_vision", mllama_vision, tiles, ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"),
           (((0, "batch"),),) * 3)  # fmt: skip


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
