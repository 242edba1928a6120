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

import argparse
import json
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402

from bench.coverage import fusion_counts, run_job  # noqa: E402
from tests.models.corpus import _cause, _strip  # noqa: E402

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
    started = time.perf_counter()
    tmp = path.with_suffix(".onnx.tmp")
    try:
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
        proto = _strip(proto, {"onnxforge.builder": f"bench.heldout_vision_audio --only {name} --exporters {exporter}"})
        onnx.checker.check_model(proto, full_check=True)
        onnx.save(proto, tmp)
        tmp.replace(path)
        try:
            info["max_abs_vs_torch"] = _verify(wrapper, spec, path)
        except BaseException as exc:
            info["verify_error"] = _cause(exc)[:300]
            raise
        info.update(ok=True, nodes=len(proto.graph.node), path=str(path))
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        last = traceback.extract_tb(exc.__traceback__)[-1]
        info.update(ok=False, error=f"{type(exc).__name__}: {_cause(exc)} ({Path(last.filename).name}:{last.lineno})")
        if "verify_error" not in info:
            path.unlink(missing_ok=True)
    info["build_s"] = round(time.perf_counter() - started, 1)
    return info


# ------------------------------------------------------------------------------------------------- jobs


def _structure(src: Path, dst: Path | None) -> dict[str, Any]:
    before = onnx.load(str(src), load_external_data=False)
    ops = Counter(n.op_type for n in before.graph.node)
    out: dict[str, Any] = {"softmax": ops["Softmax"], "conv": ops["Conv"]}
    if dst is not None and dst.exists():
        after = onnx.load(str(dst), load_external_data=False)
        done = Counter(n.op_type for n in after.graph.node)
        out["fusions"] = fusion_counts(before, after)
        out["softmax_after"] = done["Softmax"]
        out["nodes"] = [len(before.graph.node), len(after.graph.node)]
    return out


def probe(name: str, exporter: str, out: Path, reuse: bool) -> dict[str, Any]:
    record = out / f"{name}_{exporter}.json"
    if reuse and record.exists():
        row = json.loads(record.read_text())
        if row.get("builder_version") == BUILDER_VERSION:
            return row
    row = build(name, exporter, out)
    if row.get("ok"):
        with tempfile.TemporaryDirectory(prefix=f"heldout_{name}_{exporter}_") as tmp:
            job = run_job(Path(row["path"]), Path(tmp), benchmark_seconds=1, timeout=900)
            returned = Path(job["path"]) if job.get("ok") else None
            row["structure"] = _structure(Path(row["path"]), returned)
            if returned is not None:
                kept = out / f"{name}_{exporter}.fast.onnx"
                kept.write_bytes(returned.read_bytes())
                job["path"] = str(kept)
        row["job"] = job
    record.write_text(json.dumps(row, indent=1, sort_keys=True) + "\n")
    return row


def _cells(row: dict[str, Any]) -> list[str]:
    name, exporter = row["model"], row["exporter"]
    if not row.get("ok"):
        if "does not support an attention implementation" in row["error"]:
            return [name, exporter, "n/a", "", "", "", "", "transformers has no SDPA attention for it"]
        return [name, exporter, "export failed", "", "", "", "", row["error"][:160]]
    job = row["job"]
    if not job.get("ok"):
        return [name, exporter, "**failed**", "", "", "", "", job["error"][:200]]
    fus = row["structure"].get("fusions", {})
    att, norm, gelu = fus.get("attention", {}), fus.get("skip_norm", {}), fus.get("gelu", {})
    notes = []
    if exporter == "dynamo" and row.get("attn_implementation") == "eager" and "sdpa_export_error" in row:
        notes.append("SDPA not exportable by dynamo: eager")
    ft = job["fuse_transformer"]
    if ft.get("missing"):
        notes.append(f"missing: {ft['missing']}")
    if ft.get("status") and ft["status"] != "applied":
        notes.append(f"fuse_transformer {ft['status']}: {(ft.get('reason') or '')[:120]}")
    if job["failed_passes"]:
        notes.append("failed: " + "; ".join(f[:120] for f in job["failed_passes"]))
    speed = job.get("gate_speedup")
    return [
        name,
        exporter,
        f"ok ({job['decision']})",
        f"yes ({job['max_abs']:.1e})" if job["exact"] else f"**no** ({job['max_abs']:.1e})",
        f"{att.get('found', 0)}/{att.get('expected', 0)}",
        f"{norm.get('found', 0)}/{norm.get('expected', 0)}",
        f"{gelu.get('found', 0)}/{gelu.get('expected', 0)}",
        (f"x{speed:.2f}; " if speed else "") + "; ".join(notes),
    ]


def table(rows: list[dict[str, Any]]) -> str:
    head = ["model", "exporter", "job", "exact (max abs)", "attention", "norms", "GELU", "speedup; notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.heldout_vision_audio", description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(SPECS), default=list(SPECS))
    parser.add_argument("--exporters", nargs="+", choices=EXPORTERS, default=list(EXPORTERS))
    parser.add_argument("--reuse", action="store_true", help="keep the rows already in --out")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.only:
        for exporter in args.exporters:
            row = probe(name, exporter, args.out, args.reuse)
            print("|", " | ".join(_cells(row)), "|", flush=True)
            rows.append(row)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
