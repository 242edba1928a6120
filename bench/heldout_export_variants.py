"""Held-out probe (issue 17): the same models sent the many ways users export them, through ``--preset fast``.

Run ``python -m bench.heldout_export_variants [--only MODEL ...] [--exporters VARIANT ...] [--reuse] [--out DIR]``.

Models (tiny transformers configs, every parameter perturbed; ``tests.models.corpus`` and
``tests.models.build_decoders`` build them): ``bert`` (token types), ``llama`` (no cache), ``llama_past``
(Optimum's with-past signature), ``vit``, ``whisper_encoder``. Variants (the "exporter" column):

================  =========================================================================================
ts_op11/13/14/..  TorchScript (``dynamo=False``) at that opset (11, 13, 14, 17, 18, 20), dynamic batch and sequence
ts_op23           TorchScript at opset 23, the newest onnx 1.23 and torch 2.13 allow
dynamo            ``dynamo=True`` at its default opset (20); ``dynamo_op17`` written at 18, converted to 17;
                ``dynamo_op23`` at opset 23 (ONNX's Attention, RMSNormalization, RotaryEmbedding ops);
                ``dynamo_noopt`` with ``optimize=False`` (the exporter's graph before its own optimizer)
ts_functions    ``export_modules_as_functions=True``: every module an ONNX local function
ts_static       no ``dynamic_axes`` at all; ``ts_batch`` dynamic batch only
ts_fp16         ``model.half()`` exported (float inputs fp16 too); ``ts_bf16`` ``model.to(torch.bfloat16)``
ext_data        weights as external data beside the .onnx (``save_as_external_data=True``), the CLI given
                the .onnx; ``ext_zip`` the .onnx and its data in a .zip, the CLI given the zip
ts_nofold       ``do_constant_folding=False``; ``ts_kiai`` ``keep_initializers_as_inputs=True``;
                ``ts_eval`` ``export_params=True, training=TrainingMode.EVAL``
ort_opt         the opset-17 export after ``onnxruntime.transformers.optimizer.optimize_model`` (contrib ops in)
onnxsim         the opset-17 export after ``onnxsim.simplify``
ort_saved       the opset-17 export as ORT saves it at ORT_ENABLE_EXTENDED (``optimized_model_filepath``)
================  =========================================================================================

Optimum is not probed: ``pip install optimum-onnx`` (0.1.0) would downgrade transformers 5.23 to 4.57.

Each export is checked in ORT against torch on shapes other than the export's (padded rows included; static
exports at their own shape, other values): fp32 within 1e-4 abs + 1e-3 rel, fp16/bf16 within 5e-2 abs +
5e-2 rel of the fp32 torch model (half precision keeps ~3 significant digits; the tiny models' outputs are of
order 1; a bfloat16 file ORT loads is not compared: numpy has no bfloat16). Those feeds and torch's outputs are
kept (``*.check.npz``), and the returned model is run on them with its session recipe (``artifact_vs_torch``;
where padding_elimination was kept, the pad positions it leaves undefined are not compared). Then
``onnxforge optimize MODEL --preset fast`` runs as a new user runs it (no samples,
``ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS=1``). Files go to ``bench/out/heldout_export_variants/``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import _heldout  # noqa: E402
from bench.coverage import run_job  # noqa: E402
from tests.models import build_decoders as bd  # noqa: E402
from tests.models import corpus  # noqa: E402
from tests.models._corpus_specs import ARCHS  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout_export_variants"
VERSION = 2
MODELS = ("bert", "llama", "llama_past", "vit", "whisper_encoder")
VARIANTS = (
    "ts_op11",
    "ts_op13",
    "ts_op14",
    "ts_op17",
    "ts_op18",
    "ts_op20",
    "ts_op23",
    "dynamo",
    "dynamo_op17",
    "dynamo_op23",
    "dynamo_noopt",
    "ts_functions",
    "ts_static",
    "ts_batch",
    "ts_fp16",
    "ts_bf16",
    "ext_data",
    "ext_zip",
    "ts_nofold",
    "ts_kiai",
    "ts_eval",
    "ort_opt",
    "onnxsim",
    "ort_saved",
)
ATOL, RTOL = 1e-4, 1e-3
HALF_ATOL, HALF_RTOL = 5e-2, 5e-2
ORT_TYPE = {"bert": "bert", "vit": "vit", "whisper_encoder": "bart", "llama": "gpt2", "llama_past": "gpt2"}
FAMILY = bd.FAMILIES["llama"]


@dataclass(frozen=True)
class Spec:
    """What exporting and feeding one model takes: shapes are (batch, seq) or (batch, seq, past)."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    axes: dict[str, dict[int, str]]
    example: tuple[int, ...]
    checks: tuple[tuple[int, ...], ...]
    module: Callable[[], Any]
    feeds: Callable[[tuple[int, ...], int], dict[str, np.ndarray]]


