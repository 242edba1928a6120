"""Held-out probe, round 4 (issue 17): the task heads users fine-tune and export, not the bare backbones.

Run ``python -m bench.heldout_task_heads [--only NAME ...] [--exporters E ...] [--reuse]``.

The earlier probes export backbones (``last_hidden_state``) or causal LMs (``logits``); a team more often sends
a classifier, a question-answering or token-classification head, a multiple-choice model (ids ``[batch,
choices, sequence]``), an image classifier or segmenter, a CTC or audio-classification head, or a two-tower
model (CLIP: text and image batches apart, the text pooled at the EOS id the graph looks for). Each model of
``SPECS`` comes from a transformers config object (nothing downloaded; the first round's sizes: 2 layers,
hidden 32, 4 heads), every parameter perturbed by ``0.02 * randn`` (``heldout_vision_audio._model``), is
exported with every output of its head the three ways (TorchScript opset 17 eager and SDPA, dynamo opset 18)
with dynamic batch, sequence, samples and choices axes, checked in ONNX Runtime against torch on two shapes
other than the export's (text rows padded at the end), then sent through ``onnxforge optimize MODEL --preset
fast`` (``_heldout.probe``). Files and one ``.json`` per row go to ``bench/out/heldout/task_heads/``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402

from bench import _heldout, heldout_text, heldout_vision_audio  # noqa: E402
from tests.models.corpus import export_torch  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "task_heads"
EXPORTERS = ("ts_eager", "ts_sdpa", "dynamo")
ATOL, RTOL = 1e-4, 1e-3
BUILDER_VERSION = 1
CHOICES = 3
HOP = heldout_vision_audio.HOP


@dataclass(frozen=True)
class Spec:
    name: str
    config: str
    model: str
    kind: str  # text, choices (ids [B, C, S]), image, raw, clip (ids, mask and pixels)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    image: int = 32
    note: str = ""
    model_kwargs: dict[str, Any] = field(default_factory=dict)


_BERT = {
    "vocab_size": heldout_text.VOCAB,
    "hidden_size": heldout_text.HIDDEN,
    "num_hidden_layers": heldout_text.LAYERS,
    "num_attention_heads": heldout_text.HEADS,
    "intermediate_size": heldout_text.FFN,
    "max_position_embeddings": heldout_text.POSITIONS,
    "pad_token_id": heldout_text.PAD,
    "bos_token_id": heldout_text.BOS,
    "eos_token_id": heldout_text.EOS,
}
_DEC = {**_BERT, "num_key_value_heads": 2, "use_cache": False, "tie_word_embeddings": False}
_GPT2 = {"vocab_size": heldout_text.VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": 64}
_GPT2 = {**_GPT2, "n_positions": heldout_text.POSITIONS, "use_cache": False}
_VIT = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
_VIT = {**_VIT, "intermediate_size": 64}
_W2V = heldout_vision_audio._W2V
_T2, _T3 = ("input_ids", "attention_mask"), ("input_ids", "attention_mask", "token_type_ids")
_PIX, _RAW, _LOGITS = ("pixel_values",), ("input_values",), ("logits",)

SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec("bert_seq_cls", "BertConfig", "BertForSequenceClassification", "text", _T3, _LOGITS, _BERT),
        Spec("bert_qa", "BertConfig", "BertForQuestionAnswering", "text", _T3, ("start_logits", "end_logits"), _BERT),
        Spec("bert_token_cls", "BertConfig", "BertForTokenClassification", "text", _T3, _LOGITS, _BERT),
        Spec(
            "bert_multiple_choice",
            "BertConfig",
            "BertForMultipleChoice",
            "choices",
            _T3,
            _LOGITS,
            _BERT,
            note="ids [batch, choices, sequence], flattened inside",
        ),
        Spec("roberta_mlm", "RobertaConfig", "RobertaForMaskedLM", "text", _T2, _LOGITS, _BERT, note="tied decoder"),
        Spec(
            "distilbert_qa",
            "DistilBertConfig",
            "DistilBertForQuestionAnswering",
            "text",
            _T2,
            ("start_logits", "end_logits"),
            {
                "vocab_size": heldout_text.VOCAB,
                "dim": 32,
                "n_layers": 2,
                "n_heads": 4,
                "hidden_dim": 64,
                "max_position_embeddings": heldout_text.POSITIONS,
                "pad_token_id": heldout_text.PAD,
            },
        ),
        Spec(
            "electra_discriminator",
            "ElectraConfig",
            "ElectraForPreTraining",
            "text",
            _T3,
            _LOGITS,
            {**_BERT, "embedding_size": 32},
        ),
        Spec(
            "llama_seq_cls",
            "LlamaConfig",
            "LlamaForSequenceClassification",
            "text",
            _T2,
            _LOGITS,
            _DEC,
            note="pools the last non-pad token (ids compared with pad_token_id)",
        ),
        Spec(
            "gpt2_seq_cls",
            "GPT2Config",
            "GPT2ForSequenceClassification",
            "text",
            _T2,
            _LOGITS,
            {**_GPT2, "pad_token_id": heldout_text.PAD},
            note="pools the last non-pad token",
        ),
        # exported with the ids alone, as a quick export does: the mask is built inside (all ones)
        Spec("bert_ids_only", "BertConfig", "BertForSequenceClassification", "text", ("input_ids",), _LOGITS, _BERT),
        Spec("llama_ids_only", "LlamaConfig", "LlamaForCausalLM", "text", ("input_ids",), _LOGITS, _DEC),
        Spec(
            "gpt2_ids_only",
            "GPT2Config",
            "GPT2LMHeadModel",
            "text",
            ("input_ids",),
            _LOGITS,
            _GPT2,
        ),
        Spec(
            "t5_encoder_ids_only",
            "T5Config",
            "T5EncoderModel",
            "text",
            ("input_ids",),
            ("last_hidden_state",),
            {
                "vocab_size": heldout_text.VOCAB,
                "d_model": 32,
                "d_kv": 8,
                "d_ff": 64,
                "num_layers": 2,
                "num_heads": 4,
                "pad_token_id": heldout_text.PAD,
                "eos_token_id": heldout_text.EOS,
            },
            note="relative position bias",
        ),
        Spec("vit_image_cls", "ViTConfig", "ViTForImageClassification", "image", _PIX, _LOGITS, _VIT),
        Spec(
            "swin_image_cls",
            "SwinConfig",
            "SwinForImageClassification",
            "image",
            _PIX,
            _LOGITS,
            {
                "image_size": 32,
                "patch_size": 2,
                "embed_dim": 16,
                "depths": [1, 1],
                "num_heads": [2, 4],
                "window_size": 4,
            },
            note="mean-pooled windows",
        ),
        Spec(
            "convnext_image_cls",
            "ConvNextConfig",
            "ConvNextForImageClassification",
            "image",
            _PIX,
            _LOGITS,
            {"hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2},
        ),
        Spec(
            "segformer_semantic",
            "SegformerConfig",
            "SegformerForSemanticSegmentation",
            "image",
            _PIX,
            _LOGITS,
            {
                "num_encoder_blocks": 2,
                "depths": [1, 1],
                "sr_ratios": [2, 1],
                "hidden_sizes": [16, 32],
                "patch_sizes": [7, 3],
                "strides": [4, 2],
                "num_attention_heads": [1, 2],
                "mlp_ratios": [2, 2],
                "decoder_hidden_size": 32,
            },
            image=64,
            note="all-MLP decode head, bilinear upsampling",
        ),
        Spec(
            "dpt_depth",
            "DPTConfig",
            "DPTForDepthEstimation",
            "image",
            _PIX,
            ("predicted_depth",),
            {
                **_VIT,
                "num_hidden_layers": 4,
                "backbone_out_indices": [0, 1, 2, 3],
                "neck_hidden_sizes": [8, 16, 32, 32],
                "fusion_hidden_size": 16,
                "head_hidden_size": 8,
            },
            note="reassemble + fusion necks, bicubic/bilinear upsampling",
        ),
        Spec("wav2vec2_ctc", "Wav2Vec2Config", "Wav2Vec2ForCTC", "raw", _RAW, _LOGITS, {**_W2V, "vocab_size": 40}),
        Spec(
            "wav2vec2_audio_cls",
            "Wav2Vec2Config",
            "Wav2Vec2ForSequenceClassification",
            "raw",
            _RAW,
            _LOGITS,
            {**_W2V, "classifier_proj_size": 16},
            note="mean over frames",
        ),
        Spec(
            "wav2vec2_xvector",
            "Wav2Vec2Config",
            "Wav2Vec2ForXVector",
            "raw",
            _RAW,
            ("logits", "embeddings"),
            {
                **_W2V,
                "tdnn_dim": [16, 16, 32],
                "tdnn_kernel": [5, 3, 1],
                "tdnn_dilation": [1, 2, 1],
                "xvector_output_dim": 16,
            },
            note="TDNN (dilated Conv1d), statistics pooling",
        ),
        Spec(
            "clip_full",
            "CLIPConfig",
            "CLIPModel",
            "clip",
            ("input_ids", "attention_mask", "pixel_values"),
            ("logits_per_image", "text_embeds", "image_embeds"),
            {
                "text_config": {**_BERT, "max_position_embeddings": 64},
                "vision_config": _VIT,
                "projection_dim": 16,
            },
            note="two towers, text pooled at the EOS id; text and image batches apart",
        ),
    )
}


# ----------------------------------------------------------------------------------------------- build


def feeds(spec: Spec, batch: int, length: int, *, seed: int = 0, pad: bool = False) -> dict[str, np.ndarray]:
    """``length``: tokens (text), frames of ``HOP`` samples (raw audio); CLIP's image batch is one more than its
    text batch, as a user scores some captions against other images."""
    rng = np.random.default_rng(seed)
    text = tuple(k for k in spec.inputs if k != "pixel_values")
    if spec.kind in ("text", "clip"):
        out = heldout_text.feeds(heldout_text.Spec("x", "", "", text), batch, length, seed=seed, pad=pad)
        if spec.kind == "clip":
            out["pixel_values"] = rng.standard_normal((batch + 1, 3, spec.image, spec.image), dtype=np.float32)
        return out
    if spec.kind == "choices":
        flat = heldout_text.feeds(heldout_text.Spec("x", "", "", text), batch * CHOICES, length, seed=seed, pad=pad)
        return {k: v.reshape(batch, CHOICES, length) for k, v in flat.items()}
    if spec.kind == "image":
        return {"pixel_values": rng.standard_normal((batch, 3, spec.image, spec.image), dtype=np.float32)}
    return {"input_values": rng.standard_normal((batch, length * HOP + 3), dtype=np.float32)}


def _wrapper(spec: Spec, model: Any) -> Any:
    return _heldout.positional_wrapper(model, spec.inputs, spec.outputs)


def _axes(spec: Spec, name: str) -> dict[int, str]:
    if name == "pixel_values":
        return {0: "images" if spec.kind == "clip" else "batch"}
    if spec.kind == "raw":
        return {0: "batch", 1: "samples"}
    if spec.kind == "choices":
        return {0: "batch", 1: "choices", 2: "sequence"}
    return {0: "batch", 1: "sequence"}


def _export(wrapper: Any, spec: Spec, exporter: str, example: dict[str, np.ndarray], path: Path) -> onnx.ModelProto:
    axes = {k: _axes(spec, k) for k in spec.inputs}
    return export_torch(wrapper, example, spec.inputs, spec.outputs, axes, exporter, path)


def _verify(wrapper: Any, spec: Spec, path: Path) -> float:
    """Worst abs difference over every output on two shapes other than the export's. Token-wise outputs are
    compared on valid tokens only (what a padded query gets is each implementation's own)."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    # 13 frames, not 7, for raw audio: an x-vector's TDNN (kernels 5, 3 dilated 2, 1) needs 9 frames
    shapes = ((1, 13), (3, 23)) if spec.kind == "raw" else ((1, 7), (3, 23))
    for seed, (batch, length) in enumerate(shapes, start=1):
        x = feeds(spec, batch, length, seed=seed, pad=True)
        with torch.no_grad():
            want = [t.numpy() for t in wrapper(*(torch.from_numpy(x[k]) for k in spec.inputs))]
        got = session.run(list(spec.outputs), x)
        for name, g, w in zip(spec.outputs, got, want, strict=True):
            if g.shape != w.shape:
                raise AssertionError(f"{name} at {batch}x{length}: ORT shape {g.shape} != torch {w.shape}")
            valid = np.ones(g.shape, bool)
            mask = x.get("attention_mask")
            if mask is not None and g.shape[: mask.ndim] == mask.shape and spec.kind != "clip":
                valid = np.broadcast_to(mask.astype(bool).reshape(mask.shape + (1,) * (g.ndim - mask.ndim)), g.shape)
            np.testing.assert_allclose(g[valid], w[valid], atol=ATOL, rtol=RTOL, err_msg=f"{name} {batch}x{length}")
            worst = max(worst, float(np.max(np.abs(g[valid] - w[valid]))))
    return worst


def build(name: str, exporter: str, out: Path) -> dict[str, Any]:
    spec = SPECS[name]
    path = out / f"{name}_{exporter}.onnx"
    info: dict[str, Any] = {"model": name, "exporter": exporter, "builder_version": BUILDER_VERSION}
    with _heldout.build_record(info, path) as tmp:
        attention = "eager" if exporter == "ts_eager" else "sdpa"
        try:
            model = heldout_vision_audio._model(spec, attention)
        except (ValueError, ImportError):
            if exporter == "ts_sdpa":
                raise
            attention = "eager"
            model = heldout_vision_audio._model(spec, attention)
        info["attention"] = attention
        wrapper = _wrapper(spec, model)
        proto = _export(wrapper, spec, exporter, feeds(spec, 2, 16), tmp)
        _heldout.finish_build(
            info, proto, tmp, path, builder="bench.heldout_task_heads", verify=lambda: _verify(wrapper, spec, path)
        )
    return info


def _counts(src: Path, dst: Path | None) -> dict[str, Any]:
    return _heldout.structure(src, dst)


def one(name: str, exporter: str, out: Path, reuse: bool) -> dict[str, Any]:
    return _heldout.probe(name, exporter, out, reuse, version=BUILDER_VERSION, build=build, counts=_counts)


def _notes(row: dict[str, Any]) -> list[str]:
    return _heldout.job_notes(row["job"])


def cells(row: dict[str, Any]) -> list[str]:
    return _heldout.fusion_cells(row, _notes)


HEAD = ["model", "exporter", "job", "exact (max abs)", "attention", "skip+norm", "gelu", "speedup; notes"]


def main(argv: list[str] | None = None) -> int:
    return _heldout.encoder_main(
        argv,
        prog="python -m bench.heldout_task_heads",
        doc=__doc__,
        specs=SPECS,
        exporters=EXPORTERS,
        out=OUT,
        one=one,
        cells=cells,
        head=HEAD,
        results=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
