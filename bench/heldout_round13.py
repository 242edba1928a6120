"""Held-out probe (issue 17), round 13: encoders no round had sent, several with an attention layout of their own:
SqueezeBERT (q, k, v from grouped 1-D convolutions over ``[batch, channels, sequence]``), ConvBERT (span-based
dynamic convolution beside attention), Megatron-BERT (norms before each block), RemBERT (decoupled embeddings),
ERNIE, X-MOD (a language adapter per layer), Swin v2 (cosine attention with a learned logit scale, a continuous
position bias), PVT v2 (keys and values spatially reduced), HuBERT and Data2Vec audio (raw audio). Left out: LiLT
(its layout stream splits the hidden size six ways, not at this width) and Nyströmformer (its segment means need
the sequence at the config's fixed length).

Run ``python -m bench.heldout_round13 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; 2 layers, hidden 64, 4 heads, weights perturbed),
exported with the TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch at two other
sizes. Text models take ``input_ids`` and ``attention_mask [batch, sequence]`` (a padded row); the image models
``pixel_values [batch, 3, 64, 64]``; the audio models ``input_values [batch, samples]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round13"
VOCAB, HIDDEN = 256, 64
_SMALL = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "max_position_embeddings": 128}  # fmt: skip


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module, fixed_images
    from bench.heldout_round12 import hidden, padded

    batch_seq = ((0, "batch"), (1, "sequence"))
    batch_axis = ((0, "batch"),)
    names = ("input_ids", "attention_mask")

    encoders = {
        "squeezebert": lambda: tf.SqueezeBertModel(tf.SqueezeBertConfig(**_SMALL, embedding_size=HIDDEN)),
        "convbert": lambda: tf.ConvBertModel(tf.ConvBertConfig(**_SMALL, embedding_size=HIDDEN, conv_kernel_size=3)),
        "megatron_bert": lambda: tf.MegatronBertModel(tf.MegatronBertConfig(**_SMALL)),
        "rembert": lambda: tf.RemBertModel(
            tf.RemBertConfig(**_SMALL, input_embedding_size=32, output_embedding_size=32)
        ),
        "ernie": lambda: tf.ErnieModel(tf.ErnieConfig(**_SMALL)),
        "xmod": lambda: tf.XmodModel(tf.XmodConfig(**_SMALL, pad_token_id=1, languages=["en_XX"])),
    }

    def in_english(model):
        model.set_default_language("en_XX")
        return model

    for name, make in encoders.items():
        wrap = (lambda make=make: hidden(in_english(make()))) if name == "xmod" else (lambda make=make: hidden(make()))
        yield name, wrap, padded, names, (batch_seq, batch_seq)

    def swinv2():
        model = tf.Swinv2Model(tf.Swinv2Config(image_size=64, patch_size=4, embed_dim=16, depths=[2, 2],
                                               num_heads=[2, 4], window_size=4))  # fmt: skip
        return _module(lambda m, p: m(pixel_values=p).last_hidden_state, 1)(model.eval())

    def pvt_v2():
        model = tf.PvtV2Model(tf.PvtV2Config(image_size=64, num_encoder_blocks=2, depths=[1, 1], hidden_sizes=[16, 32],
                                             num_attention_heads=[1, 2], sr_ratios=[4, 2], patch_sizes=[7, 3],
                                             strides=[4, 2], mlp_ratios=[2, 2]))  # fmt: skip
        return _module(lambda m, p: m(pixel_values=p).last_hidden_state, 1)(model.eval())

    yield "swinv2", swinv2, fixed_images(64), ("pixel_values",), (batch_axis,)
    yield "pvt_v2", pvt_v2, fixed_images(64), ("pixel_values",), (batch_axis,)

    audio = {"conv_dim": (16, 16), "conv_stride": (5, 2), "conv_kernel": (10, 3), "num_feat_extract_layers": 2,
             "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2, "mask_time_prob": 0.0}  # fmt: skip
    small = {k: v for k, v in _SMALL.items() if k not in ("vocab_size", "max_position_embeddings")}

    def waveform(batch: int) -> tuple:
        return (torch.randn(batch, 400 + 160 * batch),)

    for name, config, model in (("hubert", "HubertConfig", "HubertModel"),
                                ("data2vec_audio", "Data2VecAudioConfig", "Data2VecAudioModel")):  # fmt: skip
        make = lambda c=config, m=model: _module(  # noqa: E731
            lambda mod, x: mod(input_values=x).last_hidden_state, 1
        )(getattr(tf, m)(getattr(tf, c)(**small, **audio)).eval())
        yield name, make, waveform, ("input_values",), (batch_seq,)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
