"""Held-out probe (issue 17), round 12: text encoders and small generators no round had sent: embedding models
with rotary and gated MLPs (Nomic BERT, GTE, Jina embeddings v3, EmbeddingGemma 2, UltraBERT), RoBERTa with its
norms before each block, XLM-R XL, MRA's and BigBird's approximate attention at short lengths, DPR's question
encoder, GPT-1, CTRL and ImageGPT without a cache, and ViT-MAE's encoder with nothing masked.

Run ``python -m bench.heldout_round12 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; 2 layers, hidden 64, 4 heads, weights perturbed),
exported with the TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch at two other
sizes. Text models take ``input_ids`` and ``attention_mask [batch, sequence]`` (a padded row), except GPT-1 and
CTRL (ids and mask, no padding: causal; GPT-1 at hidden 32, 64 positions) and ImageGPT (``input_ids`` over its
16-colour palette plus 1); ViT-MAE takes ``pixel_values [batch, 3, 32, 32]`` with ``mask_ratio=0`` and its
shuffle's noise in patch order (every patch kept where it was, so the export is deterministic).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round12"
VOCAB, HIDDEN = 256, 64
_SMALL = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128}  # fmt: skip


def padded(batch: int) -> tuple:
    """``batch`` rows of token ids and their mask, the first row padded (rounds 12 and 13)."""
    import torch

    seq = 8 + 5 * batch
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[0, seq - 3 :] = 0
    return torch.randint(3, VOCAB, (batch, seq)), mask


def hidden(model):
    """``model``'s ``last_hidden_state`` from ``input_ids`` and ``attention_mask`` (rounds 12 and 13)."""
    from bench.heldout_round4 import _module

    return _module(lambda m, i, a: m(input_ids=i, attention_mask=a).last_hidden_state, 2)(model.eval())


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _Hidden, _module, fixed_images

    batch_seq = ((0, "batch"), (1, "sequence"))
    names = ("input_ids", "attention_mask")

    def unpadded(batch: int) -> tuple:
        seq = 8 + 5 * batch
        return torch.randint(3, VOCAB, (batch, seq)), torch.ones(batch, seq, dtype=torch.int64)

    encoders = {
        "nomic_bert": lambda: tf.NomicBertModel(tf.NomicBertConfig(**_SMALL, max_position_embeddings=128)),
        "gte": lambda: tf.GteModel(tf.GteConfig(**_SMALL, max_position_embeddings=128)),
        "jina_embeddings_v3": lambda: tf.JinaEmbeddingsV3Model(
            tf.JinaEmbeddingsV3Config(**_SMALL, max_position_embeddings=128)
        ),
        "embedding_gemma2": lambda: tf.EmbeddingGemma2Model(  # its text model's own config: the wrapper's is not read
            tf.EmbeddingGemma2Config(
                text_config={**_SMALL, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128}
            )
        ),
        "ultrabert": lambda: tf.UltrabertModel(tf.UltrabertConfig(**_SMALL, max_position_embeddings=128)),
        "roberta_prelayernorm": lambda: tf.RobertaPreLayerNormModel(
            tf.RobertaPreLayerNormConfig(**_SMALL, max_position_embeddings=128, pad_token_id=1)
        ),
        "xlm_roberta_xl": lambda: tf.XLMRobertaXLModel(
            tf.XLMRobertaXLConfig(**_SMALL, max_position_embeddings=128, pad_token_id=1)
        ),
        "mra": lambda: tf.MraModel(tf.MraConfig(**_SMALL, max_position_embeddings=128)),
        "big_bird": lambda: tf.BigBirdModel(
            tf.BigBirdConfig(
                **_SMALL,
                max_position_embeddings=128,
                attention_type="block_sparse",
                block_size=4,
                num_random_blocks=2,
            )
        ),
        "dpr": lambda: tf.DPRQuestionEncoder(tf.DPRConfig(**_SMALL, max_position_embeddings=128)),
    }
    for name, make in encoders.items():
        if name == "dpr":  # the pooled question embedding, DPR's output
            wrap = _module(lambda m, i, a: m(input_ids=i, attention_mask=a).pooler_output, 2)
            yield name, (lambda make=make, wrap=wrap: wrap(make().eval())), padded, names, (batch_seq, batch_seq)
        else:
            yield name, (lambda make=make: hidden(make())), padded, names, (batch_seq, batch_seq)

    def openai_gpt():  # narrower, its export is a regression test's (tests/passes/test_fuse_multiplied_mask.py)
        return hidden(tf.OpenAIGPTModel(tf.OpenAIGPTConfig(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN // 2,
                                                            n_layer=2, n_head=4)))  # fmt: skip

    def ctrl():
        return _Hidden(tf.CTRLModel(tf.CTRLConfig(vocab_size=VOCAB, n_positions=128, n_embd=HIDDEN, dff=128,
                                                  n_layer=2, n_head=4)).eval(), mask=True)  # fmt: skip

    yield "openai_gpt", openai_gpt, unpadded, names, (batch_seq, batch_seq)
    yield "ctrl", ctrl, unpadded, names, (batch_seq, batch_seq)

    def imagegpt():
        model = tf.ImageGPTModel(tf.ImageGPTConfig(vocab_size=17, n_positions=64, n_embd=HIDDEN, n_layer=2,
                                                   n_head=4))  # fmt: skip
        return _Hidden(model.eval())

    def pixels(batch: int) -> tuple:
        return (torch.randint(0, 17, (batch, 8 + 5 * batch)),)

    yield "imagegpt", imagegpt, pixels, ("input_ids",), (batch_seq,)

    def vit_mae():
        config = tf.ViTMAEConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 image_size=32, patch_size=8, mask_ratio=0.0)  # fmt: skip
        model = tf.ViTMAEModel(config)
        # noise in patch order: the shuffle then keeps every patch where it was (torch's random noise would not)
        order = lambda p: torch.arange(16, dtype=p.dtype).expand(p.shape[0], 16)  # noqa: E731
        return _module(lambda m, p: m(pixel_values=p, noise=order(p)).last_hidden_state, 1)(model.eval())

    yield "vit_mae", vit_mae, fixed_images(32), ("pixel_values",), (((0, "batch"),),)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
