"""Held-out probe, round 2: encoders, vision, audio and video not probed before (issue 17).

Run ``python -m bench.heldout_round2_encoders [--only NAME ...] [--exporters E ...] [--reuse]``.

Each model of ``SPECS`` is in neither the corpus (``tests/models/_corpus_specs.py``) nor the first round
(``bench.heldout_text``, ``bench.heldout_vision_audio``). It comes from a transformers config object (nothing
downloaded; 2 layers or stages, hidden 32-64, 2-4 heads), is perturbed as the first round's are (that round's
``_model``: every parameter by ``0.02 * randn``, BatchNorm statistics away from (0, 1)) and exported three ways
(TorchScript opset 17 eager and SDPA, dynamo opset 18 with SDPA where transformers has it) with a dynamic batch
axis and, for token, raw audio and feature inputs, a dynamic sequence axis; images are a fixed square, videos a
fixed ``[frames, 3, side, side]``. Inputs a user's tokenizer or processor gives beside the ids are fed as such:
word boxes (LiLT), XPath tag and subscript ids (MarkupLM), log-mel features (Wav2Vec2-BERT). Each export is
checked in ONNX Runtime against torch on two shapes other than the export example (text: valid tokens, the last
row half padding), then goes through ``onnxforge optimize MODEL --preset fast`` (``bench.coverage.run_job``,
``ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS=1``); the table gives job ok, exact, attention / residual norm / GELU
fusions found against the upload's sites, the gate's speedup and the report's reasons. Files and one ``.json``
per row go to ``bench/out/heldout/round2_encoders/``.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402

from bench import _heldout, heldout_text, heldout_vision_audio  # noqa: E402
from tests.models.corpus import _cause  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "round2_encoders"
EXPORTERS = ("ts_eager", "ts_sdpa", "dynamo")
ATOL, RTOL = 1e-4, 1e-3
BUILDER_VERSION = 1
XPATH_DEPTH, XPATH_TAGS, XPATH_SUBS = 8, 256, 1024
MEL_DIM = 160  # Wav2Vec2-BERT's stacked log-mel features (2 frames of 80 bins)
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "bbox")
SEQUENCE_KINDS = ("text", "raw", "features")


@dataclass(frozen=True)
class Spec:
    name: str
    config: str  # transformers config class
    model: str  # transformers model class
    kind: str  # "text", "image" (fixed square), "video" (fixed frames and square), "raw" audio, "features"
    inputs: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    image: int = 32
    frames: int = 4
    note: str = ""


_T2 = ("input_ids", "attention_mask")
_T3 = ("input_ids", "attention_mask", "token_type_ids")
_PIX = ("pixel_values",)
_RAW = ("input_values",)
_BERT = {
    "vocab_size": heldout_text.VOCAB,
    "hidden_size": heldout_text.HIDDEN,
    "num_hidden_layers": heldout_text.LAYERS,
    "num_attention_heads": heldout_text.HEADS,
    "intermediate_size": heldout_text.FFN,
    "max_position_embeddings": heldout_text.POSITIONS,
    "pad_token_id": heldout_text.PAD,
}
_VIT = {
    "image_size": 32,
    "patch_size": 8,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
}
_W2V = heldout_vision_audio._W2V
_NO_POOL = {"add_pooling_layer": False}

SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        # ------------------------------------------------------------------------------------------ text
        Spec(
            "deberta",
            "DebertaConfig",
            "DebertaModel",
            "text",
            _T3,
            {
                **_BERT,
                "type_vocab_size": 2,
                "relative_attention": True,
                "pos_att_type": ["c2p", "p2c"],
                "max_relative_positions": 64,
            },
            note="v1: disentangled attention, DebertaLayerNorm",
        ),
        Spec(
            "longformer",
            "LongformerConfig",
            "LongformerModel",
            "text",
            _T2,
            {**_BERT, "attention_window": 4},
            _NO_POOL,
            note="sliding-window chunks, pads to the window",
        ),
        Spec(
            "bigbird",
            "BigBirdConfig",
            "BigBirdModel",
            "text",
            _T3,
            {**_BERT, "attention_type": "original_full"},
            _NO_POOL,
            note="original_full (block_sparse falls back to it below 5+2r blocks)",
        ),
        Spec(
            "canine",
            "CanineConfig",
            "CanineModel",
            "text",
            _T3,
            {
                **{k: v for k, v in _BERT.items() if k != "vocab_size"},
                "max_position_embeddings": 512,
                "num_hash_buckets": 64,
                "num_hash_functions": 4,
                "downsampling_rate": 4,
                "local_transformer_stride": 8,
                "type_vocab_size": 2,
            },
            note="character hashes, downsampling conv, local transformer",
        ),
        Spec("data2vec_text", "Data2VecTextConfig", "Data2VecTextModel", "text", _T2, _BERT, _NO_POOL),
        # round 3 (stop 31)
        Spec("camembert", "CamembertConfig", "CamembertModel", "text", _T2, _BERT, _NO_POOL),
        Spec("megatron_bert", "MegatronBertConfig", "MegatronBertModel", "text", _T3, _BERT, _NO_POOL, note="pre-norm"),
        Spec("bert_generation", "BertGenerationConfig", "BertGenerationEncoder", "text", _T2, _BERT),
        Spec("chinese_clip_text", "ChineseCLIPTextConfig", "ChineseCLIPTextModel", "text", _T3, _BERT, _NO_POOL),
        Spec("clap_text", "ClapTextConfig", "ClapTextModel", "text", _T2, _BERT, _NO_POOL),
        Spec("altclip_text", "AltCLIPTextConfig", "AltCLIPTextModel", "text", _T2, _BERT),
        Spec(
            "xmod",
            "XmodConfig",
            "XmodModel",
            "text",
            _T2,
            {**_BERT, "languages": ["en_XX", "de_DE"], "default_language": "de_DE"},
            _NO_POOL,
            note="per-language adapters",
        ),
        Spec(
            "lilt",
            "LiltConfig",
            "LiltModel",
            "text",
            ("input_ids", "bbox", "attention_mask", "token_type_ids"),
            # six box embeddings of hidden // 6 each must add up to the hidden size
            {**_BERT, "hidden_size": 48, "intermediate_size": 96, "max_2d_position_embeddings": 1024},
            _NO_POOL,
            note="layout stream beside the text stream",
        ),
        Spec(
            "markuplm",
            "MarkupLMConfig",
            "MarkupLMModel",
            "text",
            ("input_ids", "xpath_tags_seq", "xpath_subs_seq", "attention_mask"),
            {
                **_BERT,
                "max_depth": XPATH_DEPTH,
                "max_xpath_tag_unit_embeddings": XPATH_TAGS,
                "max_xpath_subs_unit_embeddings": XPATH_SUBS,
                "xpath_unit_hidden_size": 8,
            },
            _NO_POOL,
            note="XPath tag and subscript ids [B, S, depth]",
        ),
        Spec(
            "rembert",
            "RemBertConfig",
            "RemBertModel",
            "text",
            _T3,
            {**_BERT, "input_embedding_size": 16, "output_embedding_size": 16},
            _NO_POOL,
            note="decoupled embeddings",
        ),
        Spec(
            "xlm",
            "XLMConfig",
            "XLMModel",
            "text",
            _T2,
            {
                "vocab_size": heldout_text.VOCAB,
                "emb_dim": 32,
                "n_layers": 2,
                "n_heads": 4,
                "max_position_embeddings": 264,
            },
            note="post-norm, sinusoidal off",
        ),
        Spec("splinter", "SplinterConfig", "SplinterModel", "text", _T3, {**_BERT, "question_token_id": 6}),
        Spec("ibert", "IBertConfig", "IBertModel", "text", _T2, {**_BERT, "quant_mode": False}, _NO_POOL),
        Spec(
            "yoso",
            "YosoConfig",
            "YosoModel",
            "text",
            _T3,
            {**_BERT, "type_vocab_size": 2, "use_expectation": True, "conv_window": None},
            note="LSH attention (expectation form)",
        ),
        # ----------------------------------------------------------------------------------------- vision
        Spec(
            "data2vec_vision",
            "Data2VecVisionConfig",
            "Data2VecVisionModel",
            "image",
            _PIX,
            {**_VIT, "use_relative_position_bias": True, "use_mean_pooling": False},
            _NO_POOL,
            note="BEiT layout",
        ),
        Spec(
            "yolos",
            "YolosConfig",
            "YolosModel",
            "image",
            _PIX,
            {**_VIT, "image_size": [32, 32], "num_detection_tokens": 4},
            _NO_POOL,
        ),
        Spec(
            "dpt",
            "DPTConfig",
            "DPTModel",
            "image",
            _PIX,
            {
                **_VIT,
                "num_hidden_layers": 4,
                "backbone_out_indices": [0, 1, 2, 3],
                "neck_hidden_sizes": [8, 16, 32, 32],
            },
            _NO_POOL,
            note="ViT backbone of a dense-prediction model",
        ),
        Spec(
            "pvt_v2",
            "PvtV2Config",
            "PvtV2Model",
            "image",
            _PIX,
            {
                "image_size": 64,
                "num_encoder_blocks": 2,
                "depths": [1, 1],
                "sr_ratios": [2, 1],
                "hidden_sizes": [32, 64],
                "patch_sizes": [7, 3],
                "strides": [4, 2],
                "num_attention_heads": [2, 4],
                "mlp_ratios": [2, 2],
            },
            image=64,
            note="spatial-reduction attention, depthwise Mix-FFN",
        ),
        Spec(
            "cvt",
            "CvtConfig",
            "CvtModel",
            "image",
            _PIX,
            {
                "embed_dim": [16, 32],
                "num_heads": [2, 2],
                "depth": [1, 2],  # transformers reads stage i's drop-path rate at index i of a depth-long list
                "patch_sizes": [7, 3],
                "patch_stride": [4, 2],
                "patch_padding": [2, 1],
                "mlp_ratio": [2.0, 2.0],
                "attention_drop_rate": [0.0, 0.0],
                "drop_rate": [0.0, 0.0],
                "drop_path_rate": [0.0, 0.0],
                "qkv_bias": [True, True],
                "cls_token": [False, True],
                "qkv_projection_method": ["dw_bn", "dw_bn"],
                "kernel_qkv": [3, 3],
                "padding_kv": [1, 1],
                "stride_kv": [2, 2],
                "padding_q": [1, 1],
                "stride_q": [1, 1],
            },
            _NO_POOL,
            image=64,
            note="convolutional projections (depthwise conv + BatchNorm)",
        ),
        Spec(
            "dinov2_reg",
            "Dinov2WithRegistersConfig",
            "Dinov2WithRegistersModel",
            "image",
            _PIX,
            {**_VIT, "mlp_ratio": 2, "num_register_tokens": 4},
            note="register tokens",
        ),
        Spec("vit_msn", "ViTMSNConfig", "ViTMSNModel", "image", _PIX, _VIT),
        # round 3 (stop 31): towers and BERT variants of models no probe had
        Spec("owlvit_vision", "OwlViTVisionConfig", "OwlViTVisionModel", "image", _PIX, _VIT, note="OWL-ViT's tower"),
        Spec("blip_vision", "BlipVisionConfig", "BlipVisionModel", "image", _PIX, _VIT, note="BLIP's tower"),
        Spec(
            "chinese_clip_vision",
            "ChineseCLIPVisionConfig",
            "ChineseCLIPVisionModel",
            "image",
            _PIX,
            _VIT,
            note="Chinese-CLIP's tower",
        ),
        Spec(
            "siglip_vision",
            "SiglipVisionConfig",
            "SiglipVisionModel",
            "image",
            _PIX,
            _VIT,
            note="attention-pooling head (MultiheadAttention probe)",
        ),
        Spec(
            "hiera",
            "HieraConfig",
            "HieraModel",
            "image",
            _PIX,
            {
                "image_size": [64, 64],
                "embed_dim": 16,
                "depths": [1, 1],
                "num_heads": [1, 2],
                "num_query_pool": 1,
                "masked_unit_size": [4, 4],
                "masked_unit_attention": [True, False],
                "stage_names": ["stem", "stage1", "stage2"],
                "out_features": ["stage2"],
            },
            _NO_POOL,
            image=64,
            note="mask-unit attention, query pooling",
        ),
        Spec(
            "focalnet",
            "FocalNetConfig",
            "FocalNetModel",
            "image",
            _PIX,
            {
                "embed_dim": 16,
                "depths": [1, 1],
                "hidden_sizes": [16, 32],
                "focal_levels": [2, 2],
                "focal_windows": [3, 3],
                "stage_names": ["stem", "stage1", "stage2"],
                "out_features": ["stage2"],
                "drop_path_rate": 0.0,
            },
            note="focal modulation, no attention",
        ),
        Spec(
            "poolformer",
            "PoolFormerConfig",
            "PoolFormerModel",
            "image",
            _PIX,
            {
                "depths": [1, 1],
                "hidden_sizes": [16, 32],
                "num_encoder_blocks": 2,
                "patch_sizes": [7, 3],
                "strides": [4, 2],
                "padding": [2, 1],
            },
            note="pooling token mixer, GroupNorm",
        ),
        Spec(
            "mobilenet_v1",
            "MobileNetV1Config",
            "MobileNetV1Model",
            "image",
            _PIX,
            {"depth_multiplier": 0.25, "image_size": 32},
            note="depthwise separable, ReLU6",
        ),
        Spec(
            "bit",
            "BitConfig",
            "BitModel",
            "image",
            _PIX,
            {
                "embedding_size": 16,
                "hidden_sizes": [32, 64],
                "depths": [1, 1],
                "num_groups": 4,
                "stage_names": ["stem", "stage1", "stage2"],
                "out_features": ["stage2"],
            },
            note="weight-standardized convs, GroupNorm",
        ),
        # ------------------------------------------------------------------------------------------ video
        Spec(
            "videomae",
            "VideoMAEConfig",
            "VideoMAEModel",
            "video",
            _PIX,
            {**_VIT, "num_frames": 4, "tubelet_size": 2},
            note="tubelet Conv3d, fixed sinusoid table",
        ),
        Spec(
            "vivit",
            "VivitConfig",
            "VivitModel",
            "video",
            _PIX,
            {**{k: v for k, v in _VIT.items() if k != "patch_size"}, "num_frames": 4, "tubelet_size": [2, 8, 8]},
            _NO_POOL,
            note="tubelet Conv3d, gelu_fast",
        ),
        # ------------------------------------------------------------------------------------------ audio
        Spec("unispeech", "UniSpeechConfig", "UniSpeechModel", "raw", _RAW, _W2V),
        Spec("unispeech_sat", "UniSpeechSatConfig", "UniSpeechSatModel", "raw", _RAW, _W2V),
        Spec(
            "w2v2_conformer_rel",
            "Wav2Vec2ConformerConfig",
            "Wav2Vec2ConformerModel",
            "raw",
            _RAW,
            # hidden 8, 2 heads: its positions table [2 * 5000 - 1, hidden] is most of the file (committed as a test)
            {
                **_W2V,
                "hidden_size": 8,
                "num_attention_heads": 2,
                "intermediate_size": 16,
                "num_conv_pos_embedding_groups": 2,
                "position_embeddings_type": "relative",
                "conv_depthwise_kernel_size": 7,
            },
            note="Transformer-XL relative positions, conformer conv module",
        ),
        Spec(
            "w2v2_conformer_rope",
            "Wav2Vec2ConformerConfig",
            "Wav2Vec2ConformerModel",
            "raw",
            _RAW,
            {**_W2V, "position_embeddings_type": "rotary", "conv_depthwise_kernel_size": 7},
            note="rotary, conformer conv module",
        ),
        Spec(
            "w2v2_bert",
            "Wav2Vec2BertConfig",
            "Wav2Vec2BertModel",
            "features",
            ("input_features",),
            {
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 64,
                "feature_projection_input_dim": MEL_DIM,
                "conv_depthwise_kernel_size": 7,
                "left_max_position_embeddings": 8,
                "right_max_position_embeddings": 4,
                "mask_time_prob": 0.0,
                "layerdrop": 0.0,
            },
            note="log-mel features, relative_key positions, conformer",
        ),
    )
}


# ----------------------------------------------------------------------------------------------- build


def feeds(spec: Spec, batch: int, length: int, *, seed: int = 0, pad: bool = False) -> dict[str, np.ndarray]:
    """``length``: tokens (text), frames (raw audio: the first round's ``HOP`` samples each; features)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    if spec.kind == "text":
        known = tuple(k for k in spec.inputs if k in TEXT_INPUTS)
        out = heldout_text.feeds(SimpleNamespace(inputs=known), batch, length, seed=seed, pad=pad)
        shape = (batch, length, XPATH_DEPTH)
        if "xpath_tags_seq" in spec.inputs:  # a page's tags, as the processor pads them (pad id beyond depth)
            depth = rng.integers(1, XPATH_DEPTH, size=(batch, length, 1))
            live = np.arange(XPATH_DEPTH) < depth
            out["xpath_tags_seq"] = np.where(live, rng.integers(0, XPATH_TAGS - 40, size=shape), 216)
            out["xpath_subs_seq"] = np.where(live, rng.integers(0, 50, size=shape), 1001)
    elif spec.kind in ("image", "raw"):
        modality = SimpleNamespace(modality=spec.kind, image=spec.image, input=spec.inputs[0])
        out = heldout_vision_audio.feeds(modality, batch, length, seed=seed)
    elif spec.kind == "video":
        shape = (batch, spec.frames, 3, spec.image, spec.image)
        out = {"pixel_values": rng.standard_normal(shape, dtype=np.float32)}
    else:
        out = {"input_features": rng.standard_normal((batch, length, MEL_DIM), dtype=np.float32)}
    return {k: out[k].astype(np.int64) if out[k].dtype.kind == "i" else out[k] for k in spec.inputs}


def _wrapper(spec: Spec, model: Any) -> Any:
    return _heldout.positional_wrapper(model, spec.inputs, ("last_hidden_state",))


def _export(wrapper: Any, spec: Spec, exporter: str, example: dict[str, np.ndarray], path: Path) -> onnx.ModelProto:
    import torch

    args = tuple(torch.from_numpy(example[k]) for k in spec.inputs)
    axes = {0: "batch", 1: "sequence"} if spec.kind in SEQUENCE_KINDS else {0: "batch"}
    in_axes = {k: dict(axes) for k in spec.inputs}
    if spec.kind == "raw":
        in_axes = {k: {0: "batch", 1: "samples"} for k in spec.inputs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            program = torch.onnx.export(
                wrapper,
                args,
                input_names=list(spec.inputs),
                output_names=["last_hidden_state"],
                dynamic_shapes=tuple(in_axes[k] for k in spec.inputs),
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
            output_names=["last_hidden_state"],
            dynamic_axes={**in_axes, "last_hidden_state": dict(axes)},
        )
    return onnx.load(str(path))


def _verify(wrapper: Any, spec: Spec, path: Path) -> tuple[float, float]:
    """Worst abs difference on the valid tokens (asserted) and on padded ones (recorded only, as the first
    round's text probe does: what a fully masked query gets is each implementation's own)."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst, padded = 0.0, 0.0
    for seed, (batch, length) in enumerate(((1, 7), (3, 23)), start=1):
        x = feeds(spec, batch, length, seed=seed, pad=True)
        with torch.no_grad():
            want = wrapper(*(torch.from_numpy(x[k]) for k in spec.inputs))[0].numpy()
        got = session.run(["last_hidden_state"], x)[0]
        if got.shape != want.shape:
            raise AssertionError(f"at {batch}x{length}: ORT shape {got.shape} != torch {want.shape}")
        valid = np.ones(got.shape[:2], bool)
        if "attention_mask" in x and x["attention_mask"].shape == valid.shape:
            valid = x["attention_mask"].astype(bool)
        np.testing.assert_allclose(
            got[valid], want[valid], atol=ATOL, rtol=RTOL, err_msg=f"{path.name} {batch}x{length}"
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
        example = feeds(spec, 2, 16)
        attention = "eager" if exporter == "ts_eager" else "sdpa"
        try:
            model = heldout_vision_audio._model(spec, attention)
        except (ValueError, ImportError):
            if exporter != "dynamo":
                raise
            attention = "eager"  # the dynamo user gets transformers' default, eager where it has no SDPA
            model = heldout_vision_audio._model(spec, attention)
        wrapper = _wrapper(spec, model)
        try:
            proto = _export(wrapper, spec, exporter, example, tmp)
        except Exception as exc:
            if exporter != "dynamo" or attention == "eager":
                raise
            info["sdpa_export_error"] = _cause(exc)[:300]
            attention = "eager"
            wrapper = _wrapper(spec, heldout_vision_audio._model(spec, attention))
            proto = _export(wrapper, spec, exporter, example, tmp)
        info["attn_implementation"] = getattr(wrapper.model.config, "_attn_implementation", attention)
        _heldout.finish_build(
            info,
            proto,
            tmp,
            path,
            builder=f"bench.heldout_round2_encoders --only {name} --exporters {exporter}",
            verify=lambda: _verify(wrapper, spec, path),
            keys=("max_abs_vs_torch", "padded_max_abs_vs_torch"),
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
    if row.get("padded_max_abs_vs_torch", 0.0) > ATOL:
        notes.append(f"export differs from torch at padded tokens only ({row['padded_max_abs_vs_torch']:.1e})")
    return notes + _heldout.job_notes(row["job"])


def _cells(row: dict[str, Any]) -> list[str]:
    return _heldout.fusion_cells(row, _notes)


HEAD = ["model", "exporter", "job", "exact (max abs)", "attention", "skip-norm", "GELU", "speedup; notes"]


def table(rows: list[dict[str, Any]]) -> str:
    return _heldout.table(HEAD, map(_cells, rows))


def main(argv: list[str] | None = None) -> int:
    return _heldout.encoder_main(
        argv,
        prog="python -m bench.heldout_round2_encoders",
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
