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

The pass declares ``changes_inputs`` (``passes/_infra.py``): the pipeline must not run its generic verification
on this pass (it cannot feed raw inputs to the original) and trusts the verification done here, which the
result returns as ``inputs_changed`` (an ``InputChange``). It then verifies the passes after this one against
this pass's model, fed the ``verified_inputs`` (the raw feeds checked here) or the user's raw samples
(``raw_inputs()`` names them). In the service the pipeline first calls ``confine_paths(input_dir)``: the
tokenizer must then lie inside the upload (``PREPOST_TOKENIZER_PATH_INVALID``).

Modules: options and errors in ``_prepost_options``, the graph build in ``_prepost_graph``, the sessions and
the numpy post chain in ``_prepost_check``, images in ``_prepost_image``, text in ``_prepost_text``, the
custom steps in ``_prepost_steps``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from passes._infra import InputChange, Pass, PassContext, PassResult
from passes.prepost._prepost_check import Runner
from passes.prepost._prepost_graph import build, graph_inputs, post_steps, save
from passes.prepost._prepost_image import ImagePlan
from passes.prepost._prepost_options import (
    PASS_NAME,
    ImagePre,
    PoolPost,
    PrepostDependencyError,
    PrepostOptions,
    fail,
)
from passes.prepost._prepost_text import TextPlan

REQUIRES = "onnxruntime-extensions"
REGISTER_SNIPPET = (
    "import onnxruntime as ort, onnxruntime_extensions\n"
    "options = ort.SessionOptions()\n"
    "options.register_custom_ops_library(onnxruntime_extensions.get_library_path())\n"
    'session = ort.InferenceSession("model.onnx", options)'
)
META_REQUIRES = "onnxforge.requires"
META_REGISTER = "onnxforge.register"

# ------------------------------------------------------------------------------------------------- pass


class Prepost(Pass[PrepostOptions]):
    name = PASS_NAME
    summary = "Prepend image decoding or tokenization and append softmax/argmax/top-k/pooling: raw input in."
    exact = True  # within atol on exact samples; the pass verifies itself (see the module docstring)
    in_place = False
    changes_inputs = True

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        # Set by confine_paths in the service: the tokenizer directory resolved inside the job's input dir.
        self.tokenizer_dir: Path | None = None

    def raw_inputs(self) -> dict[str, str]:
        """The artifact's input, by name: its numpy dtype kind ("uint8" for image bytes, "string")."""
        return {"image": "uint8"} if self.options.pre.kind == "image" else {"text": "string"}

    def confine_paths(self, root: Path) -> None:
        """Resolve the tokenizer directory inside ``root`` (the service's job input dir): a relative path whose
        real location, symlinks followed, stays in ``root``; else ``PREPOST_TOKENIZER_PATH_INVALID``.

        The service must never read a path of the server's own file system named by a request; the CLI does
        not call this (a local path is the user's own)."""
        pre = self.options.pre
        if pre.kind != "text":
            return
        given = pre.tokenizer
        pure = Path(given)
        if not given or pure.is_absolute() or ".." in pure.parts or given.startswith("~"):
            raise fail(
                "PREPOST_TOKENIZER_PATH_INVALID",
                f"tokenizer {given[:200]!r} must be a relative path inside the uploaded archive (no '..', not "
                'absolute); use "." for tokenizer files that lie beside the model',
            )
        base = root.resolve()
        resolved = (base / pure).resolve()
        if resolved != base and base not in resolved.parents:
            raise fail(
                "PREPOST_TOKENIZER_PATH_INVALID",
                f"tokenizer {given[:200]!r} leads outside the uploaded archive (through a symbolic link)",
            )
        self.tokenizer_dir = resolved

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        options = self.options
        try:
            import onnxruntime_extensions as ortx

            from passes.prepost import _prepost_steps as steps
        except ImportError as exc:
            raise PrepostDependencyError(
                f"the prepost pass needs {REQUIRES} (pip install {REQUIRES}): {exc}", pass_name=self.name
            ) from exc

        proto = ir.serde.serialize_model(model)
        inputs = graph_inputs(proto)
        outputs = [o.name for o in proto.graph.output]
        if options.output is not None:
            if options.output not in outputs:
                raise fail("PREPOST_MODEL_UNSUPPORTED", f"output {options.output!r} is not a model output ({outputs})")
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
            plan = ImagePlan(pre, inputs)
            pre_steps, raw_input = (
                plan.steps(steps.ort_steps()),
                onnx.helper.make_tensor_value_info("image", onnx.TensorProto.UINT8, ["num_bytes"]),
            )
            notes["pre"] = {"kind": "image", "input": plan.input_name, "layout": plan.layout, "size": plan.size}
            text_plan = None
        else:
            text_plan = TextPlan(
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

        chain, final_names = post_steps(options.post, steps, text_plan)
        artifact = build(proto, raw_input, pre_steps, post_steps=chain, final_names=final_names, model_outputs=outputs)
        props = {p.key: p.value for p in proto.metadata_props}
        props[META_REQUIRES] = REQUIRES
        props[META_REGISTER] = REGISTER_SNIPPET
        onnx.helper.set_model_props(artifact, props)

        with tempfile.TemporaryDirectory(prefix="prepost-") as tmp:
            original_path = Path(tmp) / "original.onnx"
            save(model, original_path)
            artifact_path = Path(tmp) / "artifact.onnx"
            onnx.save(artifact, str(artifact_path))
            runner = Runner(original_path, artifact_path, ortx.get_library_path(), ctx.target)
            if plan is not None:
                verification = plan.verify(runner, options, ctx)
            else:
                assert text_plan is not None
                verification = text_plan.verify(runner, options, ctx)
        notes.update(verification)
        notes["outputs"] = [o.name for o in artifact.graph.output]
        notes["inputs"] = [{"name": raw_input.name, "dtype": "uint8" if plan is not None else "string"}]
        change = InputChange(
            inputs=notes["inputs"],
            # The raw feeds verified here ({"image": uint8[n]} or {"text": string[1]}): the pipeline verifies and
            # times the passes after this one on them.
            verified_inputs=(plan or text_plan).inputs,  # type: ignore[union-attr]
            samples_checked=len(verification.get("samples_checked", [])),
            max_abs=verification.get("max_abs_exact"),
            max_abs_lossy=verification.get("max_abs_lossy"),
        )
        counts = {
            "pre_steps": len(pre_steps),
            "post_steps": len(chain),
            "samples_verified": sum(1 for s in verification.get("samples_checked", []) if s.get("ok")),
            "tokenizer_differences": len(verification.get("tokenizer_differences", [])),
        }
        return PassResult(ir.serde.deserialize_model(artifact), True, counts, [], notes, inputs_changed=change)


def _post_name(step: Any) -> str | dict[str, Any]:
    return step if isinstance(step, str) else step.model_dump()


# ------------------------------------------------------------------------------------------ graph build
