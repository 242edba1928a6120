"""Held-out probe (issue 17, 19): exports made by Optimum, the way most teams export a transformers model.

Optimum's exporter (optimum-onnx 0.1.0) needs transformers < 4.58, which the project's dev extra does not pin
(bench/README.md, "Optimum export"), so the exports are made in a venv of their own:

    python3 -m venv /tmp/optenv && /tmp/optenv/bin/pip install torch==2.14.1 optimum-onnx "transformers<4.58" onnx
    HF_HUB_OFFLINE=1 /tmp/optenv/bin/python bench/heldout_optimum.py build   # bench/out/heldout/optimum/NAME/*.onnx
    .venv/bin/python -m bench.heldout_optimum run                           # a fast job on each file

Each model comes from a transformers config (2 layers, hidden 32, 4 heads; every parameter perturbed by
``0.02 * randn``), is saved with ``save_pretrained`` and exported by ``optimum.exporters.onnx.main_export`` with
its default options and Optimum's own validation against torch (``do_validation=True``), as ``optimum-cli export
onnx --model DIR --task TASK OUT`` does: the task's inputs and dynamic axes, seq2seq models as their encoder and
decoder files (with and without a past), decoders with ``past_key_values.N.key/value`` inputs and ``present.*``
outputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "optimum"

_T = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
_V = {**_T, "vocab_size": 100}
_DEC = {**_V, "num_key_value_heads": 2, "max_position_embeddings": 256}
_IMG = {**_T, "image_size": 32, "patch_size": 8}
# the sizes of the encoder-decoders (Whisper, BART, DETR), in their configs' own names
_ENC_DEC = {
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
}
# name -> (config class, model class, task, config kwargs)
SPECS: dict[str, tuple[str, str, str, dict]] = {
    "bert": ("BertConfig", "BertModel", "feature-extraction", _V),
    "roberta_seq_cls": ("RobertaConfig", "RobertaForSequenceClassification", "text-classification", _V),
    "distilbert_qa": (
        "DistilBertConfig",
        "DistilBertForQuestionAnswering",
        "question-answering",
        {"vocab_size": 100, "dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64},
    ),
    "deberta_v2": ("DebertaV2Config", "DebertaV2Model", "feature-extraction", _V),
    "electra_token_cls": (
        "ElectraConfig",
        "ElectraForTokenClassification",
        "token-classification",
        {**_V, "embedding_size": 32},
    ),
    "xlm_roberta_mlm": ("XLMRobertaConfig", "XLMRobertaForMaskedLM", "fill-mask", _V),
    "vit_image_cls": ("ViTConfig", "ViTForImageClassification", "image-classification", _IMG),
    "convnext": (
        "ConvNextConfig",
        "ConvNextModel",
        "feature-extraction",
        {"num_stages": 2, "hidden_sizes": [16, 32], "depths": [1, 1], "image_size": 32},
    ),
    "whisper": (
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        "automatic-speech-recognition-with-past",
        {
            "vocab_size": 100,
            **_ENC_DEC,
            "num_mel_bins": 16,
            "max_source_positions": 1500,
            "max_target_positions": 64,
            "decoder_start_token_id": 1,
            "pad_token_id": 0,
            "eos_token_id": 2,
            "bos_token_id": 1,
        },
    ),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        "text2text-generation-with-past",
        {
            "vocab_size": 100,
            "d_model": 32,
            "d_kv": 8,
            "d_ff": 64,
            "num_layers": 2,
            "num_heads": 4,
            "decoder_start_token_id": 0,
        },
    ),
    "bart": (
        "BartConfig",
        "BartForConditionalGeneration",
        "text2text-generation-with-past",
        {
            "vocab_size": 100,
            **_ENC_DEC,
            "max_position_embeddings": 128,
        },
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "text-generation-with-past", _DEC),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "text-generation-with-past", _DEC),
    "mistral": ("MistralConfig", "MistralForCausalLM", "text-generation-with-past", _DEC),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "text-generation-with-past", {**_DEC, "pad_token_id": 0}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "text-generation-with-past", {**_DEC, "head_dim": 8}),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        "text-generation-with-past",
        {"vocab_size": 100, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256},
    ),
    "llama_nopast": ("LlamaConfig", "LlamaForCausalLM", "text-generation", _DEC),
    "wav2vec2_ctc": (
        "Wav2Vec2Config",
        "Wav2Vec2ForCTC",
        "automatic-speech-recognition",
        {
            **_V,
            "conv_dim": (16,) * 7,
            "num_conv_pos_embeddings": 16,
            "num_conv_pos_embedding_groups": 4,
            "mask_time_prob": 0.0,
        },
    ),
    "clip": (
        "CLIPConfig",
        "CLIPModel",
        "zero-shot-image-classification",
        {
            # ids within the tiny vocabulary: the text tower pools at the first eos_token_id
            "text_config": {**_V, "max_position_embeddings": 64, "eos_token_id": 99, "bos_token_id": 98},
            "vision_config": _IMG,
            "projection_dim": 16,
        },
    ),
    "swin_image_cls": (
        "SwinConfig",
        "SwinForImageClassification",
        "image-classification",
        {"image_size": 32, "patch_size": 2, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 4], "window_size": 4},
    ),
    "segformer": (
        "SegformerConfig",
        "SegformerForSemanticSegmentation",
        "semantic-segmentation",
        {
            "num_encoder_blocks": 2,
            "depths": [1, 1],
            "sr_ratios": [2, 1],
            "hidden_sizes": [16, 32],
            "num_attention_heads": [1, 2],
            "decoder_hidden_size": 32,
        },
    ),
    "detr": (
        "DetrConfig",
        "DetrForObjectDetection",
        "object-detection",
        {
            "use_timm_backbone": False,
            "use_pretrained_backbone": False,
            "backbone": None,
            "backbone_config": {
                "model_type": "resnet",
                "embedding_size": 16,
                "hidden_sizes": [16, 32, 64, 128],
                "depths": [1, 1, 1, 1],
                "out_features": ["stage4"],
            },
            **_ENC_DEC,
            "num_queries": 10,
        },
    ),
    "llama_seq_cls": (
        "LlamaConfig",
        "LlamaForSequenceClassification",
        "text-classification",
        {**_DEC, "pad_token_id": 0},
    ),
}


def build(only: list[str]) -> None:
    import shutil
    import tempfile

    import torch
    import transformers
    from optimum.exporters.onnx import main_export

    for name in only or SPECS:
        config_class, model_class, task, kwargs = SPECS[name]
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        out = OUT / name
        shutil.rmtree(out, ignore_errors=True)
        with tempfile.TemporaryDirectory() as source:
            model.save_pretrained(source)
            try:
                main_export(source, output=out, task=task, do_validation=True)
                files = sorted(p.name for p in out.glob("*.onnx"))
                print(name, "exported:", ", ".join(files), flush=True)
            except Exception as exc:  # a row of the table, not the end of the probe
                print(name, "build failed:", type(exc).__name__, str(exc).splitlines()[0][:300], flush=True)


def run(only: list[str]) -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench import _heldout

    paths = [p for name in (only or SPECS) for p in sorted((OUT / name).glob("*.onnx"))]
    _heldout.run_exports(paths, _heldout.ATTENTION_COLUMN, label=lambda p: f"{p.parent.name}/{p.stem}")


if __name__ == "__main__":
    step = sys.argv[1] if len(sys.argv) > 1 else "run"
    {"build": build, "run": run}[step](sys.argv[2:])
