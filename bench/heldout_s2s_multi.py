"""Held-out probe, encoder-decoders and multimodal towers (issue 17): architectures outside the corpus.

Run ``python -m bench.heldout_s2s_multi [--only NAME ...] [--exporters E ...] [--reuse]``.

Each model of ``SPECS`` (none of them in ``tests/models/_corpus_specs.py``: Marian, mBART, Pegasus, M2M100,
BlenderbotSmall, T5 v1.1 / mT5, LongT5, SigLIP's text and vision towers, the whole Whisper model, a ViT-to-BERT
VisionEncoderDecoder) comes from a transformers config object (nothing downloaded; 2 layers, hidden 32, 4
heads, a 384-token vocabulary), every parameter perturbed by ``0.02 * randn`` (the exporters fold equal
initializers and drop zero biases), and is exported the three ways of ``tests/models/corpus.py`` (TorchScript
opset 17 with eager and with SDPA attention, dynamo opset 18) with dynamic batch, sequence and decoder-sequence
axes, then checked in ONNX Runtime against torch on two shapes other than the export example, the encoder and
decoder lengths differing and the last row's encoder input half padding. A model that cannot be exported is a
row of the table with the reason.

Each export then goes through ``onnxforge optimize MODEL --preset fast`` in a child process with
``ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS=1`` (``bench.coverage.run_job``); the columns are those of
``bench.heldout_text``. Files and ``results.json`` go to ``bench/out/heldout/s2s_multi/``.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402

from bench import _heldout  # noqa: E402
from bench.heldout_text import HEAD, _cells, _structure  # noqa: E402
from tests.models.corpus import _cause  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "s2s_multi"
EXPORTERS = ("ts_eager", "ts_sdpa", "dynamo")
ATOL, RTOL = 1e-4, 1e-3
HIDDEN, HEADS, LAYERS, FFN, VOCAB, POSITIONS = 32, 4, 2, 64, 384, 264
PAD, BOS, EOS, LOW = 1, 0, 2, 5
IMAGE, PATCH, MELS, FRAMES = 32, 8, 16, 64
# (batch, encoder length, decoder length): never equal, so that an export tying the two axes shows
EXAMPLE = (2, 16, 12)
CHECK_SHAPES = ((1, 7, 5), (3, 23, 11))
BUILDER_VERSION = 1

_S2S = ("input_ids", "attention_mask", "decoder_input_ids")
_TEXT = ("input_ids", "attention_mask")


@dataclass(frozen=True)
class Spec:
    name: str
    config: str  # transformers config class (or a function of this module for composites)
    model: str  # transformers model class
    inputs: tuple[str, ...]
    output: str  # the one graph output compared and kept
    kwargs: dict[str, Any] = field(default_factory=dict)
    note: str = ""


_BART = {
    "vocab_size": VOCAB,
    "d_model": HIDDEN,
    "encoder_layers": LAYERS,
    "decoder_layers": LAYERS,
    "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "encoder_ffn_dim": FFN,
    "decoder_ffn_dim": FFN,
    "max_position_embeddings": POSITIONS,
    "pad_token_id": PAD,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "decoder_start_token_id": EOS,
    "use_cache": False,
}
_T5 = {
    "vocab_size": VOCAB,
    "d_model": HIDDEN,
    "d_kv": HIDDEN // HEADS,
    "d_ff": FFN,
    "num_layers": LAYERS,
    "num_heads": HEADS,
    "pad_token_id": PAD,
    "eos_token_id": EOS,
    "decoder_start_token_id": PAD,
    "use_cache": False,
}
_VIT = {
    "image_size": IMAGE,
    "patch_size": PATCH,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": FFN,
}
SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec("marian", "MarianConfig", "MarianMTModel", _S2S, "logits", _BART, "post-norm, sinusoidal, swish"),
        Spec("mbart", "MBartConfig", "MBartForConditionalGeneration", _S2S, "logits", _BART, "pre-norm"),
        Spec("pegasus", "PegasusConfig", "PegasusForConditionalGeneration", _S2S, "logits", _BART, "pre-norm"),
        Spec("m2m100", "M2M100Config", "M2M100ForConditionalGeneration", _S2S, "logits", _BART, "pre-norm, relu"),
        Spec(
            "blenderbot_small",
            "BlenderbotSmallConfig",
            "BlenderbotSmallForConditionalGeneration",
            _S2S,
            "logits",
            _BART,
            "post-norm, embedding norm",
        ),
        Spec(
            "mt5",
            "MT5Config",
            "MT5ForConditionalGeneration",
            _S2S,
            "logits",
            {**_T5, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},
            "T5 v1.1: gated GELU, untied head",
        ),
        Spec(
            "longt5",
            "LongT5Config",
            "LongT5ForConditionalGeneration",
            _S2S,
            "logits",
            # a window of 4 (blocks of 4 tokens) and global blocks of 4: shorter than the checked inputs
            {
                **_T5,
                "feed_forward_proj": "gated-gelu",
                "encoder_attention_type": "transient-global",
                "local_radius": 4,
                "global_block_size": 4,
            },
            "transient-global encoder",
        ),
        Spec(
            "siglip_text",
            "SiglipTextConfig",
            "SiglipTextModel",
            _TEXT,
            "last_hidden_state",
            {
                "vocab_size": VOCAB,
                "hidden_size": HIDDEN,
                "num_hidden_layers": LAYERS,
                "num_attention_heads": HEADS,
                "intermediate_size": FFN,
                "max_position_embeddings": 64,
                "pad_token_id": PAD,
                "bos_token_id": BOS,
                "eos_token_id": EOS,
            },
            "tanh GELU, last-token pooler",
        ),
        Spec(
            "siglip_vision",
            "SiglipVisionConfig",
            "SiglipVisionModel",
            ("pixel_values",),
            "last_hidden_state",
            _VIT,
            "attention-pool head",
        ),
        Spec(
            "whisper",
            "WhisperConfig",
            "WhisperModel",
            ("input_features", "decoder_input_ids"),
            "last_hidden_state",
            {
                **{k: v for k, v in _BART.items() if k != "max_position_embeddings"},
                "num_mel_bins": MELS,
                "max_source_positions": FRAMES // 2,
                "max_target_positions": 64,
                "decoder_start_token_id": BOS,
            },
            "encoder + decoder, no cache",
        ),
        Spec(
            "vision_encoder_decoder",
            "_ved_config",
            "VisionEncoderDecoderModel",
            ("pixel_values", "decoder_input_ids"),
            "logits",
            note="ViT -> BERT decoder with cross-attention",
        ),
    )
}


def _ved_config(attn_implementation: str) -> Any:
    import transformers as tf

    encoder = tf.ViTConfig(**_VIT)
    decoder = tf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=POSITIONS,
        pad_token_id=PAD,
        is_decoder=True,
        add_cross_attention=True,
    )
    config = tf.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = BOS, PAD
    config._attn_implementation = attn_implementation
    config.encoder._attn_implementation = attn_implementation
    config.decoder._attn_implementation = attn_implementation
    return config


# ----------------------------------------------------------------------------------------------- build


def feeds(spec: Spec, batch: int, seq: int, dec: int, *, seed: int = 0, pad: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(LOW, VOCAB, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    if pad and seq > 2:
        mask[-1, seq // 2 :] = 0
    for row in range(batch):
        n = int(mask[row].sum())
        ids[row, 0], ids[row, n - 1] = BOS, EOS
        ids[row, n:] = PAD
    decoder = rng.integers(LOW, VOCAB, size=(batch, dec), dtype=np.int64)
    decoder[:, 0] = EOS
    out = {
        "input_ids": ids,
        "attention_mask": mask,
        "decoder_input_ids": decoder,
        "pixel_values": rng.standard_normal((batch, 3, IMAGE, IMAGE), dtype=np.float32),
        "input_features": rng.standard_normal((batch, MELS, FRAMES), dtype=np.float32),
    }
    return {k: out[k] for k in spec.inputs}


def _model(spec: Spec, attention: str) -> Any:
    import torch
    import transformers as tf

    if spec.config.startswith("_"):
        config = globals()[spec.config](attention)
    else:
        config = getattr(tf, spec.config)(**spec.kwargs, attn_implementation=attention)
    torch.manual_seed(0)
    model = getattr(tf, spec.model)(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    return model.eval()


def _wrapper(spec: Spec, model: Any) -> Any:
    import torch

    class Base(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def run(self, **kw: Any) -> tuple[Any, ...]:
            if "decoder_input_ids" in kw:
                kw["use_cache"] = False
            return (getattr(self.model(**kw, return_dict=True), spec.output),)

    class S2S(Base):
        def forward(self, input_ids: Any, attention_mask: Any, decoder_input_ids: Any) -> tuple[Any, ...]:
            return self.run(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)

    class Text(Base):
        def forward(self, input_ids: Any, attention_mask: Any) -> tuple[Any, ...]:
            return self.run(input_ids=input_ids, attention_mask=attention_mask)

    class Pixels(Base):
        def forward(self, pixel_values: Any) -> tuple[Any, ...]:
            return self.run(pixel_values=pixel_values)

    class PixelsDec(Base):
        def forward(self, pixel_values: Any, decoder_input_ids: Any) -> tuple[Any, ...]:
            return self.run(pixel_values=pixel_values, decoder_input_ids=decoder_input_ids)

    class MelDec(Base):
        def forward(self, input_features: Any, decoder_input_ids: Any) -> tuple[Any, ...]:
            return self.run(input_features=input_features, decoder_input_ids=decoder_input_ids)

    by_inputs = {_S2S: S2S, _TEXT: Text, ("pixel_values",): Pixels}
    by_inputs |= {("pixel_values", "decoder_input_ids"): PixelsDec, ("input_features", "decoder_input_ids"): MelDec}
    return by_inputs[spec.inputs]().eval()


def _axes(spec: Spec) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    for name in spec.inputs:
        if name in ("pixel_values", "input_features"):
            axes[name] = {0: "batch"}  # the image size and Whisper's frame count are fixed
        elif name == "decoder_input_ids":
            axes[name] = {0: "batch", 1: "decoder_sequence"}
        else:
            axes[name] = {0: "batch", 1: "sequence"}
    if "decoder_input_ids" in spec.inputs:
        axes[spec.output] = {0: "batch", 1: "decoder_sequence"}
    elif spec.inputs == ("pixel_values",):
        axes[spec.output] = {0: "batch"}
    else:
        axes[spec.output] = {0: "batch", 1: "sequence"}
    return axes


def _export(wrapper: Any, spec: Spec, exporter: str, example: dict[str, np.ndarray], path: Path) -> onnx.ModelProto:
    import torch

    args = tuple(torch.from_numpy(example[k]) for k in spec.inputs)
    axes = _axes(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            program = torch.onnx.export(
                wrapper,
                args,
                input_names=list(spec.inputs),
                output_names=[spec.output],
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
            output_names=[spec.output],
            dynamic_axes=axes,
        )
    return onnx.load(str(path))


def _verify(wrapper: Any, spec: Spec, path: Path) -> tuple[float, float]:
    """The worst abs difference of ORT against torch on the rows a user reads (asserted: every decoder
    position, the valid tokens of an encoder) and on an encoder's padded tokens (recorded only)."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst, padded = 0.0, 0.0
    for seed, (batch, seq, dec) in enumerate(CHECK_SHAPES, start=1):
        x = feeds(spec, batch, seq, dec, seed=seed, pad=True)
        with torch.no_grad():
            want = wrapper(*(torch.from_numpy(x[k]) for k in spec.inputs))[0].numpy()
        got = session.run([spec.output], x)[0]
        if got.shape != want.shape:
            raise AssertionError(f"at {batch}x{seq}x{dec}: ORT shape {got.shape} != torch {want.shape}")
        valid = np.ones(got.shape[:2], bool)
        if "attention_mask" in x and "decoder_input_ids" not in x:
            valid = x["attention_mask"].astype(bool)
        np.testing.assert_allclose(
            got[valid], want[valid], atol=ATOL, rtol=RTOL, err_msg=f"{path.name} at {batch}x{seq}x{dec}"
        )
        worst = max(worst, float(np.max(np.abs(got[valid] - want[valid]))))
        if (~valid).any():
            padded = max(padded, float(np.max(np.abs(got[~valid] - want[~valid]))))
    return worst, padded


