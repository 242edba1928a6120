"""prepost: put pre- and post-processing into the graph, so that the artifact takes raw input.

Built with onnxruntime-extensions (``PrePostProcessor``, its steps, and ``gen_processing_models`` for
tokenizers), which is imported only inside this pass: it is a runtime dependency of this pass alone, and of
every consumer of its artifact, which must register the library's custom ops (the metadata says how).

``{"pre": {"kind": "image", "resize": 256, "crop": 224, "mean": [...], "std": [...], "channels": "RGB"}}``::

    image uint8[num_bytes] (PNG/JPEG) -> DecodeImage (BGR, HWC) -> [BGR->RGB] -> [Resize shorter side,
      bilinear, antialias] -> [CenterCrop] -> [HWC->CHW] -> * rescale -> (x - mean) / std -> [1, ...] -> model

``{"pre": {"kind": "text", "tokenizer": DIR}}``::

    text string[1] -> tokenizer op from gen_processing_models(AutoTokenizer(DIR)) -> [1, n] ids, mask, types
      (cast to the model's dtypes, truncated to max_length keeping the end token) -> model

``"post"``: a chain applied to the model's first output (or ``output``): ``"softmax"``, ``"argmax"``,
``{"topk": K}``, ``{"pool": "mean"}`` (masked by the tokenizer's attention mask) and ``"l2norm"``;
``argmax`` and ``topk`` end the chain. With a post chain the artifact returns only the chain's outputs
(``probabilities``, ``label``, ``topk_values`` + ``topk_indices``, or ``embedding`` after pool/l2norm);
other outputs of the model are dropped.

Verification happens here, because the artifact's inputs are not the original's (the ledger's generic
verifier feeds both the same tensors): the artifact runs on raw samples, the original on the reference
pre-processing of the same samples (the Hugging Face tokenizer itself; Pillow + numpy for images), and the
post chain is recomputed in numpy on the original's outputs. Samples: ``ctx.samples`` entries holding an
``image`` (uint8 bytes) or ``text`` (strings) array and the ``samples`` option (sentences); images are
synthesized when none are given (a PNG at the size the model sees, so that no resize happens, a JPEG at
that size, and a PNG that goes through the resize when ``resize`` is set). Tolerances: ``atol`` where the
comparison is exact up to float rounding (PNG, no resize), ``lossy_atol`` where the graph's resize or JPEG
decoder legitimately differs from Pillow's; integer outputs (argmax, top-k indices) must be equal on exact
samples and are only reported on lossy ones.

Text: the graph tokenizer's ids are compared with the Hugging Face tokenizer's on the user's sentences and
on a built-in set (plain English, punctuation, accents, non-Latin scripts); every sentence where they
differ goes into the notes, and a difference on a user's sentence fails the pass
(``PREPOST_TOKENIZER_MISMATCH``). Other codes: ``PREPOST_TOKENIZER_INVALID`` (the directory does not
load), ``PREPOST_TOKENIZER_UNSUPPORTED`` (onnxruntime-extensions has no op for it),
``PREPOST_IMAGE_DECODE_FAILED``, ``PREPOST_MODEL_UNSUPPORTED`` (inputs the pre-processing cannot feed),
``PREPOST_NO_SAMPLES``, ``PREPOST_BUILD_FAILED``, ``PREPOST_VERIFICATION_FAILED`` and
``PREPOST_DEPENDENCY_MISSING``.

The result's notes carry ``changes_inputs: true``: the pipeline must not run its generic verification on
this pass (it cannot feed raw inputs to the original) and must trust the verification done here. It then
verifies the passes after this one against this pass's model, fed ``verified_inputs`` (the raw feeds checked
here) or the user's raw samples (``raw_inputs()`` names them). In the service the pipeline first calls
``confine_paths(input_dir)``: the tokenizer must then lie inside the upload (``PREPOST_TOKENIZER_PATH_INVALID``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as ir_common
from pydantic import Field, model_validator

from core.errors import ErrorKind, PassError
from passes._infra import Pass, PassContext, PassOptions, PassResult

REQUIRES = "onnxruntime-extensions"
REGISTER_SNIPPET = (
    "import onnxruntime as ort, onnxruntime_extensions\n"
    "options = ort.SessionOptions()\n"
    "options.register_custom_ops_library(onnxruntime_extensions.get_library_path())\n"
    'session = ort.InferenceSession("model.onnx", options)'
)
META_REQUIRES = "onnxforge.requires"
META_REGISTER = "onnxforge.register"
CUSTOM_DOMAINS = ("ai.onnx.contrib", "com.microsoft.extensions")
_ID_ROLES = ("input_ids", "attention_mask", "token_type_ids")

# Built-in sentences for the tokenizer comparison: (sentence, plain English?). Only plain-English ones are
# expected to tokenize identically with every tokenizer; the others are there to find the differences.
BUILTIN_SENTENCES: tuple[tuple[str, bool], ...] = (
    ("The quick brown fox jumps over the lazy dog.", True),
    ("A man is playing a guitar on the stage.", True),
    ("This framework generates embeddings for each input sentence", True),
    ("Sentences are passed as a list of strings.", True),
    ("How do I reset my password?", True),
    ("It was the best of times, it was the worst of times", True),
    ("Wait... what?! (Really) -- yes: 100% [sure]; #1 @home & 'quoted' \"text\"", False),
    ("Café, naïve, résumé, Ångström, São Paulo, Zürich.", False),
    ("Привет, как дела? Это тест.", False),
    ("Γειά σου Κόσμε", False),  # noqa: RUF001 (Greek on purpose)
    ("我喜欢机器学习和自然语言处理。", False),
    ("東京は日本の首都です。", False),
    ("한국어 문장도 있습니다.", False),
    ("مرحبا بالعالم", False),
    ("नमस्ते दुनिया", False),
    ("Emoji 🙂 and symbols ™ © ≠ ∑", False),
    ("  Leading and   irregular\twhitespace\n", False),
)


# ----------------------------------------------------------------------------------------------- errors


class PrepostError(PassError):
    """A prepost failure caused by the request (tokenizer, images, samples, model inputs): fix and resubmit."""

    code = "PREPOST_FAILED"
    kind = ErrorKind.INVALID_INPUT


class PrepostDependencyError(PassError):
    code = "PREPOST_DEPENDENCY_MISSING"
    kind = ErrorKind.UNAVAILABLE


class PrepostVerificationError(PassError):
    code = "PREPOST_VERIFICATION_FAILED"
    kind = ErrorKind.INTERNAL


def _fail(code: str, message: str, **detail: Any) -> PrepostError:
    return PrepostError(message, code=code, pass_name=Prepost.name, detail=detail or None)


# ---------------------------------------------------------------------------------------------- options


class ImagePre(PassOptions):
    kind: Literal["image"] = Field(description="Raw image bytes in: the input becomes `image`, uint8[num_bytes].")
    resize: int | None = Field(
        None, gt=0, description="Resize so the shorter side is this (bilinear, antialiased); none: no resize."
    )
    crop: int | None = Field(None, gt=0, description="Center crop to crop x crop after the resize; none: no crop.")
    mean: tuple[float, float, float] = Field(
        (0.0, 0.0, 0.0), description="Per-channel mean subtracted after rescaling (in `channels` order)."
    )
    std: tuple[float, float, float] = Field(
        (1.0, 1.0, 1.0), description="Per-channel standard deviation divided by after the mean."
    )
    channels: Literal["RGB", "BGR"] = Field("RGB", description="Channel order the model expects.")
    rescale: float = Field(1 / 255, gt=0, description="Pixels (0..255) are multiplied by this before the mean.")

    @model_validator(mode="after")
    def _positive_std(self) -> ImagePre:
        if any(s <= 0 for s in self.std):
            raise ValueError("std values must be > 0")
        return self


class TextPre(PassOptions):
    kind: Literal["text"] = Field(description="A string in: the input becomes `text`, string[1].")
    tokenizer: str = Field(
        description="Hugging Face tokenizer directory (in the model's archive, or a local path for the CLI)."
    )
    max_length: int | None = Field(
        None,
        ge=2,
        description="Truncate to this many tokens, keeping the end token; default: sentence_bert_config.json's "
        "max_seq_length, else the tokenizer's model_max_length when finite, else no truncation.",
    )


class TopKPost(PassOptions):
    topk: int = Field(gt=0, description="Return the k largest scores and their indices.")


class PoolPost(PassOptions):
    pool: Literal["mean"] = Field(description="Mean over the tokens, masked by the attention mask.")


PostStep = Literal["softmax", "argmax", "l2norm"] | TopKPost | PoolPost


class PrepostOptions(PassOptions):
    pre: Annotated[ImagePre | TextPre, Field(discriminator="kind")] = Field(
        description="Pre-processing: an `image` or a `text` object (see the pass description)."
    )
    post: list[PostStep] = Field(
        [],  # a plain default (pydantic copies it per instance) so the schema shows it
        description='Post-processing chain: "softmax", "argmax", {"topk": K}, {"pool": "mean"}, "l2norm".',
    )
    output: str | None = Field(None, description="Model output the post chain applies to; default: the first.")
    atol: float = Field(1e-4, gt=0, description="Max abs difference on exact samples (PNG, no resize; text).")
    lossy_atol: float = Field(
        5e-2, gt=0, description="Max abs difference where the graph's resize or JPEG decoder differs from Pillow's."
    )
    samples: list[str] = Field(
        default_factory=list, description="Sentences of the user's own: their ids must match the tokenizer's."
    )

    @model_validator(mode="after")
    def _chain(self) -> PrepostOptions:
        for i, step in enumerate(self.post):
            if (step == "argmax" or isinstance(step, TopKPost)) and i != len(self.post) - 1:
                raise ValueError("argmax and topk must end the post chain")
            if isinstance(step, PoolPost) and self.pre.kind != "text":
                raise ValueError('{"pool": "mean"} needs the text pre-processing (it is masked by its attention mask)')
        return self


# ------------------------------------------------------------------------------------------------- pass


class Prepost(Pass):
    name = "prepost"
    summary = "Prepend image decoding or tokenization and append softmax/argmax/top-k/pooling: raw input in."
    exact = True  # within atol on exact samples; the pass verifies itself (see the module docstring)
    in_place = False
    Options = PrepostOptions
    changes_inputs: ClassVar[bool] = True

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        # Set by confine_paths in the service: the tokenizer directory resolved inside the job's input dir.
        self.tokenizer_dir: Path | None = None
        # The raw feeds the last call verified ({"image": uint8[n]} or {"text": string[1]}): the pipeline
        # verifies and times the passes after this one on them.
        self.verified_inputs: list[dict[str, np.ndarray]] = []

    def raw_inputs(self) -> dict[str, str]:
        """The artifact's input, by name: its numpy dtype kind ("uint8" for image bytes, "string")."""
        return {"image": "uint8"} if self.options.pre.kind == "image" else {"text": "string"}  # type: ignore[attr-defined]

    def confine_paths(self, root: Path) -> None:
        """Resolve the tokenizer directory inside ``root`` (the service's job input dir): a relative path whose
        real location, symlinks followed, stays in ``root``; else ``PREPOST_TOKENIZER_PATH_INVALID``.

        The service must never read a path of the server's own file system named by a request; the CLI does
        not call this (a local path is the user's own)."""
        pre = self.options.pre  # type: ignore[attr-defined]
        if pre.kind != "text":
            return
        given = pre.tokenizer
        pure = Path(given)
        if not given or pure.is_absolute() or ".." in pure.parts or given.startswith("~"):
            raise _fail(
                "PREPOST_TOKENIZER_PATH_INVALID",
                f"tokenizer {given[:200]!r} must be a relative path inside the uploaded archive (no '..', not "
                'absolute); use "." for tokenizer files that lie beside the model',
            )
        base = root.resolve()
        resolved = (base / pure).resolve()
        if resolved != base and base not in resolved.parents:
            raise _fail(
                "PREPOST_TOKENIZER_PATH_INVALID",
                f"tokenizer {given[:200]!r} leads outside the uploaded archive (through a symbolic link)",
            )
        self.tokenizer_dir = resolved

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        options: PrepostOptions = self.options  # type: ignore[assignment]
        try:
            import onnxruntime_extensions as ortx

            from passes.prepost import _prepost_steps as steps
        except ImportError as exc:
            raise PrepostDependencyError(
                f"the prepost pass needs {REQUIRES} (pip install {REQUIRES}): {exc}", pass_name=self.name
            ) from exc

        proto = ir.serde.serialize_model(model)
        inputs = _graph_inputs(proto)
        outputs = [o.name for o in proto.graph.output]
        if options.output is not None:
            if options.output not in outputs:
                raise _fail("PREPOST_MODEL_UNSUPPORTED", f"output {options.output!r} is not a model output ({outputs})")
            chosen = options.output
        else:
            chosen = outputs[0]
        if options.post and chosen != outputs[0]:  # the processor joins the chain to the first output
            first = next(o for o in proto.graph.output if o.name == chosen)
            rest = [o for o in proto.graph.output if o.name != chosen]
            keep = [onnx.ValueInfoProto() for _ in range(len(rest) + 1)]
            for dst, src in zip(keep, [first, *rest], strict=True):
                dst.CopyFrom(src)
            del proto.graph.output[:]
            proto.graph.output.extend(keep)

        notes: dict[str, Any] = {
            "changes_inputs": True,
            "requires": REQUIRES,
            "register": REGISTER_SNIPPET,
            "extensions_version": getattr(ortx, "__version__", None),
            "post": [_post_name(p) for p in options.post],
        }
        pre = options.pre
        if isinstance(pre, ImagePre):
            plan = _ImagePlan(pre, inputs)
            pre_steps, raw_input = (
                plan.steps(steps.ort_steps()),
                onnx.helper.make_tensor_value_info("image", onnx.TensorProto.UINT8, ["num_bytes"]),
            )
            notes["pre"] = {"kind": "image", "input": plan.input_name, "layout": plan.layout, "size": plan.size}
            text_plan = None
        else:
            text_plan = _TextPlan(
                pre,
                inputs,
                steps,
                needs_mask=any(isinstance(p, PoolPost) for p in options.post),
                directory=self.tokenizer_dir or Path(pre.tokenizer),
            )
            pre_steps = [text_plan.step]
            raw_input = onnx.helper.make_tensor_value_info("text", onnx.TensorProto.STRING, [1])
            notes["pre"] = {
                "kind": "text",
                "tokenizer_class": text_plan.tokenizer_class,
                "tokenizer_op": text_plan.op_type,
                "max_length": text_plan.max_length,
                "inputs": text_plan.roles,
            }
            plan = None

        post_steps, final_names = _post_steps(options.post, steps, text_plan)
        artifact = _build(
            proto, raw_input, pre_steps, post_steps=post_steps, final_names=final_names, model_outputs=outputs
        )
        props = {p.key: p.value for p in proto.metadata_props}
        props[META_REQUIRES] = REQUIRES
        props[META_REGISTER] = REGISTER_SNIPPET
        onnx.helper.set_model_props(artifact, props)

        with tempfile.TemporaryDirectory(prefix="prepost-") as tmp:
            original_path = Path(tmp) / "original.onnx"
            _save(model, original_path)
            artifact_path = Path(tmp) / "artifact.onnx"
            onnx.save(artifact, str(artifact_path))
            runner = _Runner(original_path, artifact_path, ortx.get_library_path(), ctx.target)
            if plan is not None:
                verification = plan.verify(runner, options, ctx)
            else:
                assert text_plan is not None
                verification = text_plan.verify(runner, options, ctx)
        self.verified_inputs = (plan or text_plan).inputs  # type: ignore[union-attr]
        notes.update(verification)
        notes["outputs"] = [o.name for o in artifact.graph.output]
        notes["inputs"] = [{"name": raw_input.name, "dtype": "uint8" if plan is not None else "string"}]
        counts = {
            "pre_steps": len(pre_steps),
            "post_steps": len(post_steps),
            "samples_verified": sum(1 for s in verification.get("samples_checked", []) if s.get("ok")),
            "tokenizer_differences": len(verification.get("tokenizer_differences", [])),
        }
        return PassResult(ir.serde.deserialize_model(artifact), True, counts, [], notes)