def spec(name: str) -> Spec:
    if name == "llama_past":
        ins, outs = bd.input_names(FAMILY.layers, "past"), bd.output_names(FAMILY.layers, "past")
        sig = bd.Signature(tuple(ins), FAMILY.layers, FAMILY.kv_heads, FAMILY.head_dim, FAMILY.vocab)
        axes = {n: {0: "batch", 1: "sequence"} for n in ("input_ids", "position_ids", "logits")}
        axes["attention_mask"] = {0: "batch", 1: "total_sequence"}
        axes |= {n: {0: "batch", 2: "past_sequence"} for n in ins if n.startswith("past_")}
        axes |= {n: {0: "batch", 2: "total_sequence"} for n in outs[1:]}
        return Spec(
            name,
            tuple(ins),
            tuple(outs),
            axes,
            bd.EXPORT_SHAPE,
            bd.PAST_CHECKS,
            lambda: bd.wrap(bd.causal_lm(FAMILY), "past"),
            lambda shape, seed: bd.decoder_feeds(sig, *shape, seed=seed),
        )
    arch = ARCHS[name]

    def feeds(shape: tuple[int, ...], seed: int) -> dict[str, np.ndarray]:
        return corpus.feeds(name, "tiny", shape[0], shape[1], seed=seed, pad=True)

    return Spec(
        name,
        arch.inputs,
        arch.outputs,
        corpus._axes(name),
        (2, 16),
        tuple(corpus._check_shapes(arch)),
        lambda: corpus._wrapper(name, corpus._model(name, "tiny", "eager")),
        feeds,
    )


# ------------------------------------------------------------------------------------------------ export


def _torch_in(feeds: dict[str, np.ndarray], dtype: Any) -> tuple[Any, ...]:
    import torch

    out = []
    for value in feeds.values():
        t = torch.from_numpy(value)
        out.append(t.to(dtype) if t.is_floating_point() else t)
    return tuple(out)


def _np_in(feeds: dict[str, np.ndarray], np_dtype: Any) -> dict[str, np.ndarray]:
    return {k: v.astype(np_dtype) if v.dtype.kind == "f" else v for k, v in feeds.items()}


def _ts_export(s: Spec, mod: Any, dtype: Any, path: Path, *, opset: int, axes: Any, **kw: Any) -> onnx.ModelProto:
    import torch

    args = _torch_in(s.feeds(s.example, 0), dtype)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            mod,
            args,
            str(path),
            dynamo=False,
            opset_version=opset,
            input_names=list(s.inputs),
            output_names=list(s.outputs),
            dynamic_axes=axes,
            **kw,
        )
    return onnx.load(str(path))


def _dynamo_export(s: Spec, mod: Any, opset: int | None, *, optimize: bool = True) -> onnx.ModelProto:
    import torch

    args = _torch_in(s.feeds(s.example, 0), torch.float32)
    dims: dict[str, Any] = {}
    shapes = []
    for name in s.inputs:
        shapes.append({i: dims.setdefault(d, torch.export.Dim(d)) for i, d in s.axes[name].items()})
    if s.name == "llama_past":  # the wrapper's *past is one argument to torch.export
        shapes = [*shapes[:3], tuple(shapes[3:])]
    kw = {} if opset is None else {"opset_version": opset}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            mod,
            args,
            input_names=list(s.inputs),
            output_names=list(s.outputs),
            dynamic_shapes=tuple(shapes),
            dynamo=True,
            optimize=optimize,
            verbose=False,
            **kw,
        )
    return program.model_proto


