"""Held-out probe (issue 17), round 4: architectures no probe had sent: mixture-of-experts encoders and
decoders, a hybrid state-space decoder, a document encoder (text, layout and image patches), a latent
cross-attention encoder, a depth estimator, conformer and disentangled-attention speech encoders and a speech
encoder on raw audio. (ViLT is left out: its patch selection samples with ``multinomial``.)

Run ``python -m bench.heldout_round4 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; 2 layers, hidden 64, weights perturbed), exported
with the TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch at two other sizes:

==================  =====================================================================================
qwen3_moe           ``Qwen3MoeModel`` (q/k RMS norms, top-2 of 4 experts): ``input_ids``, ``attention_mask``
switch              ``SwitchTransformersEncoderModel`` (T5 with top-1 routed experts): ids and mask
umt5                ``UMT5EncoderModel`` (a relative position bias in every layer): ids and mask
biogpt              ``BioGptModel`` without a cache (scaled embeddings, learned positions): ids and mask
jamba               ``JambaModel`` (a Mamba layer and an attention layer, experts): ``input_ids [batch, 16]``
layoutlmv3          ``LayoutLMv3Model``: ``input_ids``, ``bbox [batch, sequence, 4]`` (0-1000, corners
                    ordered), ``attention_mask`` and ``pixel_values`` (the patches join the text)
perceiver           ``PerceiverModel`` without a preprocessor: ``inputs [batch, sequence, 48]`` cross-attended
                    by 8 latents
glpn                ``GLPNForDepthEstimation`` (SegFormer-like, keys and values spatially reduced):
                    ``pixel_values [batch, 3, height, width]``
w2v_conformer       ``Wav2Vec2ConformerModel`` (rotary conformer): ``input_values [batch, samples]``
w2v_bert            ``Wav2Vec2BertModel`` (relative-key conformer): ``input_features [batch, frames, 160]``,
                    ``attention_mask``
sew_d               ``SEWDModel`` (DeBERTa-style attention over audio frames): ``input_values``
moonshine_encoder   ``MoonshineModel``'s encoder (rotary, a conv stem on raw audio): ``input_values``
==================  =====================================================================================
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round4"
VOCAB, HIDDEN = 256, 64
RECURRENT_STEPS = 16  # Jamba's Mamba layer: a loop over the sequence, exported at this length


def _models():
    import torch
    import transformers as tf

    batch_seq = ((0, "batch"), (1, "sequence"))
    mask_names = ("input_ids", "attention_mask")

    def masked(batch: int) -> tuple:
        seq = 4 + 3 * batch
        return torch.randint(3, VOCAB, (batch, seq)), torch.ones(batch, seq, dtype=torch.int64)

    small = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128}  # fmt: skip

    def qwen3_moe():
        return _Hidden(tf.Qwen3MoeModel(tf.Qwen3MoeConfig(
            **small, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, decoder_sparse_step=1, max_position_embeddings=256,
        )), mask=True)  # fmt: skip

    yield "qwen3_moe", qwen3_moe, masked, mask_names, (batch_seq, batch_seq)

    def switch():
        return _Hidden(tf.SwitchTransformersEncoderModel(tf.SwitchTransformersConfig(
            vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=128, num_layers=2, num_sparse_encoder_layers=1,
            num_heads=4, num_experts=4, expert_capacity=64,
        )), mask=True)  # fmt: skip

    yield "switch", switch, masked, mask_names, (batch_seq, batch_seq)

    def umt5():
        return _Hidden(tf.UMT5EncoderModel(tf.UMT5Config(
            vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        )), mask=True)  # fmt: skip

    yield "umt5", umt5, masked, mask_names, (batch_seq, batch_seq)

    def biogpt():
        return _Hidden(tf.BioGptModel(tf.BioGptConfig(**small, max_position_embeddings=256)), mask=True)

    yield "biogpt", biogpt, masked, mask_names, (batch_seq, batch_seq)

    def jamba():
        return _Hidden(tf.JambaModel(tf.JambaConfig(
            **small, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, expert_layer_period=2,
            expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, use_mamba_kernels=False,
        )))  # fmt: skip

    def ids_fixed(batch: int) -> tuple:
        return (torch.randint(0, VOCAB, (batch, RECURRENT_STEPS)),)

    yield "jamba", jamba, ids_fixed, ("input_ids",), ((0, "batch"),)

    def layoutlmv3():
        return _Document(tf.LayoutLMv3Model(tf.LayoutLMv3Config(
            **small, max_position_embeddings=256, coordinate_size=12, shape_size=8, input_size=32, patch_size=8,
            num_channels=3, max_2d_position_embeddings=1024,
        )))  # fmt: skip

    def document(batch: int) -> tuple:
        seq = 4 + 3 * batch
        corners = torch.randint(0, 500, (batch, seq, 2))
        bbox = torch.cat([corners, corners + torch.randint(0, 500, (batch, seq, 2))], -1)
        ids, mask = masked(batch)
        return ids, bbox, mask, torch.randn(batch, 3, 32, 32)

    yield ("layoutlmv3", layoutlmv3, document, ("input_ids", "bbox", "attention_mask", "pixel_values"),
           (batch_seq, batch_seq, batch_seq, (0, "batch")))  # fmt: skip

    def perceiver():
        config = tf.PerceiverConfig(
            num_latents=8, d_latents=HIDDEN, d_model=48, num_blocks=1, num_self_attends_per_block=2,
            num_self_attention_heads=4, num_cross_attention_heads=4, qk_channels=HIDDEN, v_channels=HIDDEN,
        )  # fmt: skip
        return _Latents(tf.PerceiverModel(config))

    def sequence_48(batch: int) -> tuple:
        return (torch.randn(batch, 4 + 3 * batch, 48),)

    yield "perceiver", perceiver, sequence_48, ("inputs",), (batch_seq,)

    def glpn():
        return _Depth(tf.GLPNForDepthEstimation(tf.GLPNConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
            strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=16,
        )))  # fmt: skip

    def image(batch: int) -> tuple:
        return (torch.randn(batch, 3, 32 + 16 * batch, 64),)

    yield "glpn", glpn, image, ("pixel_values",), (((0, "batch"), (2, "height"), (3, "width")),)

    audio_conv = {"conv_dim": (16, 16), "conv_stride": (5, 2), "conv_kernel": (10, 3), "num_feat_extract_layers": 2,
                  "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2}  # fmt: skip

    def w2v_conformer():
        return _Audio(tf.Wav2Vec2ConformerModel(tf.Wav2Vec2ConformerConfig(
            **small, **audio_conv, position_embeddings_type="rotary", conv_depthwise_kernel_size=3,
        )))  # fmt: skip

    def waveform(batch: int) -> tuple:
        return (torch.randn(batch, 400 + 160 * batch),)

    yield "w2v_conformer", w2v_conformer, waveform, ("input_values",), (batch_seq,)

    def w2v_bert():
        return _Masked(tf.Wav2Vec2BertModel(tf.Wav2Vec2BertConfig(
            **small, feature_projection_input_dim=160, conv_depthwise_kernel_size=3,
            position_embeddings_type="relative_key", left_max_position_embeddings=16, right_max_position_embeddings=4,
            add_adapter=False,
        )), "input_features")  # fmt: skip

    def features(batch: int) -> tuple:
        frames = 6 + 4 * batch
        return torch.randn(batch, frames, 160), torch.ones(batch, frames, dtype=torch.int64)

    yield "w2v_bert", w2v_bert, features, ("input_features", "attention_mask"), (batch_seq, batch_seq)

    def sew_d():
        return _Audio(tf.SEWDModel(tf.SEWDConfig(
            **small, **audio_conv, squeeze_factor=2, max_position_embeddings=64, position_buckets=16,
        )))  # fmt: skip

    yield "sew_d", sew_d, waveform, ("input_values",), (batch_seq,)

    def moonshine_encoder():
        model = tf.MoonshineModel(tf.MoonshineConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, encoder_num_hidden_layers=2,
            decoder_num_hidden_layers=1, encoder_num_attention_heads=4, decoder_num_attention_heads=4,
            max_position_embeddings=512,
        ))  # fmt: skip
        return _Audio(model.get_encoder())

    def waveform_long(batch: int) -> tuple:
        return (torch.randn(batch, 1000 + 640 * batch),)

    yield "moonshine_encoder", moonshine_encoder, waveform_long, ("input_values",), (batch_seq,)


def _module(forward, arity: int):
    """A torch module whose ``forward`` takes ``arity`` tensors and returns ``forward(inner, *tensors)``
    (made on first use: torch is imported only by ``build``). Its signature names each argument, as
    torch.export matches dynamic shapes to them."""
    import torch

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    class One(Wrapped):
        def forward(self, a):
            return forward(self.inner, a)

    class Two(Wrapped):
        def forward(self, a, b):
            return forward(self.inner, a, b)

    class Three(Wrapped):
        def forward(self, a, b, c):
            return forward(self.inner, a, b, c)

    class Four(Wrapped):
        def forward(self, a, b, c, d):
            return forward(self.inner, a, b, c, d)

    class Five(Wrapped):
        def forward(self, a, b, c, d, e):
            return forward(self.inner, a, b, c, d, e)

    return (One, Two, Three, Four, Five)[arity - 1]


def _Hidden(model, mask: bool = False):
    if mask:
        forward = lambda m, ids, att: m(input_ids=ids, attention_mask=att, use_cache=False).last_hidden_state  # noqa: E731
        return _module(forward, 2)(model)
    return _module(lambda m, ids: m(input_ids=ids, use_cache=False).last_hidden_state, 1)(model)


def _Masked(model, first: str):
    return _module(lambda m, x, att: m(**{first: x}, attention_mask=att).last_hidden_state, 2)(model)


def _Document(model):
    return _module(lambda m, ids, bbox, att, pix: m(input_ids=ids, bbox=bbox, attention_mask=att,
                                                   pixel_values=pix).last_hidden_state, 4)(model)  # fmt: skip


def _Latents(model):
    return _module(lambda m, x: m(inputs=x).last_hidden_state, 1)(model)


def _Depth(model):
    return _module(lambda m, pix: m(pixel_values=pix).predicted_depth, 1)(model)


def _Audio(model):
    return _module(lambda m, x: m(input_values=x).last_hidden_state, 1)(model)


def image_hidden(model):
    """``model`` (eval mode) as a module from ``pixel_values`` to its ``last_hidden_state``."""
    return _module(lambda m, p: m(pixel_values=p).last_hidden_state, 1)(model.eval())


def fixed_images(side: int, width: int | None = None):
    """An example maker: ``batch`` images of ``side`` x ``width or side`` pixels, for the later rounds' exports that
    fix the image size."""

    def example(batch: int) -> tuple:
        import torch

        return (torch.randn(batch, 3, side, width or side),)

    return example


def taller_images(batch: int) -> tuple:
    """``batch`` images 64 pixels wide whose height grows with the batch, for exports with a free height."""
    import torch

    return (torch.randn(batch, 3, 64 + 32 * batch, 64),)


def vision(model):
    """``model``'s ``last_hidden_state`` from ``pixel_values`` (the round-5 and round-6 probes' image towers)."""
    return _module(lambda m, p: m(pixel_values=p).last_hidden_state, 1)(model)


def built(models, only: list[str] | None):
    """``models`` (name, module maker, example, input names, free axes) with each module made, those of ``only``
    if given; a config the installed transformers refuses is a printed row (the round-5 probe's too)."""
    for name, make, example, names, dims in models:
        if only and name not in only:
            continue
        try:
            module = make()
        except Exception as exc:  # a row of the table, not the end of the probe
            print(name, "config refused:", type(exc).__name__, str(exc).splitlines()[0][:200], flush=True)
            continue
        yield name, module, example, names, dims


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
