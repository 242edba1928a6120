"""The coverage corpus (issue 17 item 3): 27 models of 25 transformers architectures, each exported three ways.

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
dynamo     ``dynamo=True``, opset 18, transformers' default attention (SDPA where the model has it), or
           the one a user must pick where the default cannot be exported (``DYNAMO_ATTENTION``: Swin, eager)
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
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tests.models._corpus_specs import _S2S, _TEXT, _TEXT3, ARCHS, DIMS, LOW, SPECIAL, Arch, BuildRefused, _model

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
# The attention a user must pick for the dynamo exporter where transformers' default cannot be exported.
# Swin (transformers 5.23, torch 2.13): its SDPA call (a [1, heads, w, w] relative-position bias) passes
# torch.export but not the ONNX exporter's decompositions. Traced, the CPU SDPA output is laid out
# [B, S, heads, d] in memory, so transformers' ``transpose(1, 2).contiguous()`` before the merge of the heads
# was a no-op and the merge a ``view``; the decomposed SDPA returns a [B, heads, S, d]-contiguous tensor and
# the view fails ("Cannot view a tensor with shape [16*s, 16, 2, 8] and strides (256, 8, 128, 1)"; torch's
# issues #136543, #141107). The transformers code is not at fault and a static batch fails the same way; the
# user's way out is transformers' other attention, ``attn_implementation="eager"``, which exports with the
# dynamic batch kept. T5 fails the same way (its heads merged by a ``view`` after the decomposed SDPA: "Cannot
# view a tensor with shape [s, s, 4, 8] ... as [s, s, 32]") and takes the same way out.
DYNAMO_ATTENTION = {"swin": "eager", "t5": "eager"}

# The committed tiny subset: one architecture per family the fusions target (a post-norm encoder with token
# types, ViT, CLIP's text tower with its causal mask and EOS pooling, a pre-norm GPT decoder, a GQA/RMSNorm
# decoder, an encoder-decoder, DeBERTa (v1)'s packed projection and shared scaled query, DeBERTa-v2's bmm-heads
# attention and DeBERTa-v3's relative c2p/p2c terms, the
# audio encoders, Swin's window attention with its relative-position bias), each under the three exporters,
# small enough that tests/test_coverage.py stays minutes.
COMMITTED = (
    "bert",
    "vit",
    "clip_text",
    "gpt2",
    "llama",
    "bart",
    "deberta",
    "deberta_v2",
    "deberta_v3",
    "whisper_encoder",
    "wav2vec2",
    "swin",
)


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
    key = {
        "arch": arch,
        "exporter": exporter,
        "size": size,
        "builder_version": BUILDER_VERSION,
        "dims": DIMS[size].__dict__,
        "versions": versions,
    }
    if exporter == "dynamo" and arch in DYNAMO_ATTENTION:  # only where set: other cached builds stay valid
        key["attention"] = DYNAMO_ATTENTION[arch]
    return key


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
    spec = ARCHS[arch]
    return export_torch(wrapper, example, spec.inputs, spec.outputs, _axes(arch), exporter, path)


def export_torch(
    wrapper: Any,
    example: dict[str, np.ndarray],
    inputs: tuple[str, ...],
    outputs: tuple[str, ...],
    axes: dict[str, dict[int, str]],
    exporter: str,
    path: Path,
) -> onnx.ModelProto:
    """``wrapper`` (positional inputs in ``inputs`` order) exported as the corpus exports: ``dynamo`` at opset
    18 with ``dynamic_shapes`` from ``axes`` (inputs only), else TorchScript at opset 17 to ``path`` with
    ``axes`` as its ``dynamic_axes`` (outputs too where given)."""
    import torch

    args = tuple(torch.from_numpy(example[k]) for k in inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            program = torch.onnx.export(
                wrapper,
                args,
                input_names=list(inputs),
                output_names=list(outputs),
                dynamic_shapes=tuple(axes[k] for k in inputs),
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
            input_names=list(inputs),
            output_names=list(outputs),
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
        attention = {"ts_eager": "eager", "ts_sdpa": "sdpa", "dynamo": DYNAMO_ATTENTION.get(arch)}[exporter]
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