def _post_name(step: Any) -> str | dict[str, Any]:
    return step if isinstance(step, str) else step.model_dump()


# ------------------------------------------------------------------------------------------ graph build


def _graph_inputs(proto: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    inits = {i.name for i in proto.graph.initializer}
    return {i.name: i for i in proto.graph.input if i.name not in inits}


def _dims(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    out: list[int | str | None] = []
    for d in vi.type.tensor_type.shape.dim:
        out.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
    return out


def _post_steps(post: list[Any], steps: Any, text_plan: _TextPlan | None) -> tuple[list[Any], list[str]]:
    """The library steps for the post chain, and the artifact's output names (empty: keep the model's)."""
    from onnxruntime_extensions.tools.pre_post_processing import IoMapEntry

    ort = steps.ort_steps()
    built: list[Any] = []
    names: list[str] = []
    for item in post:
        if item == "softmax":
            built.append(ort.Softmax())
            names = ["probabilities"]
        elif item == "argmax":
            built.append(ort.ArgMax(axis=-1, keepdims=0))
            names = ["label"]
        elif item == "l2norm":
            built.append(steps.L2Normalize())
            names = ["embedding"]
        elif isinstance(item, TopKPost):
            built.append(steps.TopK(item.topk))
            names = ["topk_values", "topk_indices"]
        elif isinstance(item, PoolPost):
            assert text_plan is not None
            mask_index = text_plan.outputs.index("attention_mask")
            built.append((steps.MaskedMeanPool(), [IoMapEntry(text_plan.step.name, mask_index, 1)]))
            names = ["embedding"]
    return built, names


def _build(
    proto: onnx.ModelProto,
    raw_input: onnx.ValueInfoProto,
    pre_steps: list[Any],
    *,
    post_steps: list[Any],
    final_names: list[str],
    model_outputs: list[str],
) -> onnx.ModelProto:
    from onnxruntime_extensions.tools.pre_post_processing import PrePostProcessor

    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 18)
    functions = list(proto.functions)
    try:
        processor = PrePostProcessor([raw_input], onnx_opset=max(18, opset))
        processor.add_pre_processing(pre_steps)
        if post_steps:
            processor.add_post_processing(post_steps)
        built = processor.run(proto)
    except Exception as exc:
        raise _fail("PREPOST_BUILD_FAILED", f"onnxruntime-extensions could not build the graph: {exc}") from exc
    graph = built.graph
    produced = [o.name for o in graph.output]
    if post_steps:
        # The chain's outputs are the ones that are not the model's own (which the processor keeps too).
        chain = [n for n in produced if n not in model_outputs and n != raw_input.name]
        if len(chain) != len(final_names):
            raise _fail("PREPOST_BUILD_FAILED", f"unexpected outputs {produced} for the post chain {final_names}")
        renames = dict(zip(chain, final_names, strict=True))
        keep = [o for o in graph.output if o.name in renames]
        for node in graph.node:
            for i, name in enumerate(node.output):
                if name in renames:
                    node.output[i] = renames[name]
            for i, name in enumerate(node.input):
                if name in renames:
                    node.input[i] = renames[name]
        for o in keep:
            o.name = renames[o.name]
        del graph.output[:]
        graph.output.extend(keep)
    else:
        keep = [o for o in graph.output if o.name in model_outputs]
        del graph.output[:]
        graph.output.extend(keep)
    model = onnx.helper.make_model(graph, opset_imports=list(built.opset_import), ir_version=max(built.ir_version, 8))
    model.functions.extend(functions)
    for f in functions:  # the functions' own domains
        if all(o.domain != f.domain for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(f.domain, 1))
    for o in proto.opset_import:  # custom domains the original used
        if all(m.domain != o.domain for m in model.opset_import):
            model.opset_import.append(o)
    model.producer_name, model.producer_version = proto.producer_name, proto.producer_version
    model.doc_string = proto.doc_string
    ir_model = ir.serde.deserialize_model(model)
    ir_common.RemoveUnusedNodesPass()(ir_model)
    model = ir.serde.serialize_model(ir_model)
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise _fail("PREPOST_BUILD_FAILED", f"the built graph does not check: {exc}") from exc
    return model


def _save(model: ir.Model, path: Path) -> None:
    total = sum(int(v.const_value.nbytes) for v in model.graph.initializers.values() if v.const_value is not None)
    if total > 1_800_000_000:
        ir.save(model, path, external_data=path.name + ".data", size_threshold_bytes=1024)
    else:
        ir.save(model, path)


class _Runner:
    """ORT sessions on the original and the artifact; the artifact's with the extensions library registered
    from the installed package's allow-listed path (never a path named by a model)."""

    def __init__(self, original: Path, artifact: Path, library: str, target: str) -> None:
        import onnxruntime as ort

        def options() -> Any:
            o = ort.SessionOptions()
            o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            o.log_severity_level = 3
            o.intra_op_num_threads = int(os.environ.get("ONNXFORGE_PREPOST_THREADS", "0") or 0)
            return o

        providers = ["CPUExecutionProvider"]  # raw-input graphs decode and tokenize on the CPU anyway
        self.original = ort.InferenceSession(str(original), options(), providers=providers)
        artifact_options = options()
        artifact_options.register_custom_ops_library(library)
        self.artifact = ort.InferenceSession(str(artifact), artifact_options, providers=providers)
        self.library = library
        self.original_outputs = [o.name for o in self.original.get_outputs()]
        self.artifact_outputs = [o.name for o in self.artifact.get_outputs()]
        self.original_inputs = {i.name: i for i in self.original.get_inputs()}

    def session(self, proto: onnx.ModelProto) -> Any:
        import onnxruntime as ort

        o = ort.SessionOptions()
        o.log_severity_level = 3
        o.register_custom_ops_library(self.library)
        return ort.InferenceSession(proto.SerializeToString(), o, providers=["CPUExecutionProvider"])


# ------------------------------------------------------------------------------------ numpy reference


def _apply_post(post: list[Any], values: list[np.ndarray], chosen: int, mask: np.ndarray | None) -> list[np.ndarray]:
    """The post chain in numpy on the original's outputs; no chain: the outputs themselves."""
    if not post:
        return values
    x = values[chosen]
    result: list[np.ndarray] = []
    for item in post:
        if item == "softmax":
            e = np.exp(x - x.max(axis=-1, keepdims=True))
            x = e / e.sum(axis=-1, keepdims=True)
        elif item == "argmax":
            x = np.argmax(x, axis=-1).astype(np.int64)
        elif item == "l2norm":
            x = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
        elif isinstance(item, TopKPost):
            order = np.argsort(-x, axis=-1, kind="stable")[..., : item.topk]
            return [np.take_along_axis(x, order, axis=-1), order.astype(np.int64)]
        elif isinstance(item, PoolPost):
            assert mask is not None
            m = mask.astype(x.dtype)[..., None]
            x = (x * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    result.append(np.asarray(x))
    return result


def _compare(expected: list[np.ndarray], got: list[np.ndarray], atol: float, exact: bool) -> dict[str, Any]:
    """Max abs difference of float outputs; integer outputs must be equal (reported only when lossy)."""
    max_abs, ints_equal, problems = 0.0, True, []
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        e, g = np.asarray(want), np.asarray(have)
        if e.shape != g.shape:
            problems.append(f"output {i}: shape {list(g.shape)} instead of {list(e.shape)}")
            continue
        if e.dtype.kind == "f":
            if e.size:
                max_abs = max(max_abs, float(np.max(np.abs(e.astype(np.float64) - g.astype(np.float64)))))
        elif not np.array_equal(e, g):
            ints_equal = False
    ok = not problems and max_abs <= atol and (ints_equal or not exact)
    return {"max_abs": max_abs, "integers_equal": ints_equal, "ok": ok, "problems": problems}


# ---------------------------------------------------------------------------------------------- images


class _ImagePlan:
    def __init__(self, pre: ImagePre, inputs: dict[str, onnx.ValueInfoProto]) -> None:
        self.pre = pre
        if len(inputs) != 1:
            raise _fail(
                "PREPOST_MODEL_UNSUPPORTED",
                f"image pre-processing feeds one image input; the model has {len(inputs)}: {sorted(inputs)}",
            )
        ((self.input_name, vi),) = inputs.items()
        dims = _dims(vi)
        elem = vi.type.tensor_type.elem_type
        if elem != onnx.TensorProto.FLOAT or len(dims) != 4:
            raise _fail(
                "PREPOST_MODEL_UNSUPPORTED",
                f"input {self.input_name!r} must be float32 of rank 4 (N,C,H,W or N,H,W,C), got "
                f"{onnx.helper.tensor_dtype_to_np_dtype(elem) if elem else 'unknown'} {dims}",
            )
        if dims[1] == 3:
            self.layout, hw = "NCHW", dims[2:4]
        elif dims[3] == 3:
            self.layout, hw = "NHWC", dims[1:3]
        else:
            raise _fail("PREPOST_MODEL_UNSUPPORTED", f"input {self.input_name!r} has no 3-channel axis: {dims}")
        self.size: list[int | str | None] = list(hw)

    def steps(self, ort: Any) -> list[Any]:
        pre = self.pre
        built: list[Any] = [ort.ConvertImageToBGR()]
        if pre.channels == "RGB":
            built.append(ort.ReverseAxis(axis=2, dim_value=3, name="BGRToRGB"))
        if pre.resize is not None:
            built.append(ort.Resize(pre.resize, layout="HWC"))
        if pre.crop is not None:
            built.append(ort.CenterCrop(pre.crop, pre.crop))
        if self.layout == "NCHW":
            built.append(ort.ChannelsLastToChannelsFirst())
        built.append(ort.ImageBytesToFloat(rescale_factor=pre.rescale))
        built.append(
            ort.Normalize(
                [(float(m), float(s)) for m, s in zip(pre.mean, pre.std, strict=True)],
                layout="CHW" if self.layout == "NCHW" else "HWC",
            )
        )
        built.append(ort.Unsqueeze([0]))
        return built

    # Reference: Pillow decode + numpy, the same arithmetic the graph does.
    def reference(self, data: bytes) -> np.ndarray:
        from PIL import Image

        pre = self.pre
        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB")
        h, w = rgb.height, rgb.width
        if pre.resize is not None:
            ratio = np.max(np.float32(pre.resize) / np.array([h, w], np.float32))
            nh, nw = (int(v) for v in np.round(np.array([h, w], np.float32) * ratio))
            if (nh, nw) != (h, w):
                rgb = rgb.resize((nw, nh), Image.Resampling.BILINEAR)
        arr = np.asarray(rgb, dtype=np.uint8)
        if pre.crop is not None:
            top, left = (arr.shape[0] - pre.crop) // 2, (arr.shape[1] - pre.crop) // 2
            arr = arr[top : top + pre.crop, left : left + pre.crop]
        if pre.channels == "BGR":
            arr = arr[..., ::-1]
        x = arr.astype(np.float32) * np.float32(pre.rescale)
        x = (x - np.array(pre.mean, np.float32)) / np.array(pre.std, np.float32)
        if self.layout == "NCHW":
            x = x.transpose(2, 0, 1)
        return np.ascontiguousarray(x[None].astype(np.float32))

    def _resized(self, h: int, w: int) -> bool:
        if self.pre.resize is None:
            return False
        ratio = np.max(np.float32(self.pre.resize) / np.array([h, w], np.float32))
        return tuple(int(v) for v in np.round(np.array([h, w], np.float32) * ratio)) != (h, w)

    def _synthetic(self) -> list[tuple[str, bytes]]:
        pre = self.pre
        if pre.crop is not None:
            base = (pre.crop, pre.crop) if pre.resize is None else (pre.resize, max(pre.resize, pre.crop) + 8)
        elif pre.resize is not None:
            base = (pre.resize, pre.resize)
        elif all(isinstance(d, int) for d in self.size):
            base = (int(self.size[0]), int(self.size[1]))  # type: ignore[arg-type]
        else:
            raise _fail(
                "PREPOST_NO_SAMPLES",
                "the model's image size is dynamic and neither resize nor crop is set: give sample images",
            )
        images = [
            ("builtin:png", _encode(_pattern(*base, seed=0), "PNG")),
            ("builtin:jpeg", _encode(_pattern(*base, seed=1), "JPEG")),
        ]
        if pre.resize is not None:
            big = (int(base[0] * 1.5) + 3, int(base[1] * 1.75) + 5)
            images.append(("builtin:png-resized", _encode(_pattern(*big, seed=2), "PNG")))
        return images

    def verify(self, runner: _Runner, options: PrepostOptions, ctx: PassContext) -> dict[str, Any]:
        try:
            from PIL import Image
        except ImportError as exc:
            raise PrepostDependencyError(
                f"image verification needs Pillow (pip install Pillow): {exc}", pass_name=Prepost.name
            ) from exc
        user: list[tuple[str, bytes]] = []
        for i, sample in enumerate(ctx.samples):
            if "image" in sample:
                user.append((f"sample:{i}", np.asarray(sample["image"], dtype=np.uint8).tobytes()))
        images = user or self._synthetic()
        self.inputs = [{"image": np.frombuffer(data, np.uint8)} for _, data in images]
        checked = []
        chosen = runner.original_outputs.index(options.output) if options.output else 0
        for label, data in images:
            try:
                with Image.open(io.BytesIO(data)) as img:
                    fmt, (w, h) = img.format, img.size
                reference = self.reference(data)
            except Exception as exc:
                raise _fail(
                    "PREPOST_IMAGE_DECODE_FAILED",
                    f"image {label} does not decode (Pillow: {type(exc).__name__}: {exc})",
                    sample=label,
                ) from exc
            try:
                got = runner.artifact.run(None, {"image": np.frombuffer(data, np.uint8)})
            except Exception as exc:
                raise _fail(
                    "PREPOST_IMAGE_DECODE_FAILED",
                    f"the artifact fails on image {label} ({fmt}): {type(exc).__name__}: {exc}",
                    sample=label,
                ) from exc
            values = runner.original.run(None, {self.input_name: reference})
            expected = _apply_post(options.post, values, chosen, None)
            if not options.post:
                expected = [values[runner.original_outputs.index(n)] for n in runner.artifact_outputs]
            lossless = fmt == "PNG" and not self._resized(h, w)
            tol = options.atol if lossless else options.lossy_atol
            result = _compare(expected, got, tol, exact=lossless)
            checked.append(
                {"sample": label, "format": fmt, "size": [h, w], "resized": self._resized(h, w), "tolerance": tol}
                | result
            )
        bad = [c for c in checked if not c["ok"]]
        if bad:
            raise PrepostVerificationError(
                f"{len(bad)} of {len(checked)} image(s) out of tolerance, first {bad[0]['sample']}: "
                f"max abs {bad[0]['max_abs']:.3g} > {bad[0]['tolerance']:g}"
                + (f"; {bad[0]['problems']}" if bad[0]["problems"] else ""),
                pass_name=Prepost.name,
                detail={"samples_checked": checked},
            )
        return {
            "samples_checked": checked,
            "samples_origin": "samples" if user else "builtin",
            "max_abs_exact": max((c["max_abs"] for c in checked if c["tolerance"] == options.atol), default=None),
            "max_abs_lossy": max((c["max_abs"] for c in checked if c["tolerance"] != options.atol), default=None),
        }


def _pattern(h: int, w: int, seed: int) -> np.ndarray:
    """A deterministic RGB test image: gradients, a few blocks and mild noise (so resizing matters)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([255 * xx / max(w - 1, 1), 255 * yy / max(h - 1, 1), 127 + 100 * np.sin((xx + yy) / 7)], -1)
    for _ in range(4):
        y0, x0 = rng.integers(0, max(h - 4, 1)), rng.integers(0, max(w - 4, 1))
        img[y0 : y0 + h // 4, x0 : x0 + w // 4] = rng.integers(0, 256, size=3)
    img += rng.normal(0, 8, size=img.shape)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def _encode(pixels: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format=fmt, **({"quality": 95, "subsampling": 0} if fmt == "JPEG" else {}))
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------ text


class _TextPlan:
    def __init__(
        self,
        pre: TextPre,
        inputs: dict[str, onnx.ValueInfoProto],
        steps: Any,
        *,
        needs_mask: bool,
        directory: Path,
    ) -> None:
        self.inputs: list[dict[str, np.ndarray]] = []
        unknown = sorted(set(inputs) - set(_ID_ROLES))
        if unknown or "input_ids" not in inputs:
            raise _fail(
                "PREPOST_MODEL_UNSUPPORTED",
                f"text pre-processing feeds input_ids, attention_mask and token_type_ids; the model's inputs are "
                f"{sorted(inputs)}" + (f" ({unknown} cannot be fed)" if unknown else " (no input_ids)"),
            )
        self.roles = list(inputs)  # model input order: the processor joins by position
        self.dtypes = {r: inputs[r].type.tensor_type.elem_type for r in self.roles}
        for role, elem in self.dtypes.items():
            if elem not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
                raise _fail("PREPOST_MODEL_UNSUPPORTED", f"input {role!r} must be int64 or int32")
        self.outputs = list(self.roles)
        if needs_mask and "attention_mask" not in self.outputs:
            self.outputs.append("attention_mask")
            self.dtypes["attention_mask"] = onnx.TensorProto.INT64
        self.tokenizer = _load_tokenizer(directory, shown=pre.tokenizer)
        self.tokenizer_class = type(self.tokenizer).__name__
        self.max_length = pre.max_length or _default_max_length(directory, self.tokenizer)
        try:
            from onnxruntime_extensions import gen_processing_models

            self.tokenizer_model, _ = gen_processing_models(self.tokenizer, pre_kwargs={})
        except Exception as exc:
            raise _fail(
                "PREPOST_TOKENIZER_UNSUPPORTED",
                f"onnxruntime-extensions cannot convert {self.tokenizer_class}: {type(exc).__name__}: {exc}",
            ) from exc
        self.op_type = next((n.op_type for n in self.tokenizer_model.graph.node if n.domain), None)
        self.step = steps.TextTokenizer(self.tokenizer_model, self.outputs, self.dtypes, self.max_length)
        self._steps = steps

    def graph_ids(self, runner: _Runner) -> Any:
        graph = self._steps.tokenizer_graph(
            self.tokenizer_model,
            "text",
            {"input_ids": "input_ids"},
            dtypes={"input_ids": onnx.TensorProto.INT64},
            max_length=self.max_length,
        )
        opsets = [o for o in self.tokenizer_model.opset_import if o.domain not in CUSTOM_DOMAINS]
        opsets += [onnx.helper.make_opsetid("com.microsoft.extensions", 1)]
        model = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=self.tokenizer_model.ir_version)
        return runner.session(model)

    def reference(self, sentence: str) -> dict[str, np.ndarray]:
        kwargs: dict[str, Any] = {"truncation": True, "max_length": self.max_length} if self.max_length else {}
        enc = self.tokenizer(sentence, return_tensors="np", **kwargs)
        feeds = {}
        for role in self.outputs:
            value = enc.get(role)
            if value is None:
                ids = np.asarray(enc["input_ids"])
                value = np.ones_like(ids) if role == "attention_mask" else np.zeros_like(ids)
            feeds[role] = np.asarray(value).astype(onnx.helper.tensor_dtype_to_np_dtype(self.dtypes[role]))
        return feeds

    def verify(self, runner: _Runner, options: PrepostOptions, ctx: PassContext) -> dict[str, Any]:
        user = list(options.samples)
        for sample in ctx.samples:
            if "text" in sample:
                user += [v.decode() if isinstance(v, bytes) else str(v) for v in np.asarray(sample["text"]).ravel()]
        sentences = [(s, "sample", False) for s in user] + [(s, "builtin", plain) for s, plain in BUILTIN_SENTENCES]
        ids_session = self.graph_ids(runner)
        chosen = runner.original_outputs.index(options.output) if options.output else 0
        differences, checked = [], []
        for sentence, source, plain in sentences:
            feeds = self.reference(sentence)
            hf_ids = feeds["input_ids"].astype(np.int64).ravel().tolist()
            graph_ids = ids_session.run(None, {"text": np.array([sentence], dtype=object)})[0].ravel().tolist()
            if hf_ids != graph_ids:
                first = next(
                    (i for i, (a, b) in enumerate(zip(hf_ids, graph_ids, strict=False)) if a != b),
                    min(len(hf_ids), len(graph_ids)),
                )
                differences.append(
                    {
                        "sentence": sentence,
                        "source": source,
                        "plain_english": plain,
                        "first_difference": first,
                        "tokenizer_ids": hf_ids,
                        "graph_ids": graph_ids,
                    }
                )
                continue
            feed = {"text": np.array([sentence], dtype=object)}
            got = runner.artifact.run(None, feed)
            self.inputs.append(feed)
            model_feeds = {k: v for k, v in feeds.items() if k in runner.original_inputs}
            values = runner.original.run(None, model_feeds)
            expected = _apply_post(options.post, values, chosen, feeds.get("attention_mask"))
            if not options.post:
                expected = [values[runner.original_outputs.index(n)] for n in runner.artifact_outputs]
            checked.append(
                {"sample": sentence, "source": source, "plain_english": plain, "tolerance": options.atol}
                | _compare(expected, got, options.atol, exact=True)
            )
        own = [d for d in differences if d["source"] == "sample"]
        if own:
            raise _fail(
                "PREPOST_TOKENIZER_MISMATCH",
                f"the graph tokenizer ({self.op_type}) gives other ids than {self.tokenizer_class} on "
                f"{len(own)} of your {len(user)} sample sentence(s), first: {own[0]['sentence']!r}",
                tokenizer_differences=differences,
            )
        bad = [c for c in checked if not c["ok"]]
        if bad:
            raise PrepostVerificationError(
                f"{len(bad)} sentence(s) out of tolerance, first {bad[0]['sample']!r}: max abs "
                f"{bad[0]['max_abs']:.3g} > {options.atol:g}"
                + (f"; {bad[0]['problems']}" if bad[0]["problems"] else ""),
                pass_name=Prepost.name,
                detail={"samples_checked": checked, "tokenizer_differences": differences},
            )
        return {
            "samples_checked": checked,
            "samples_origin": "samples+builtin" if user else "builtin",
            "max_abs_exact": max((c["max_abs"] for c in checked), default=None),
            "tokenizer_differences": differences,
            "tokenizer_differences_plain_english": sum(1 for d in differences if d["plain_english"]),
        }


def _load_tokenizer(directory: Path, shown: str) -> Any:
    """The Hugging Face tokenizer in ``directory``; messages name it as the user did (``shown``), never by
    the server's path."""
    if not directory.is_dir():
        raise _fail("PREPOST_TOKENIZER_INVALID", f"tokenizer {shown[:200]!r} is not a directory")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise PrepostDependencyError(
            f"text pre-processing needs transformers (the tokenizer itself is the reference): {exc}",
            pass_name=Prepost.name,
        ) from exc
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        raise _fail(
            "PREPOST_TOKENIZER_INVALID",
            f"the tokenizer directory {shown[:200]!r} does not load: {type(exc).__name__}: "
            f"{str(exc).replace(str(directory), shown)[:500]}",
        ) from exc
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _default_max_length(directory: Path, tokenizer: Any) -> int | None:
    config = directory / "sentence_bert_config.json"
    if config.is_file():
        with contextlib.suppress(ValueError, OSError, TypeError):
            value = json.loads(config.read_text()).get("max_seq_length")
            if isinstance(value, int) and value >= 2:
                return value
    value = getattr(tokenizer, "model_max_length", None)
    return int(value) if isinstance(value, int) and 2 <= value <= 1_000_000 else None
