"""Held-out probe (issue 17), round 3: architectures no probe had sent: state-space and recurrent language
models, a neural audio codec, text-to-speech, an OCR decoder and a vision encoder fed flattened patches.

Run ``python -m bench.heldout_round3 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; 2 layers, hidden 64, weights perturbed), exported
with the TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch at two other sizes:

==============  =========================================================================================
mamba           ``MambaModel``: ``input_ids [batch, 16]`` (the selective scan, written as a loop over the
                sequence in transformers' CPU path, which both exporters unroll or specialize: the length fixed)
rwkv            ``RwkvModel``: ``input_ids [batch, 16]`` (the WKV recurrence, a loop over time on CPU)
encodec         ``EncodecModel`` encode then decode: ``input_values [batch, 1, samples]`` to the
                reconstructed audio, through the residual vector quantizer's nearest-code ``argmin``
vits            ``VitsModel`` (MMS-TTS) with both noise scales 0, so that it is deterministic: ``input_ids`` to
                the waveform, whose length the predicted durations decide
trocr           ``TrOCRForCausalLM`` without a cache: ``input_ids`` and the image encoder's
                ``encoder_hidden_states [batch, patches, hidden]`` to logits
pix2struct      ``Pix2StructVisionModel``: ``flattened_patches [batch, patches, 2 + 16*16*3]`` whose first two
                columns are each patch's row and column (1-based; the embedding gathers by them), and the
                patches' ``attention_mask``
esm, fnet,      ESM-2 (rotary BERT for proteins), FNet (Fourier mixing: no attention), Funnel (pooled
funnel, xlnet   queries; at a fixed length of 16, as both exporters trace its pooling), XLNet (relative
                attention over einsums): ``input_ids`` and the mask (FNet: ids alone)
llama_embeds    ``LlamaModel`` fed ``inputs_embeds [batch, sequence, hidden]`` and its mask, no ids (how a
                vision-language model's decoder is exported: the image features merged into the embeddings)
==============  =========================================================================================
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round3"
VOCAB, HIDDEN = 256, 64
# Both exporters unroll (TorchScript) or specialize (dynamo) the recurrences' Python loop over the sequence:
# those models are exported at this fixed length, their batch free, as users of them export.
RECURRENT_STEPS = 16


def _models():
    import torch
    import transformers as tf

    def ids(batch: int) -> tuple:
        return (torch.randint(0, VOCAB, (batch, 4 + 3 * batch)),)

    def ids_fixed(batch: int) -> tuple:
        return (torch.randint(0, VOCAB, (batch, RECURRENT_STEPS)),)

    batch_seq = ((0, "batch"), (1, "sequence"))
    mask_names = ("input_ids", "attention_mask")

    def masked(batch: int) -> tuple:
        seq = 4 + 3 * batch
        return torch.randint(3, VOCAB, (batch, seq)), torch.ones(batch, seq, dtype=torch.int64)

    def masked_16(batch: int) -> tuple:  # Funnel's pooling is traced at the example's length: a fixed one
        return torch.randint(3, VOCAB, (batch, 16)), torch.ones(batch, 16, dtype=torch.int64)

    mamba = tf.MambaModel(tf.MambaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
    ))  # fmt: skip
    yield "mamba", _Hidden(mamba), ids_fixed, ("input_ids",), ((0, "batch"),)
    rwkv = tf.RwkvModel(tf.RwkvConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, attention_hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN, context_length=128,
    ))  # fmt: skip
    yield "rwkv", _Hidden(rwkv), ids_fixed, ("input_ids",), ((0, "batch"),)

    encodec = tf.EncodecModel(tf.EncodecConfig(
        target_bandwidths=[6.0, 12.0], sampling_rate=8000, audio_channels=1, hidden_size=32, num_filters=8,
        num_residual_layers=1, upsampling_ratios=[4, 2], codebook_size=64, codebook_dim=32, num_lstm_layers=1,
    ))  # fmt: skip

    class Codec(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_values):
            return self.model(input_values=input_values, bandwidth=12.0).audio_values

    def audio(batch: int) -> tuple:
        return (torch.randn(batch, 1, 256 * (1 + batch)),)

    yield "encodec", Codec(encodec), audio, ("input_values",), (((0, "batch"), (2, "samples")),)

    vits = tf.VitsModel(tf.VitsConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
        flow_size=16, spectrogram_bins=33, upsample_initial_channel=32, upsample_rates=[4, 4],
        upsample_kernel_sizes=[8, 8], resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]],
        prior_encoder_num_flows=2, prior_encoder_num_wavenet_layers=2, posterior_encoder_num_wavenet_layers=2,
        duration_predictor_num_flows=2, depth_separable_num_layers=2, noise_scale=0.0, noise_scale_duration=0.0,
    ))  # fmt: skip

    class Speech(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).waveform

    def text(batch: int) -> tuple:
        return (torch.randint(1, VOCAB, (1, 4 + 3 * batch)),)  # one utterance: a batch pads to the longest

    yield "vits", Speech(vits), text, ("input_ids",), ((1, "sequence"),)

    trocr = tf.TrOCRForCausalLM(tf.TrOCRConfig(
        vocab_size=VOCAB, d_model=HIDDEN, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128,
        cross_attention_hidden_size=48, use_cache=False,
    ))  # fmt: skip

    class Ocr(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, encoder_hidden_states):
            return self.model(input_ids=input_ids, encoder_hidden_states=encoder_hidden_states, use_cache=False).logits

    def ocr(batch: int) -> tuple:
        return (torch.randint(0, VOCAB, (batch, 3 + batch)), torch.randn(batch, 10 + batch, 48))

    yield "trocr", Ocr(trocr), ocr, ("input_ids", "encoder_hidden_states"), (batch_seq, ((0, "batch"), (1, "patches")))

    pix = tf.Pix2StructVisionModel(tf.Pix2StructVisionConfig(
        hidden_size=HIDDEN, d_ff=128, d_kv=16, num_hidden_layers=2, num_attention_heads=4, patch_embed_hidden_size=768,
        seq_len=64,
    ))  # fmt: skip

    class Vision(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, flattened_patches, attention_mask):
            return self.model(flattened_patches=flattened_patches, attention_mask=attention_mask).last_hidden_state

    def patches(batch: int) -> tuple:
        rows, cols = 2 + batch, 4
        grid = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1).reshape(-1, 2)
        flat = torch.cat([(grid + 1).float(), torch.randn(rows * cols, 768)], -1)
        return flat.expand(batch, -1, -1).contiguous(), torch.ones(batch, rows * cols)

    yield "pix2struct", Vision(pix), patches, ("flattened_patches", "attention_mask"), (batch_seq, batch_seq)

    llama = tf.LlamaModel(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    ))  # fmt: skip

    class Embeds(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, inputs_embeds, attention_mask):
            out = self.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, use_cache=False)
            return out.last_hidden_state

    def embeds(batch: int) -> tuple:
        return (torch.randn(batch, 4 + 3 * batch, HIDDEN), torch.ones(batch, 4 + 3 * batch, dtype=torch.int64))

    yield "llama_embeds", Embeds(llama), embeds, ("inputs_embeds", "attention_mask"), (batch_seq, batch_seq)

    small = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128}  # fmt: skip
    esm = tf.EsmModel(tf.EsmConfig(**small, position_embedding_type="rotary", pad_token_id=1, mask_token_id=2))
    yield "esm", _Masked(esm), masked, mask_names, (batch_seq, batch_seq)
    fnet = tf.FNetModel(tf.FNetConfig(**{k: v for k, v in small.items() if k != "num_attention_heads"}))
    yield "fnet", _Hidden(fnet), ids, ("input_ids",), (batch_seq,)
    funnel = tf.FunnelBaseModel(tf.FunnelConfig(
        vocab_size=VOCAB, block_sizes=[1, 1], d_model=HIDDEN, n_head=4, d_head=16, d_inner=128,
    ))  # fmt: skip
    yield "funnel", _Masked(funnel), masked_16, mask_names, ((0, "batch"), (0, "batch"))
    xlnet = tf.XLNetModel(tf.XLNetConfig(vocab_size=VOCAB, d_model=HIDDEN, n_layer=2, n_head=4, d_inner=128))
    yield "xlnet", _Masked(xlnet), masked, mask_names, (batch_seq, batch_seq)


class _Masked:
    """A model's ``last_hidden_state`` from ``input_ids`` and ``attention_mask`` (a torch module on first use)."""

    def __new__(cls, model):
        import torch

        class Masked(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, attention_mask):
                return self.inner(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

        return Masked(model)


class _Hidden:
    """A model's ``last_hidden_state`` from ``input_ids`` (made a torch module on first use: torch is imported
    only by ``build``)."""

    def __new__(cls, model):
        import torch

        class Hidden(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids):
                return self.inner(input_ids=input_ids, use_cache=False).last_hidden_state

        return Hidden(model)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main

    probe_main(OUT, lambda only: build_models(_models(), OUT, only))
