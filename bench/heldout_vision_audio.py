"""Held-out probe, vision and audio encoders (issue 17): architectures outside the corpus, sent as a new user
sends them.

Run ``python -m bench.heldout_vision_audio [--only NAME ...] [--exporters E ...] [--reuse]``.

Each model of ``SPECS`` (none of them in ``tests/models/_corpus_specs.py``) comes from a transformers config
object (nothing downloaded; 2 layers or stages, hidden 32-64, 2-4 heads), every parameter perturbed by
``0.02 * randn`` and BatchNorm statistics drawn away from (0, 1) (the exporters fold equal initializers and drop
zero biases), and is exported the three ways of ``tests/models/corpus.py`` (TorchScript opset 17 with eager and
with SDPA attention, dynamo opset 18 with transformers' default attention, eager where that one cannot be
exported) with a dynamic batch axis (images: a fixed 32 or 64 pixel square; AST: fixed 48 x 32 log-mel
frames) and, for raw audio, a dynamic sample axis; then checked in ONNX Runtime against torch on two shapes
other than the export example. A model that cannot be exported is a row of the table with the reason.

Each export then goes through ``onnxforge optimize MODEL --preset fast`` in a child process with
``ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS=1`` (``bench.coverage.run_job``), and the report gives: job ok (or
its error), exact (final verification), attention fused against the upload's Softmax count, norms fused against
its LayerNormalization count, GELUs fused, and the gate's speedup. Files and one ``.json`` per row go to
``bench/out/heldout/vision_audio/``; a markdown table is printed.
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
from tests.models.corpus import _cause  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "vision_audio"
EXPORTERS = ("ts_eager", "ts_sdpa", "dynamo")
ATOL, RTOL = 1e-4, 1e-3
HOP = 320  # samples per frame of the wav2vec2-style feature encoders (5 * 2**6)
MEL_FRAMES, MEL_BINS = 48, 32  # AST's fixed spectrogram
BUILDER_VERSION = 1


@dataclass(frozen=True)
class Spec:
    name: str
    config: str  # transformers config class
    model: str  # transformers model class
    modality: str  # "image" (pixel_values, fixed square), "mel" (AST input_values, fixed), "raw" (input_values)
    kwargs: dict[str, Any] = field(default_factory=dict)
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    image: int = 32
    note: str = ""

    @property
    def input(self) -> str:
        return "pixel_values" if self.modality == "image" else "input_values"


_VIT = {
    "image_size": 32,
    "patch_size": 8,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
}
# wav2vec2's feature encoder, narrowed: 7 convs of 16 channels, one frame per 320 samples
_W2V = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "conv_dim": (16,) * 7,
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 4,
    "mask_time_prob": 0.0,
}
SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec(
            "beit",
            "BeitConfig",
            "BeitModel",
            "image",
            {**_VIT, "use_relative_position_bias": True, "use_mean_pooling": False},
            {"add_pooling_layer": False},
            note="relative position bias, layer scale",
        ),
        Spec("dinov2", "Dinov2Config", "Dinov2Model", "image", {**_VIT, "mlp_ratio": 2}, note="layer scale"),
        Spec(
            "segformer",
            "SegformerConfig",
            "SegformerModel",
            "image",
            {
                "num_encoder_blocks": 2,
                "depths": [1, 1],
                "sr_ratios": [2, 1],
                "hidden_sizes": [32, 64],
                "patch_sizes": [7, 3],
                "strides": [4, 2],
                "num_attention_heads": [2, 4],
                "mlp_ratios": [2, 2],
                "drop_path_rate": 0.0,
            },
            image=64,
            note="spatial-reduction attention, Mix-FFN",
        ),
        Spec(
            "levit",
            "LevitConfig",
            "LevitModel",
            "image",
            {
                "image_size": 64,
                # three stages: the config builds its two subsampling attentions from the first key_dim and
                # the hidden sizes, and fails (missing output_dim) with two
                "hidden_sizes": [32, 64, 96],
                "num_attention_heads": [2, 4, 6],
                "depths": [1, 1, 1],
                "key_dim": [8, 8, 8],
                "mlp_ratio": [2, 2, 2],
                "attention_ratio": [2, 2, 2],
            },
            image=64,
            note="attention biases, BatchNorm linears, Hardswish",
        ),
        Spec(
            "mobilevit",
            "MobileViTConfig",
            "MobileViTModel",
            "image",
            {
                "image_size": 64,
                "hidden_sizes": [32, 48, 64],
                "neck_hidden_sizes": [8, 16, 24, 32, 40, 48, 64],
                "num_attention_heads": 4,
            },
            image=64,
            note="unfolded patches, SiLU",
        ),
        Spec(
            "efficientnet",
            "EfficientNetConfig",
            "EfficientNetModel",
            "image",
            # hidden_dim sizes the last BatchNorm and must equal the last conv's round_filters(1280) = 320
            {"image_size": 64, "width_coefficient": 0.25, "depth_coefficient": 0.25, "hidden_dim": 320},
            image=64,
            note="depthwise, squeeze-excite, swish",
        ),
        Spec(
            "regnet",
            "RegNetConfig",
            "RegNetModel",
            "image",
            {"embedding_size": 16, "hidden_sizes": [16, 32], "depths": [1, 1], "groups_width": 8},
            note="grouped conv, squeeze-excite",
        ),
        Spec(
            "convnextv2",
            "ConvNextV2Config",
            "ConvNextV2Model",
            "image",
            {"image_size": 32, "num_stages": 2, "hidden_sizes": [32, 64], "depths": [1, 1]},
            note="GRN",
        ),
        Spec(
            "swinv2",
            "Swinv2Config",
            "Swinv2Model",
            "image",
            {
                "image_size": 32,
                "patch_size": 2,
                "embed_dim": 16,
                "depths": [1, 1],
                "num_heads": [2, 4],
                "window_size": 4,
            },
            note="cosine attention, log-CPB bias",
        ),
        Spec("hubert", "HubertConfig", "HubertModel", "raw", _W2V),
        Spec(
            "hubert_stable",
            "HubertConfig",
            "HubertModel",
            "raw",
            {**_W2V, "feat_extract_norm": "layer", "do_stable_layer_norm": True, "conv_bias": True},
            note="hubert-large/wav2vec2-large-lv60 layout: LayerNorm per conv, pre-norm layers",
        ),
        Spec(
            "wavlm",
            "WavLMConfig",
            "WavLMModel",
            "raw",
            {**_W2V, "num_buckets": 32, "max_bucket_distance": 64},
            note="gated relative position bias",
        ),
        Spec(
            "data2vec_audio",
            "Data2VecAudioConfig",
            "Data2VecAudioModel",
            "raw",
            _W2V,
            note="conv positional layers",
        ),
        Spec(
            "ast",
            "ASTConfig",
            "ASTModel",
            "mel",
            {
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 64,
                "patch_size": 16,
                "frequency_stride": 8,
                "time_stride": 8,
                "max_length": MEL_FRAMES,
                "num_mel_bins": MEL_BINS,
            },
            note="ViT on a spectrogram",
        ),
        Spec(
            "sew",
            "SEWConfig",
            "SEWModel",
            "raw",
            {
                **_W2V,
                "conv_dim": (16,) * 13,
                "layerdrop": 0.0,
                "squeeze_factor": 2,
            },
            note="squeezed sequence, upsampled",
        ),
    )
}


# ----------------------------------------------------------------------------------------------- build


def feeds(spec: Spec, batch: int, length: int, *, seed: int = 0) -> dict[str, np.ndarray]:
    """``length``: frames for raw audio (``length * HOP + 3`` samples: not a multiple of the hop); images and
    AST's spectrogram have their fixed size."""
    rng = np.random.default_rng(seed)
    if spec.modality == "image":
        x = rng.standard_normal((batch, 3, spec.image, spec.image), dtype=np.float32)
    elif spec.modality == "mel":
        x = rng.standard_normal((batch, MEL_FRAMES, MEL_BINS), dtype=np.float32)
    else:
        x = rng.standard_normal((batch, length * HOP + 3), dtype=np.float32)
    return {spec.input: x}