def build(name: str, exporter: str, out: Path) -> dict[str, Any]:
    spec = SPECS[name]
    path = out / f"{name}_{exporter}.onnx"
    info: dict[str, Any] = {"model": name, "exporter": exporter, "builder_version": BUILDER_VERSION}
    with _heldout.build_record(info, path) as tmp:
        attention = "eager" if exporter == "ts_eager" else "sdpa"
        try:
            model = _model(spec, attention)
        except (ValueError, ImportError):
            if exporter != "dynamo":
                raise
            model = _model(spec, "eager")  # the dynamo user falls back to the attention transformers allows
        info["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        wrapper = _wrapper(spec, model)
        example = feeds(spec, *EXAMPLE)
        try:
            proto = _export(wrapper, spec, exporter, example, tmp)
        except Exception as exc:
            if exporter != "dynamo" or info["attn_implementation"] == "eager":
                raise
            # the user's way out where the decomposed SDPA cannot be exported (T5's heads merged by a view
            # after it: corpus.DYNAMO_ATTENTION): transformers' eager attention; the refusal is kept
            info["dynamo_sdpa_error"] = _cause(exc)[:300]
            model = _model(spec, "eager")
            info["attn_implementation"] = "eager"
            wrapper = _wrapper(spec, model)
            proto = _export(wrapper, spec, exporter, example, tmp)
        _heldout.finish_build(
            info,
            proto,
            tmp,
            path,
            builder=f"bench.heldout_s2s_multi --only {name} --exporters {exporter}",
            verify=lambda: _verify(wrapper, spec, path),
            keys=("max_abs_vs_torch", "padded_max_abs_vs_torch"),
        )
    return info


# ------------------------------------------------------------------------------------------------- jobs


def probe(name: str, exporter: str, out: Path, reuse: bool) -> dict[str, Any]:
    return _heldout.probe(name, exporter, out, reuse, version=BUILDER_VERSION, build=build, counts=_structure)


def _row(row: dict[str, Any]) -> list[str]:
    cells = _cells(row)
    if row.get("dynamo_sdpa_error"):
        cells[-1] = "SDPA export refused, eager exported; " + cells[-1]
    return cells


def main(argv: list[str] | None = None) -> int:
    return _heldout.encoder_main(
        argv,
        prog="python -m bench.heldout_s2s_multi",
        doc=__doc__,
        specs=SPECS,
        exporters=EXPORTERS,
        out=OUT,
        one=probe,
        cells=_row,
        head=HEAD,
        results=True,
    )


if __name__ == "__main__":
    sys.exit(main())
