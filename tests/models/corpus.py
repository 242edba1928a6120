"""The coverage corpus (issue 17 item 3): 25 models of 24 transformers architectures, each exported three ways.

Run ``python -m tests.models.corpus`` to rebuild the tiny subset committed under ``tests/models/corpus/``
(``COMMITTED``; ``tests/test_coverage.py`` reads it, never torch), or ``python -m tests.models.corpus
--size tiny|bench [--only ARCH ...] [--exporters E ...] [--out DIR] [--reuse]`` for the rest, which
goes to ``bench/out/corpus/<size>/`` (never committed) with a ``.json`` sidecar per file: ``bench/coverage.py``
builds on demand and reuses a build whose sidecar matches the current spec (builder version, dimensions,
torch/transformers/onnx versions). A build that fails also writes its sidecar, with ``ok: false`` and the
error: an export that cannot be made is a finding the coverage table keeps.

Exporters (what a user gets from ``torch.onnx.export`` today):

=========  ========================================================================================
ts_eager   TorchScript exporter (``dynamo=False``), opset 17, ``attn_implementation="eager"``
ts_sdpa    the same with ``attn_implementation="sdpa"`` (refused by transformers for some models:
           recorded); models without attention (ResNet, ConvNeXt, MobileNet) have no SDPA variant
dynamo     ``dynamo=True``, opset 18, transformers' default attention (SDPA where the model has it)
=========  ========================================================================================

Each model comes from a ``transformers`` config object (nothing is downloaded) with ``torch.manual_seed(0)``,
every parameter perturbed by ``0.02 * randn`` from a seeded generator and BatchNorm statistics drawn away from
(0, 1), as in ``build_torchscript``/``build_hf``: the exporters fold equal initializers and drop zero biases,
a graph no trained checkpoint gives. Inputs have a dynamic batch axis, and text/audio a dynamic sequence axis
(``decoder_sequence`` for decoder inputs); images and Whisper's log-mel frames have the fixed size the model
requires. Every export is checked with ``onnx.checker`` and against torch in ONNX Runtime on two shapes other
than the export example (padded rows included); a mismatch fails the build and deletes the file.

``feeds(arch, size, batch, seq)`` makes the inputs the coverage benchmark times: ``seq`` tokens for text (the
decoder of T5/BART gets ``seq`` too), ``seq * 320`` raw samples for wav2vec2 (320 samples per frame), and the
model's fixed image or frame count for vision and Whisper. It needs only numpy.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
COMMITTED_DIR = HERE / "corpus"
BENCH_OUT = REPO / "bench" / "out" / "corpus"
BUILDER_VERSION = 1  # bump when a change here changes the exported graphs (invalidates cached builds)
EXPORTERS = ("ts_eager", "ts_sdpa", "dynamo")
SIZES = ("tiny", "bench")
ATOL = 1e-4
RTOL = 1e-3
AUDIO_HOP = 320  # wav2vec2's feature encoder emits one frame per 320 samples

# The committed tiny subset: one architecture per family the fusions target (a post-norm encoder with token
# types, ViT, CLIP's text tower with its causal mask and EOS pooling, a pre-norm GPT decoder, a GQA/RMSNorm
# decoder, an encoder-decoder), each under the three exporters; six, so that tests/test_coverage.py runs its
# 18 jobs in about three minutes on two cores.
COMMITTED = ("bert", "vit", "clip_text", "gpt2", "llama", "bart")


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
        Arch("deberta_v2", "text", _TEXT, _HID, "bert"),
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


def filename(arch: str, exporter: str) -> str:
    return f"{arch}_{exporter}.onnx"


def default_out(size: str) -> Path:
    return BENCH_OUT / size


def committed_path(arch: str, exporter: str) -> Path:
    return COMMITTED_DIR / filename(arch, exporter)


def spec_key(arch: str, exporter: str, size: str) -> dict[str, Any]:
    """What a built file depends on; a cached build is reused while its sidecar holds the same key."""
    versions = {}
    for dist in ("torch", "transformers", "onnx", "onnxscript", "onnxruntime"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return {
        "arch": arch,
        "exporter": exporter,
        "size": size,
        "builder_version": BUILDER_VERSION,
        "dims": DIMS[size].__dict__,
        "versions": versions,
    }


# ----------------------------------------------------------------------------------------------- inputs


def feeds(arch: str, size: str, batch: int, seq: int, *, seed: int = 0, pad: bool = False) -> dict[str, np.ndarray]:
    """Inputs of ``arch`` at (batch, seq); ``pad``: the last row's second half is padding (masks to 0, ids
    to the pad id) so checks cover masked positions."""
    spec, d = ARCHS[arch], DIMS[size]
    rng = np.random.default_rng(seed)
    if spec.modality == "vision":
        return {"pixel_values": rng.standard_normal((batch, 3, d.image, d.image), dtype=np.float32)}
    if spec.modality == "audio_mel":
        return {"input_features": rng.standard_normal((batch, d.mel_bins, d.frames), dtype=np.float32)}
    if spec.modality == "audio_raw":
        return {"input_values": rng.standard_normal((batch, seq * AUDIO_HOP), dtype=np.float32)}
    ids = rng.integers(LOW, d.vocab, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    if pad and seq > 2:
        mask[-1, seq // 2 :] = 0
    for row in range(batch):
        n = int(mask[row].sum())
        ids[row, 0] = SPECIAL["bos"]
        ids[row, n - 1] = SPECIAL["eos"]
        ids[row, n:] = SPECIAL["pad"]
    out = {"input_ids": ids, "attention_mask": mask}
    if "token_type_ids" in spec.inputs:
        types = np.zeros((batch, seq), np.int64)
        types[:, seq // 2 :] = 1  # a sentence pair
        out["token_type_ids"] = types
    if "decoder_input_ids" in spec.inputs:
        dec = rng.integers(LOW, d.vocab, size=(batch, seq), dtype=np.int64)
        dec[:, 0] = SPECIAL["bos"]
        out["decoder_input_ids"] = dec
    return {k: out[k] for k in spec.inputs}


def _check_shapes(spec: Arch) -> list[tuple[int, int]]:
    """(batch, seq) shapes for the torch comparison; the export example is (2, 16), (2, 8) for audio."""
    return [(1, 7), (3, 23)]


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
        "deberta_v2": lambda: tf.DebertaV2Config(**bert_like, relative_attention=True, position_buckets=64),
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
        "deberta_v2": tf.DebertaV2Model,
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


def _wrapper(arch: str, model: Any) -> Any:
    """The model behind a forward whose signature spells out the graph inputs (torch.export reads it),
    returning a plain tuple of the graph outputs."""
    import torch

    spec = ARCHS[arch]

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def run(self, **kw: Any) -> tuple[Any, ...]:
            if spec.modality in ("seq2seq",) or arch in ("gpt2", "llama", "qwen2", "mistral", "phi3"):
                kw["use_cache"] = False
            out = self.model(**kw, return_dict=True)
            return tuple(getattr(out, name) for name in spec.outputs)

    class Text(Wrapper):
        def forward(self, input_ids: Any, attention_mask: Any) -> tuple[Any, ...]:
            return self.run(input_ids=input_ids, attention_mask=attention_mask)

    class Text3(Wrapper):
        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> tuple[Any, ...]:
            return self.run(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)

    class Seq2Seq(Wrapper):
        def forward(self, input_ids: Any, attention_mask: Any, decoder_input_ids: Any) -> tuple[Any, ...]:
            return self.run(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)

    class Pixels(Wrapper):
        def forward(self, pixel_values: Any) -> tuple[Any, ...]:
            return self.run(pixel_values=pixel_values)

    class Mel(Wrapper):
        def forward(self, input_features: Any) -> tuple[Any, ...]:
            return self.run(input_features=input_features)

    class Raw(Wrapper):
        def forward(self, input_values: Any) -> tuple[Any, ...]:
            return self.run(input_values=input_values)

    by_inputs = {_TEXT: Text, _TEXT3: Text3, _S2S: Seq2Seq, ("pixel_values",): Pixels}
    by_inputs |= {("input_features",): Mel, ("input_values",): Raw}
    return by_inputs[spec.inputs]().eval()


def _axes(arch: str) -> dict[str, dict[int, str]]:
    spec = ARCHS[arch]
    axes: dict[str, dict[int, str]] = {}
    for name in spec.inputs:
        if spec.modality in ("vision", "audio_mel"):
            axes[name] = {0: "batch"}
        elif name == "decoder_input_ids":
            axes[name] = {0: "batch", 1: "decoder_sequence"}
        else:
            axes[name] = {0: "batch", 1: "sequence"}
    for name in spec.outputs:
        if spec.modality in ("text", "audio_raw") and name != "pooler_output":
            axes[name] = {0: "batch", 1: "sequence"}
        elif spec.modality == "seq2seq":
            axes[name] = {0: "batch", 1: "decoder_sequence"}
        else:
            axes[name] = {0: "batch"}
    return axes


def _export(wrapper: Any, arch: str, exporter: str, example: dict[str, np.ndarray], path: Path) -> onnx.ModelProto:
    import torch

    spec = ARCHS[arch]
    args = tuple(torch.from_numpy(example[k]) for k in spec.inputs)
    axes = _axes(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            program = torch.onnx.export(
                wrapper,
                args,
                input_names=list(spec.inputs),
                output_names=list(spec.outputs),
                dynamic_shapes=tuple(axes[k] for k in spec.inputs),
                opset_version=18,
                dynamo=True,
                optimize=True,
                verbose=False,
            )
            return program.model_proto
        torch.onnx.export(
            wrapper,
            args,
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=list(spec.inputs),
            output_names=list(spec.outputs),
            dynamic_axes=axes,
        )
    return onnx.load(str(path))


def _strip(model: onnx.ModelProto, meta: dict[str, str]) -> onnx.ModelProto:
    """Drop per-node metadata (stack traces with local paths) and doc strings; record provenance."""
    g = model.graph
    for coll in (g.node, g.input, g.output, g.value_info, g.initializer):
        for item in coll:
            if hasattr(item, "metadata_props"):
                del item.metadata_props[:]
            if hasattr(item, "doc_string"):
                item.doc_string = ""
    del model.metadata_props[:]
    for key, value in meta.items():
        model.metadata_props.add(key=key, value=value)
    return model


def _verify(wrapper: Any, arch: str, size: str, path: Path) -> float:
    """ORT against torch on shapes other than the export example; the worst abs difference."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for seed, (batch, seq) in enumerate(_check_shapes(ARCHS[arch]), start=1):
        x = feeds(arch, size, batch, seq if ARCHS[arch].modality != "audio_raw" else seq + 3, seed=seed, pad=True)
        with torch.no_grad():
            want = wrapper(*(torch.from_numpy(x[k]) for k in ARCHS[arch].inputs))
        got = session.run(list(ARCHS[arch].outputs), x)
        for name, w, o in zip(ARCHS[arch].outputs, want, got, strict=True):
            ref = w.numpy()
            if ref.shape != o.shape:
                raise AssertionError(f"{path.name}.{name} at {batch}x{seq}: ORT shape {o.shape} != torch {ref.shape}")
            np.testing.assert_allclose(o, ref, atol=ATOL, rtol=RTOL, err_msg=f"{path.name}.{name} at {batch}x{seq}")
            worst = max(worst, float(np.max(np.abs(o - ref))))
    return worst