def _derived(variant: str, s: Spec, base: Path, out: Path) -> onnx.ModelProto:
    """The opset-17 export as an already-optimized upload."""
    import onnxruntime as ort

    if variant == "ort_opt":
        from onnxruntime.transformers.optimizer import optimize_model

        dims = corpus.DIMS["tiny"] if s.name != "llama_past" else FAMILY
        heads, hidden = dims.heads, dims.hidden
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = optimize_model(str(base), model_type=ORT_TYPE[s.name], num_heads=heads, hidden_size=hidden)
        return opt.model
    if variant == "onnxsim":
        import onnxsim

        model, ok = onnxsim.simplify(onnx.load(str(base)))
        if not ok:
            raise RuntimeError("onnxsim could not validate its simplified model")
        return model
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(out)
    ort.InferenceSession(str(base), so, providers=["CPUExecutionProvider"])
    return onnx.load(str(out))


def export(variant: str, s: Spec, mod: Any, tmp: Path) -> tuple[onnx.ModelProto, Any]:
    """The proto of ``variant`` and the torch dtype its inputs take."""
    import torch

    half = {"ts_fp16": torch.float16, "ts_bf16": torch.bfloat16}
    dtype = half.get(variant, torch.float32)
    if variant in half:
        mod = mod.to(dtype)
    if variant.startswith("dynamo"):
        opset = {"dynamo_op17": 17, "dynamo_op23": 23}.get(variant)
        return _dynamo_export(s, mod, opset, optimize=variant != "dynamo_noopt"), dtype
    opset = int(variant[5:]) if variant.startswith("ts_op") else 17
    axes: Any = s.axes
    if variant == "ts_static":
        axes = None
    elif variant == "ts_batch":
        axes = {k: {i: d for i, d in v.items() if d == "batch"} for k, v in s.axes.items()}
    kw: dict[str, Any] = {
        "ts_nofold": {"do_constant_folding": False},
        "ts_kiai": {"keep_initializers_as_inputs": True},
        "ts_eval": {"export_params": True, "training": torch.onnx.TrainingMode.EVAL},
        "ts_functions": {"export_modules_as_functions": True},
    }.get(variant, {})
    proto = _ts_export(s, mod, dtype, tmp, opset=opset, axes=axes, **kw)
    if variant in ("ort_opt", "onnxsim", "ort_saved"):
        base = tmp.with_suffix(".base.onnx")
        onnx.save(proto, base)
        try:
            proto = _derived(variant, s, base, tmp)
        finally:
            base.unlink(missing_ok=True)
    return proto, dtype


# ------------------------------------------------------------------------------------------------ checks


def check_feeds(s: Spec, variant: str) -> list[dict[str, np.ndarray]]:
    """Other shapes than the export's; a static export at its own shape, other values."""
    if variant == "ts_static":
        return [s.feeds(s.example, seed) for seed in (1, 2)]
    if variant == "ts_batch":
        return [s.feeds((b, *s.example[1:]), seed) for seed, b in ((1, 1), (2, 3))]
    return [s.feeds(shape, seed) for seed, shape in enumerate(s.checks, start=1)]


def _tolerance(variant: str) -> tuple[float, float]:
    return (HALF_ATOL, HALF_RTOL) if variant in ("ts_fp16", "ts_bf16") else (ATOL, RTOL)


def _compare(names: tuple[str, ...], got: list[np.ndarray], want: list[np.ndarray], variant: str, where: str) -> float:
    atol, rtol = _tolerance(variant)
    worst = 0.0
    for name, out, w in zip(names, got, want, strict=True):
        o = np.asarray(out, dtype=np.float32)
        if o.shape != w.shape:
            raise AssertionError(f"{name} at {where}: shape {o.shape} != torch {w.shape}")
        np.testing.assert_allclose(o, w, atol=atol, rtol=rtol, err_msg=f"{name} at {where}")
        worst = max(worst, float(np.max(np.abs(o - w))) if o.size else 0.0)
    return worst