def _model(spec: Spec, attention: str) -> Any:
    import torch
    import transformers as tf

    config = getattr(tf, spec.config)(**spec.kwargs, attn_implementation=attention)
    torch.manual_seed(0)
    model = getattr(tf, spec.model)(config, **spec.model_kwargs)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):  # a trained net's statistics
                module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=gen) * 0.1)
                module.running_var.copy_(torch.rand(module.running_var.shape, generator=gen) + 0.5)
    return model.eval()


def _wrapper(spec: Spec, model: Any) -> Any:
    import torch

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

    class Pixels(Wrapper):
        def forward(self, pixel_values: Any) -> tuple[Any, ...]:
            return (self.model(pixel_values=pixel_values, return_dict=True).last_hidden_state,)

    class Values(Wrapper):
        def forward(self, input_values: Any) -> tuple[Any, ...]:
            return (self.model(input_values=input_values, return_dict=True).last_hidden_state,)

    return (Pixels if spec.modality == "image" else Values)().eval()


def _export(wrapper: Any, spec: Spec, exporter: str, example: dict[str, np.ndarray], path: Path) -> onnx.ModelProto:
    import torch

    args = (torch.from_numpy(example[spec.input]),)
    raw = spec.modality == "raw"
    axes_in = {0: "batch", 1: "samples"} if raw else {0: "batch"}
    axes_out = {0: "batch", 1: "sequence"} if raw else {0: "batch"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            program = torch.onnx.export(
                wrapper,
                args,
                input_names=[spec.input],
                output_names=["last_hidden_state"],
                dynamic_shapes=(axes_in,),
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
            input_names=[spec.input],
            output_names=["last_hidden_state"],
            dynamic_axes={spec.input: axes_in, "last_hidden_state": axes_out},
        )
    return onnx.load(str(path))


def _verify(wrapper: Any, spec: Spec, path: Path) -> float:
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    for seed, (batch, length) in enumerate(((1, 7), (3, 23)), start=1):
        x = feeds(spec, batch, length, seed=seed)
        with torch.no_grad():
            want = wrapper(torch.from_numpy(x[spec.input]))[0].numpy()
        got = session.run(["last_hidden_state"], x)[0]
        if got.shape != want.shape:
            raise AssertionError(f"at batch {batch}, length {length}: ORT shape {got.shape} != torch {want.shape}")
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL, err_msg=f"{path.name} at {batch}x{length}")
        worst = max(worst, float(np.max(np.abs(got - want))))
    return worst


