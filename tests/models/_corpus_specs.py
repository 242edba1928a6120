"""The corpus's architectures, sizes and transformers configs (tests/models/corpus.py builds and exports them).

Kept apart from the builder so that each file reads on its own: what the corpus holds here, how it is exported
and checked there. torch and transformers are imported only inside the functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Arch:
    name: str
    modality: str  # text | seq2seq | vision | audio_raw | audio_mel
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    ort_model_type: str | None  # onnxruntime.transformers.optimizer model_type, None where it has none
    attention: bool = True  # False: no attention (the sdpa export is the eager one)


_TEXT = ("input_ids", "attention_mask")
_TEXT3 = ("input_ids", "attention_mask", "token_type_ids")
_S2S = ("input_ids", "attention_mask", "decoder_input_ids")
_HID = ("last_hidden_state",)
ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("bert", "text", _TEXT3, _HID, "bert"),
        Arch("roberta", "text", _TEXT, _HID, "bert"),
        Arch("distilbert", "text", _TEXT, _HID, "bert"),
        Arch("albert", "text", _TEXT3, _HID, "bert"),
        Arch("deberta", "text", _TEXT, _HID, "bert"),
        Arch("deberta_v2", "text", _TEXT, _HID, "bert"),
        Arch("deberta_v3", "text", _TEXT, _HID, "bert"),
        Arch("electra", "text", _TEXT3, _HID, "bert"),
        Arch("mpnet", "text", _TEXT, _HID, "bert"),
        Arch("xlm_roberta", "text", _TEXT, _HID, "bert"),
        Arch("vit", "vision", ("pixel_values",), _HID, "vit"),
        Arch("deit", "vision", ("pixel_values",), _HID, "vit"),
        Arch("swin", "vision", ("pixel_values",), _HID, "swin"),
        Arch("convnext", "vision", ("pixel_values",), _HID, None, attention=False),
        Arch("resnet", "vision", ("pixel_values",), _HID, None, attention=False),
        Arch("mobilenet_v2", "vision", ("pixel_values",), _HID, None, attention=False),
        Arch("whisper_encoder", "audio_mel", ("input_features",), _HID, "bart"),
        Arch("wav2vec2", "audio_raw", ("input_values",), _HID, None),
        Arch("clip_text", "text", _TEXT, ("last_hidden_state", "pooler_output"), "clip"),
        Arch("clip_vision", "vision", ("pixel_values",), ("last_hidden_state", "pooler_output"), "clip"),
        Arch("t5", "seq2seq", _S2S, ("logits",), "t5"),
        Arch("bart", "seq2seq", _S2S, ("logits",), "bart"),
        Arch("gpt2", "text", _TEXT, ("logits",), "gpt2"),
        Arch("llama", "text", _TEXT, ("logits",), "gpt2"),
        Arch("qwen2", "text", _TEXT, ("logits",), "gpt2"),
        Arch("phi3", "text", _TEXT, ("logits",), "phi"),
        Arch("mistral", "text", _TEXT, ("logits",), "gpt2"),
    )
}


@dataclass(frozen=True)
class Dims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    positions: int
    image: int
    patch: int
    mel_bins: int
    frames: int  # Whisper's fixed input length (2 x max_source_positions)


DIMS = {
    # positions cover the coverage benchmark's sequence 256 (RoBERTa-style tables need 2 more); the
    # vocabulary stays larger than the position table, as in every real checkpoint (ORT's embedding fusion
    # tells the two tables apart by size)
    "tiny": Dims(2, 32, 4, 2, 64, 384, 264, 32, 8, 16, 64),
    "bench": Dims(4, 256, 4, 2, 1024, 32000, 520, 224, 16, 80, 3000),
}
SPECIAL = {"pad": 1, "bos": 0, "eos": 2}  # ids below LOW are never drawn at random
LOW = 5


# ----------------------------------------------------------------------------------------------- torch


class BuildRefused(Exception):
    """An export that cannot be made as specified; its message is the finding."""


def _config(arch: str, size: str, attention: str | None) -> Any:
    import transformers as tf

    d = DIMS[size]
    attn = {} if attention is None else {"attn_implementation": attention}
    text = {"vocab_size": d.vocab, "pad_token_id": SPECIAL["pad"], **attn}
    bert_like = {
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "intermediate_size": d.ffn,
        "max_position_embeddings": d.positions,
        **text,
    }
    vit_like = {
        "image_size": d.image,
        "patch_size": d.patch,
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "intermediate_size": d.ffn,
        **attn,
    }
    decoder = {
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "intermediate_size": d.ffn,
        "max_position_embeddings": d.positions,
        "bos_token_id": SPECIAL["bos"],
        "eos_token_id": SPECIAL["eos"],
        "use_cache": False,
        "tie_word_embeddings": False,
        **text,
    }
    stages = [d.hidden, 2 * d.hidden] if size == "tiny" else [64, 128, 256, 512]
    depths = [1, 1] if size == "tiny" else [1, 1, 2, 1]
    builders: dict[str, Any] = {
        "bert": lambda: tf.BertConfig(**bert_like),
        "roberta": lambda: tf.RobertaConfig(**bert_like, bos_token_id=0, eos_token_id=2),
        "xlm_roberta": lambda: tf.XLMRobertaConfig(**bert_like, bos_token_id=0, eos_token_id=2),
        "electra": lambda: tf.ElectraConfig(**bert_like, embedding_size=d.hidden // 2),
        "albert": lambda: tf.AlbertConfig(**bert_like, embedding_size=d.hidden // 2),
        # microsoft/deberta-base's (v1) attention: one packed in_proj per head, q and v biases after the split, c2p
        # and p2c terms over relative positions, the query scaled once for the scores and c2p, no token types
        "deberta": lambda: tf.DebertaConfig(
            **bert_like,
            relative_attention=True,
            pos_att_type=["c2p", "p2c"],
            max_relative_positions=-1,
            position_biased_input=False,
            type_vocab_size=0,
        ),
        "deberta_v2": lambda: tf.DebertaV2Config(**bert_like, relative_attention=True, position_buckets=64),
        # microsoft/deberta-v3-*'s attention: disentangled c2p and p2c terms on shared q/k projections of
        # layer-normed relative embeddings, log-bucketed positions (tiny: 16 buckets, so that the test lengths
        # reach the log buckets), no absolute positions
        "deberta_v3": lambda: tf.DebertaV2Config(
            **bert_like,
            relative_attention=True,
            pos_att_type=["p2c", "c2p"],
            position_buckets=16 if size == "tiny" else 256,
            max_relative_positions=-1,
            share_att_key=True,
            norm_rel_ebd="layer_norm",
            position_biased_input=False,
            type_vocab_size=0,
        ),
        "mpnet": lambda: tf.MPNetConfig(**bert_like),
        "distilbert": lambda: tf.DistilBertConfig(
            vocab_size=d.vocab,
            dim=d.hidden,
            n_layers=d.layers,
            n_heads=d.heads,
            hidden_dim=d.ffn,
            max_position_embeddings=d.positions,
            pad_token_id=SPECIAL["pad"],
            **attn,
        ),
        "vit": lambda: tf.ViTConfig(**vit_like),
        "deit": lambda: tf.DeiTConfig(**vit_like),
        "clip_vision": lambda: tf.CLIPVisionConfig(**vit_like),
        "clip_text": lambda: tf.CLIPTextConfig(
            vocab_size=d.vocab,
            hidden_size=d.hidden,
            num_hidden_layers=d.layers,
            num_attention_heads=d.heads,
            intermediate_size=d.ffn,
            max_position_embeddings=d.positions,
            pad_token_id=SPECIAL["pad"],
            bos_token_id=SPECIAL["bos"],
            eos_token_id=SPECIAL["eos"],
            **attn,
        ),
        "swin": lambda: tf.SwinConfig(
            image_size=d.image,
            patch_size=2 if size == "tiny" else 4,
            embed_dim=d.hidden // 2 if size == "tiny" else 64,
            depths=[1, 1] if size == "tiny" else [2, 2, 2],
            num_heads=[2, 4] if size == "tiny" else [2, 4, 8],
            window_size=4 if size == "tiny" else 7,
            **attn,
        ),
        "convnext": lambda: tf.ConvNextConfig(
            image_size=d.image, num_stages=len(stages), hidden_sizes=stages, depths=depths
        ),
        "resnet": lambda: tf.ResNetConfig(
            embedding_size=stages[0], hidden_sizes=stages, depths=depths, layer_type="basic"
        ),
        "mobilenet_v2": lambda: tf.MobileNetV2Config(
            image_size=d.image, depth_multiplier=0.25 if size == "tiny" else 1.0, finegrained_output=False
        ),
        "whisper_encoder": lambda: tf.WhisperConfig(
            vocab_size=d.vocab,
            num_mel_bins=d.mel_bins,
            d_model=d.hidden,
            encoder_layers=d.layers,
            decoder_layers=1,
            encoder_attention_heads=d.heads,
            decoder_attention_heads=d.heads,
            encoder_ffn_dim=d.ffn,
            decoder_ffn_dim=d.ffn,
            max_source_positions=d.frames // 2,
            max_target_positions=64,
            pad_token_id=SPECIAL["pad"],
            bos_token_id=SPECIAL["bos"],
            eos_token_id=SPECIAL["eos"],
            decoder_start_token_id=SPECIAL["bos"],
            **attn,
        ),
        "wav2vec2": lambda: tf.Wav2Vec2Config(
            hidden_size=d.hidden,
            num_hidden_layers=d.layers,
            num_attention_heads=d.heads,
            intermediate_size=d.ffn,
            conv_dim=(16 if size == "tiny" else 256,) * 7,
            num_conv_pos_embeddings=16 if size == "tiny" else 64,
            num_conv_pos_embedding_groups=4 if size == "tiny" else 16,
            mask_time_prob=0.0,
            **attn,
        ),
        "t5": lambda: tf.T5Config(
            vocab_size=d.vocab,
            d_model=d.hidden,
            d_kv=d.hidden // d.heads,
            d_ff=d.ffn,
            num_layers=d.layers,
            num_heads=d.heads,
            pad_token_id=SPECIAL["pad"],
            eos_token_id=SPECIAL["eos"],
            decoder_start_token_id=SPECIAL["bos"],
            use_cache=False,
            **attn,
        ),
        "bart": lambda: tf.BartConfig(
            vocab_size=d.vocab,
            d_model=d.hidden,
            encoder_layers=d.layers,
            decoder_layers=d.layers,
            encoder_attention_heads=d.heads,
            decoder_attention_heads=d.heads,
            encoder_ffn_dim=d.ffn,
            decoder_ffn_dim=d.ffn,
            max_position_embeddings=d.positions,
            pad_token_id=SPECIAL["pad"],
            bos_token_id=SPECIAL["bos"],
            eos_token_id=SPECIAL["eos"],
            decoder_start_token_id=SPECIAL["eos"],
            use_cache=False,
            **attn,
        ),
        "gpt2": lambda: tf.GPT2Config(
            vocab_size=d.vocab,
            n_embd=d.hidden,
            n_layer=d.layers,
            n_head=d.heads,
            n_inner=d.ffn,
            n_positions=d.positions,
            bos_token_id=SPECIAL["bos"],
            eos_token_id=SPECIAL["eos"],
            pad_token_id=SPECIAL["pad"],
            use_cache=False,
            **attn,
        ),
        "llama": lambda: tf.LlamaConfig(**decoder),
        "qwen2": lambda: tf.Qwen2Config(**decoder),
        "mistral": lambda: tf.MistralConfig(**decoder, sliding_window=None),
        "phi3": lambda: tf.Phi3Config(**decoder),
    }
    return builders[arch]()


def _model(arch: str, size: str, attention: str | None) -> Any:
    import torch
    import transformers as tf

    config = _config(arch, size, attention)
    classes = {
        "bert": tf.BertModel,
        "roberta": tf.RobertaModel,
        "xlm_roberta": tf.XLMRobertaModel,
        "electra": tf.ElectraModel,
        "albert": tf.AlbertModel,
        "deberta": tf.DebertaModel,
        "deberta_v2": tf.DebertaV2Model,
        "deberta_v3": tf.DebertaV2Model,
        "mpnet": tf.MPNetModel,
        "distilbert": tf.DistilBertModel,
        "vit": tf.ViTModel,
        "deit": tf.DeiTModel,
        "clip_vision": tf.CLIPVisionModel,
        "clip_text": tf.CLIPTextModel,
        "swin": tf.SwinModel,
        "convnext": tf.ConvNextModel,
        "resnet": tf.ResNetModel,
        "mobilenet_v2": tf.MobileNetV2Model,
        "whisper_encoder": tf.WhisperModel,
        "wav2vec2": tf.Wav2Vec2Model,
        "t5": tf.T5ForConditionalGeneration,
        "bart": tf.BartForConditionalGeneration,
        "gpt2": tf.GPT2LMHeadModel,
        "llama": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "phi3": tf.Phi3ForCausalLM,
    }
    torch.manual_seed(0)
    kwargs = {"add_pooling_layer": False} if arch in ("bert", "roberta", "xlm_roberta", "vit", "deit") else {}
    try:
        model = classes[arch](config, **kwargs)
    except (ValueError, ImportError) as exc:  # e.g. "does not support an attention implementation through sdpa"
        first = str(exc).split(". ")[0]  # transformers' message goes on with a how-to for the hub
        raise BuildRefused(f"transformers refuses attn_implementation={attention!r}: {first}") from exc
    if arch == "whisper_encoder":
        model = model.get_encoder()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):  # eval-mode statistics of a trained net, not (0, 1)
                module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=gen) * 0.1)
                module.running_var.copy_(torch.rand(module.running_var.shape, generator=gen) + 0.5)
    return model.eval()