def reference(s: Spec, mod: Any, variant: str, path: Path) -> Path:
    """torch's fp32 outputs on the check feeds (cast to the export's float type), kept for the artifact."""
    import torch

    np_dtype = np.float16 if variant == "ts_fp16" else np.float32
    arrays: dict[str, np.ndarray] = {}
    for i, raw in enumerate(check_feeds(s, variant)):
        feeds = _np_in(raw, np_dtype)
        with torch.no_grad():
            want = mod(*_torch_in(feeds, torch.float32))
        arrays |= {f"{i}/in/{k}": v for k, v in feeds.items()}
        arrays |= {f"{i}/out/{n}": w.float().numpy() for n, w in zip(s.outputs, want, strict=True)}
    check = path.with_suffix(".check.npz")
    np.savez(check, **arrays)
    return check


def run_checks(s: Spec, variant: str, model: Path, check: Path, *, recipe: bool = False, valid: bool = False) -> float:
    """ORT on the kept feeds against torch's outputs; ``valid``: positions the attention mask marks padding are
    not compared (padding_elimination leaves them undefined, and says so in the report)."""
    from core.recipe import read_recipe
    from workers.sessions import make_session

    session = make_session(model, optimize=recipe, recipe=read_recipe(model) if recipe else None)
    if variant == "ts_bf16":
        raise NotImplementedError("ORT loads it, but numpy has no bfloat16 to feed it or read its outputs with")
    data = np.load(check)
    worst = 0.0
    for i in range(len(check_feeds(s, variant))):
        feeds = {k.split("/", 2)[2]: data[k] for k in data.files if k.startswith(f"{i}/in/")}
        want = [data[f"{i}/out/{n}"] for n in s.outputs]
        got = session.run(list(s.outputs), feeds)
        if valid and "attention_mask" in feeds:
            pad = feeds["attention_mask"] == 0
            for g, w in zip(got, want, strict=True):
                if g.shape[:2] == pad.shape:
                    g[pad], w[pad] = 0, 0
        shape = "x".join(str(d) for d in next(iter(feeds.values())).shape)
        worst = max(worst, _compare(s.outputs, got, want, variant, f"check {i} ({shape})"))
    return worst


# ------------------------------------------------------------------------------------------------ probe


def build(name: str, variant: str, out: Path) -> _heldout.Row:
    s = spec(name)
    path = out / f"{name}_{variant}.onnx"
    info: _heldout.Row = {"model": name, "exporter": variant, "builder_version": VERSION}
    with _heldout.build_record(info, path) as tmp:
        mod = s.module()
        check = reference(s, mod, variant, path)
        proto, _ = export(variant, s, mod if variant not in ("ts_fp16", "ts_bf16") else s.module(), tmp)
        info["opsets"] = {o.domain or "ai.onnx": o.version for o in proto.opset_import}
        info["domains"] = sorted({n.domain for n in proto.graph.node if n.domain})
        if variant in ("ext_data", "ext_zip"):
            _external(info, proto, tmp, path, s, variant, check)
        elif variant in ("ort_opt", "ort_saved"):  # ORT writes its contrib ops in the ONNX domain: no checker
            tmp.unlink(missing_ok=True)
            onnx.save(
                corpus._strip(proto, {"onnxforge.builder": f"bench.heldout_export_variants --exporters {variant}"}),
                path,
            )
            info["max_abs_vs_torch"] = run_checks(s, variant, path, check)
            info.update(ok=True, nodes=len(proto.graph.node), path=str(path))
        else:
            _heldout.finish_build(
                info,
                proto,
                tmp,
                path,
                builder=f"bench.heldout_export_variants --only {name} --exporters {variant}",
                verify=lambda: _checked_or_unreadable(s, variant, path, check),
            )
    return info


def _checked_or_unreadable(s: Spec, variant: str, path: Path, check: Path) -> float:
    """The torch comparison; NaN for a bfloat16 file ORT loads but numpy cannot feed (the job still runs on it,
    with its own inputs)."""
    try:
        return run_checks(s, variant, path, check)
    except NotImplementedError:
        return float("nan")