def build(name: str, exporter: str, out: Path) -> dict[str, Any]:
    spec = SPECS[name]
    path = out / f"{name}_{exporter}.onnx"
    info: dict[str, Any] = {"model": name, "exporter": exporter, "builder_version": BUILDER_VERSION}
    with _heldout.build_record(info, path) as tmp:
        example = feeds(spec, 2, 16)
        attention = "eager" if exporter == "ts_eager" else "sdpa"
        try:
            model = _model(spec, attention)
        except (ValueError, ImportError):
            if exporter != "dynamo":
                raise
            attention = "eager"  # the dynamo user gets transformers' default, eager where it has no SDPA
            model = _model(spec, attention)
        wrapper = _wrapper(spec, model)
        try:
            proto = _export(wrapper, spec, exporter, example, tmp)
        except Exception as exc:
            if exporter != "dynamo" or attention == "eager":
                raise
            # the way out a user takes where the SDPA attention cannot be exported (the corpus' Swin and T5)
            info["sdpa_export_error"] = _cause(exc)[:300]
            attention = "eager"
            wrapper = _wrapper(spec, _model(spec, attention))
            proto = _export(wrapper, spec, exporter, example, tmp)
        info["attn_implementation"] = getattr(wrapper.model.config, "_attn_implementation", attention)
        _heldout.finish_build(
            info,
            proto,
            tmp,
            path,
            builder=f"bench.heldout_vision_audio --only {name} --exporters {exporter}",
            verify=lambda: _verify(wrapper, spec, path),
        )
    return info


# ------------------------------------------------------------------------------------------------- jobs


def _structure(src: Path, dst: Path | None) -> dict[str, Any]:
    return _heldout.structure(src, dst, lambda _, ops: {"conv": ops["Conv"]})


def probe(name: str, exporter: str, out: Path, reuse: bool) -> dict[str, Any]:
    return _heldout.probe(name, exporter, out, reuse, version=BUILDER_VERSION, build=build, counts=_structure)


def _notes(row: dict[str, Any]) -> list[str]:
    notes = []
    if row["exporter"] == "dynamo" and row.get("attn_implementation") == "eager" and "sdpa_export_error" in row:
        notes.append("SDPA not exportable by dynamo: eager")
    return notes + _heldout.job_notes(row["job"])


def _cells(row: dict[str, Any]) -> list[str]:
    return _heldout.fusion_cells(row, _notes)


HEAD = ["model", "exporter", "job", "exact (max abs)", "attention", "norms", "GELU", "speedup; notes"]


def table(rows: list[dict[str, Any]]) -> str:
    return _heldout.table(HEAD, map(_cells, rows))


def main(argv: list[str] | None = None) -> int:
    return _heldout.encoder_main(
        argv,
        prog="python -m bench.heldout_vision_audio",
        doc=__doc__,
        specs=SPECS,
        exporters=EXPORTERS,
        out=OUT,
        one=probe,
        cells=_cells,
        head=HEAD,
    )


if __name__ == "__main__":
    sys.exit(main())