def _cause(exc: BaseException) -> str:
    """The message that names what went wrong: the torch exporter wraps it in steps to report a bug, with
    the original exception under "## Exception summary" and ANSI colours."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    if "## Exception summary" in text:
        text = text.split("## Exception summary", 1)[1]
    return " ".join(text.split())[:600]


def build(arch: str, exporter: str, size: str = "tiny", out_dir: Path | None = None) -> dict[str, Any]:
    """Export, check and save one model; write and return its sidecar (``ok`` false with the error when the
    export cannot be made: the file is then absent)."""
    out = Path(out_dir) if out_dir is not None else default_out(size)
    out.mkdir(parents=True, exist_ok=True)
    path = out / filename(arch, exporter)
    sidecar = path.with_suffix(".json")
    key = spec_key(arch, exporter, size)
    info: dict[str, Any] = {**key, "file": path.name}
    started = time.perf_counter()
    try:
        if exporter == "ts_sdpa" and not ARCHS[arch].attention:
            raise BuildRefused("no attention: the sdpa export is the eager one")
        attention = {"ts_eager": "eager", "ts_sdpa": "sdpa", "dynamo": None}[exporter]
        model = _model(arch, size, attention)
        info["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        wrapper = _wrapper(arch, model)
        example_seq = 16 if ARCHS[arch].modality != "audio_raw" else 8
        example = feeds(arch, size, 2, example_seq, seed=0)
        tmp = path.with_suffix(".onnx.tmp")
        proto = _export(wrapper, arch, exporter, example, tmp)
        meta = {
            "onnxforge.builder": f"tests.models.corpus --size {size} --only {arch} --exporters {exporter}",
            "onnxforge.versions": json.dumps(key["versions"], sort_keys=True),
        }
        proto = _strip(proto, meta)
        onnx.checker.check_model(proto, full_check=True)
        onnx.save(proto, tmp)
        tmp.replace(path)
        try:
            info["max_abs_vs_torch"] = _verify(wrapper, arch, size, path)
        except BaseException:
            path.unlink(missing_ok=True)  # never leave an unverified model behind
            raise
        info.update(ok=True, bytes=path.stat().st_size, nodes=len(proto.graph.node))
        info["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    except Exception as exc:  # the finding: why this export cannot be made
        path.unlink(missing_ok=True)
        path.with_suffix(".onnx.tmp").unlink(missing_ok=True)
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" ({Path(last.filename).name}:{last.lineno})" if not isinstance(exc, BuildRefused) else ""
        info.update(ok=False, error=f"{type(exc).__name__}: {_cause(exc)}{where}")
    # no build time in the sidecar: a rebuild of the committed subset leaves it byte-identical
    sidecar.write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return {**info, "seconds": round(time.perf_counter() - started, 1)}


def cached(arch: str, exporter: str, size: str, out_dir: Path | None = None) -> dict[str, Any] | None:
    """The sidecar of a build of the current spec in ``out_dir``, with ``path`` set; None when absent or
    stale. A failed build counts: its sidecar says why."""
    out = Path(out_dir) if out_dir is not None else default_out(size)
    path = out / filename(arch, exporter)
    try:
        info = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None
    want = spec_key(arch, exporter, size)
    if any(info.get(k) != v for k, v in want.items()):
        return None
    if info.get("ok") and (not path.exists() or path.stat().st_size != info.get("bytes")):
        return None
    return {**info, "path": str(path) if info.get("ok") else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.models.corpus", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=SIZES, default=None, help="build every model of this size")
    parser.add_argument("--only", nargs="+", choices=sorted(ARCHS), help="architectures (default: all)")
    parser.add_argument("--exporters", nargs="+", choices=EXPORTERS, default=list(EXPORTERS))
    parser.add_argument("--out", type=Path, default=None, help="default: bench/out/corpus/<size>")
    parser.add_argument(
        "--committed",
        action="store_true",
        help="the committed tiny subset -> tests/models/corpus (what no --size, --only or --out means)",
    )
    parser.add_argument("--reuse", action="store_true", help="skip builds whose sidecar matches the current spec")
    args = parser.parse_args(argv)
    committed = args.committed or (args.size is None and args.only is None and args.out is None)
    archs = args.only or (list(COMMITTED) if committed else list(ARCHS))
    size, out = ("tiny", COMMITTED_DIR) if committed else (args.size or "tiny", args.out)
    failed = 0
    for arch in archs:
        for exporter in args.exporters:
            info = cached(arch, exporter, size, out) if args.reuse else None
            if info is None:
                info = build(arch, exporter, size, out)
            status = f"ok, {info['bytes'] / 1e3:.0f} KB, {info['nodes']} nodes" if info["ok"] else info["error"]
            print(f"{arch:16s} {exporter:9s} {info.get('seconds', 0.0):6.1f}s  {status}", flush=True)
            failed += not info["ok"]
    if committed and failed and archs == list(COMMITTED):
        return 1  # the committed subset must build in full: the tests read every file
    return 0


if __name__ == "__main__":
    sys.exit(main())