def _external(  # noqa: PLR0917
    info: _heldout.Row, proto: onnx.ModelProto, tmp: Path, path: Path, s: Spec, variant: str, check: Path
) -> None:
    """Weights beside the graph (``location``) as onnx.save_model writes them; ext_zip bundles the two."""
    proto = corpus._strip(proto, {"onnxforge.builder": f"bench.heldout_export_variants --exporters {variant}"})
    tmp.unlink(missing_ok=True)
    data = path.with_suffix(".onnx.data")
    data.unlink(missing_ok=True)
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name)
    onnx.checker.check_model(str(path), full_check=True)
    info["external_bytes"] = data.stat().st_size
    info["max_abs_vs_torch"] = run_checks(s, variant, path, check)
    info.update(ok=True, nodes=len(proto.graph.node), path=str(path))
    if variant == "ext_zip":
        bundle = path.with_suffix(".zip")
        with zipfile.ZipFile(bundle, "w") as z:
            z.write(path, path.name)
            z.write(data, data.name)
        info["path"] = str(bundle)


def counts(src: Path, dst: Path | None) -> _heldout.Row:
    onnx_src = src.with_suffix(".onnx") if src.suffix == ".zip" else src
    return _heldout.structure(onnx_src, dst)


def one(name: str, variant: str, out: Path, reuse: bool) -> _heldout.Row:
    row = _heldout.probe(name, variant, out, reuse, version=VERSION, build=build, counts=counts)
    upload = out / f"{name}_{variant}.onnx"
    if not row.get("ok") and "NOT_IMPLEMENTED" in row.get("verify_error", "") and upload.exists() and "job" not in row:
        with tempfile.TemporaryDirectory() as tmp:  # what a user sending it is told
            row["job"] = run_job(upload, Path(tmp), benchmark_seconds=1, timeout=900)
        (out / f"{name}_{variant}.json").write_text(json.dumps(row, indent=1, sort_keys=True) + "\n")
    job = row.get("job") or {}
    if job.get("ok") and "artifact_vs_torch" not in row and "artifact_error" not in row:
        check = out / f"{name}_{variant}.check.npz"
        try:
            valid = "padding_elimination" in job.get("applied", [])
            row["artifact_vs_torch"] = run_checks(
                spec(name), variant, Path(job["path"]), check, recipe=True, valid=valid
            )
            row["artifact_positions"] = "valid" if valid else "all"
        except Exception as exc:
            row["artifact_error"] = f"{type(exc).__name__}: {corpus._cause(exc)}"[:300]
        (out / f"{name}_{variant}.json").write_text(json.dumps(row, indent=1, sort_keys=True) + "\n")
    return row


def notes(row: _heldout.Row) -> list[str]:
    out = _heldout.job_notes(row["job"])
    if "artifact_vs_torch" in row:
        out.insert(0, f"artifact vs torch {row['artifact_vs_torch']:.1e}")
    if "artifact_error" in row:
        out.insert(0, f"**artifact check: {row['artifact_error'][:160]}**")
    return out


def cells(row: _heldout.Row) -> list[str]:
    if row.get("ok") is False and "NOT_IMPLEMENTED" in row.get("verify_error", ""):  # bf16 on the CPU EP
        job = row.get("job") or {}
        said = f"the service: {job['error'][:150]}" if job.get("error") else ""
        return [row["model"], row["exporter"], "ORT CPU cannot run it", "", "", "", "", said]
    if row.get("ok") is False and "verify_error" in row:
        return [row["model"], row["exporter"], "export wrong", "", "", "", "", row["verify_error"][:160]]
    return _heldout.fusion_cells(row, notes)


HEAD = ["model", "variant", "job", "exact", "attention", "skip norm", "gelu", "speedup / notes"]


def main(argv: list[str] | None = None) -> int:
    return _heldout.encoder_main(
        argv,
        prog="python -m bench.heldout_export_variants",
        doc=__doc__,
        specs=MODELS,
        exporters=VARIANTS,
        out=OUT,
        one=one,
        cells=cells,
        head=HEAD,
        results=True,
    )


if __name__ == "__main__":
    sys.exit(main())
