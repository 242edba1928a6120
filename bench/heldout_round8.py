"""Held-out probe (issue 17), round 8: the encoders inside recent speech and multimodal models, and vision
backbones no round had sent: Voxtral's and Qwen2-Audio's audio encoders (Whisper-like), Granite Speech's
Conformer (block-local attention with Shaw relative positions), T5Gemma's encoder, a bidirectional Gemma 3
(EmbeddingGemma's form), V-JEPA 2 (3-D rope over video), Florence-2's DaViT (channel attention and window
attention), HGNetV2 (a convolutional detector backbone).

Run ``python -m bench.heldout_round8 build [NAME ...]`` (the dev extra's torch and transformers), then ``run``.

Models from transformers config objects (nothing downloaded; tiny, weights perturbed), exported with the
TorchScript exporter (opset 17) and dynamo (opset 18), each checked against torch at two other sizes:

======================  =======================================================================
voxtral_encoder         ``VoxtralEncoder``: ``input_features [batch, 16 mels, 32 frames]``
qwen2_audio_encoder     ``Qwen2AudioEncoder``: ``input_features [batch, 16 mels, 32 frames]``
granite_speech_encoder  ``GraniteSpeechCTCEncoder``: ``input_features [batch, frames, 16]``
t5gemma_encoder         ``T5GemmaEncoderModel``: ``input_ids``, ``attention_mask [batch, sequence]``
embeddinggemma          ``Gemma3TextModel``, bidirectional (EmbeddingGemma's): ``input_ids``, ``attention_mask``
vjepa2                  ``VJEPA2Model``: ``pixel_values_videos [batch, 2 frames, 3, 32, 32]``
florence2_vision        ``Florence2VisionBackbone``: ``pixel_values [batch, 3, 64, 64]``
hgnetv2                 ``HGNetV2ForImageClassification``: ``pixel_values [batch, 3, h, 64]``
======================  =======================================================================
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "round8"
HIDDEN, VOCAB = 32, 128


def _models():
    import torch
    import transformers as tf

    from bench.heldout_round4 import _module, fixed_images, taller_images

    def hidden(out):
        return out.last_hidden_state

    def mels(batch: int) -> tuple:  # Whisper-like encoders take exactly 2 x max_source_positions frames
        return (torch.randn(batch, 16, 32),)

    whisper_like = {"num_mel_bins": 16, "max_source_positions": 16, "d_model": HIDDEN, "encoder_layers": 2,
                    "encoder_attention_heads": 2, "encoder_ffn_dim": 64}  # fmt: skip

    def voxtral_encoder():
        model = tf.VoxtralEncoder(tf.VoxtralEncoderConfig(
            num_mel_bins=16, max_source_positions=16, hidden_size=HIDDEN, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=64,
        ))  # fmt: skip
        return _module(lambda m, f: hidden(m(input_features=f)), 1)(model)

    yield "voxtral_encoder", voxtral_encoder, mels, ("input_features",), ((0, "batch"),)

    def qwen2_audio_encoder():
        model = tf.Qwen2AudioEncoder(tf.Qwen2AudioEncoderConfig(**whisper_like))
        return _module(lambda m, f: hidden(m(input_features=f)), 1)(model)

    yield "qwen2_audio_encoder", qwen2_audio_encoder, mels, ("input_features",), ((0, "batch"),)

    def granite_speech_encoder():
        model = tf.GraniteSpeechCTCEncoder(tf.GraniteSpeechEncoderConfig(
            input_dim=16, num_layers=2, hidden_dim=HIDDEN, feedforward_mult=2, num_heads=2, dim_head=16,
            output_dim=24, context_size=8, max_pos_emb=64, conv_kernel_size=3,
        ))  # fmt: skip
        return _module(lambda m, f: m(hidden_states=f), 1)(model)

    def frames(batch: int) -> tuple:
        return (torch.randn(batch, 12 + 4 * batch, 16),)

    yield ("granite_speech_encoder", granite_speech_encoder, frames, ("input_features",),
           (((0, "batch"), (1, "frames")),))  # fmt: skip

    def t5gemma_encoder():
        ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
        layer = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, **ids}  # fmt: skip
        model = tf.T5GemmaEncoderModel(tf.T5GemmaConfig(
            encoder=tf.T5GemmaModuleConfig(**layer), decoder=tf.T5GemmaModuleConfig(**layer), vocab_size=VOCAB,
            is_encoder_decoder=False, **ids,
        ))  # fmt: skip
        return _module(lambda m, i, a: hidden(m(input_ids=i, attention_mask=a)), 2)(model)

    def ids_mask(batch: int) -> tuple:
        seq = 4 + 3 * batch
        return torch.randint(3, VOCAB, (batch, seq)), torch.ones(batch, seq, dtype=torch.int64)

    yield ("t5gemma_encoder", t5gemma_encoder, ids_mask, ("input_ids", "attention_mask"),
           (((0, "batch"), (1, "sequence")),) * 2)  # fmt: skip

    def embeddinggemma():
        ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
        model = tf.Gemma3TextModel(tf.Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, use_bidirectional_attention=True, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], **ids,
        ))  # fmt: skip
        return _module(lambda m, i, a: hidden(m(input_ids=i, attention_mask=a)), 2)(model)

    yield ("embeddinggemma", embeddinggemma, ids_mask, ("input_ids", "attention_mask"),
           (((0, "batch"), (1, "sequence")),) * 2)  # fmt: skip

    def vjepa2():
        model = tf.VJEPA2Model(tf.VJEPA2Config(
            crop_size=32, frames_per_clip=2, tubelet_size=2, patch_size=8, hidden_size=HIDDEN, num_hidden_layers=2,
            num_attention_heads=2, mlp_ratio=2.0, pred_hidden_size=16, pred_num_hidden_layers=1,
            pred_num_attention_heads=2, pred_num_mask_tokens=2,
        ))  # fmt: skip
        return _module(lambda m, v: m(pixel_values_videos=v, skip_predictor=True).last_hidden_state, 1)(model)

    def video(batch: int) -> tuple:
        return (torch.randn(batch, 2, 3, 32, 32),)

    yield "vjepa2", vjepa2, video, ("pixel_values_videos",), ((0, "batch"),)

    def florence2_vision():
        model = tf.Florence2VisionBackbone(tf.Florence2VisionConfig(
            embed_dim=[16, 32], num_heads=[1, 2], num_groups=[1, 2], depths=[1, 1], window_size=4,
            patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1], patch_prenorm=[False, True],
            projection_dim=32, max_temporal_embeddings=4, max_position_embeddings=16,
        ))  # fmt: skip
        return _module(lambda m, p: m(p).last_hidden_state, 1)(model)

    yield "florence2_vision", florence2_vision, fixed_images(64), ("pixel_values",), ((0, "batch"),)

    def hgnetv2():
        model = tf.HGNetV2ForImageClassification(tf.HGNetV2Config(
            stem_channels=[3, 8, 16], stage_in_channels=[16, 32], stage_mid_channels=[8, 16],
            stage_out_channels=[32, 64], stage_num_blocks=[1, 1], stage_downsample=[False, True],
            stage_light_block=[False, True], stage_kernel_size=[3, 5], stage_numb_of_layers=[2, 2],
            hidden_sizes=[32, 64], depths=[1, 1], num_labels=5,
        ))  # fmt: skip
        return _module(lambda m, p: m(pixel_values=p).logits, 1)(model)

    yield "hgnetv2", hgnetv2, taller_images, ("pixel_values",), (((0, "batch"), (2, "height")),)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench._torch_export import build_models, probe_main
    from bench.heldout_round4 import built

    probe_main(OUT, lambda only: build_models(built(_models(), only), OUT, only))
