"""The prepost pass's text pre-processing: the tokenizer op from the Hugging Face tokenizer, and the check
of the artifact's ids against the tokenizer's on the user's and built-in sentences."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from passes._infra import PassContext
from passes.prepost._prepost_check import Runner, apply_post, compare
from passes.prepost._prepost_options import (
    PASS_NAME,
    PrepostDependencyError,
    PrepostOptions,
    PrepostVerificationError,
    TextPre,
    fail,
)

CUSTOM_DOMAINS = ("ai.onnx.contrib", "com.microsoft.extensions")
ID_ROLES = ("input_ids", "attention_mask", "token_type_ids")

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


class TextPlan:
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
        unknown = sorted(set(inputs) - set(ID_ROLES))
        if unknown or "input_ids" not in inputs:
            raise fail(
                "PREPOST_MODEL_UNSUPPORTED",
                f"text pre-processing feeds input_ids, attention_mask and token_type_ids; the model's inputs are "
                f"{sorted(inputs)}" + (f" ({unknown} cannot be fed)" if unknown else " (no input_ids)"),
            )
        self.roles = list(inputs)  # model input order: the processor joins by position
        self.dtypes = {r: inputs[r].type.tensor_type.elem_type for r in self.roles}
        for role, elem in self.dtypes.items():
            if elem not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
                raise fail("PREPOST_MODEL_UNSUPPORTED", f"input {role!r} must be int64 or int32")
        self.outputs = list(self.roles)
        if needs_mask and "attention_mask" not in self.outputs:
            self.outputs.append("attention_mask")
            self.dtypes["attention_mask"] = onnx.TensorProto.INT64
        self.tokenizer = load_tokenizer(directory, shown=pre.tokenizer)
        self.tokenizer_class = type(self.tokenizer).__name__
        self.max_length = pre.max_length or default_max_length(directory, self.tokenizer)
        try:
            from onnxruntime_extensions import gen_processing_models

            self.tokenizer_model, _ = gen_processing_models(self.tokenizer, pre_kwargs={})
        except Exception as exc:
            raise fail(
                "PREPOST_TOKENIZER_UNSUPPORTED",
                f"onnxruntime-extensions cannot convert {self.tokenizer_class}: {type(exc).__name__}: {exc}",
            ) from exc
        self.op_type = next((n.op_type for n in self.tokenizer_model.graph.node if n.domain), None)
        self.step = steps.TextTokenizer(self.tokenizer_model, self.outputs, self.dtypes, self.max_length)
        self._steps = steps

    def graph_ids(self, runner: Runner) -> Any:
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

    def verify(self, runner: Runner, options: PrepostOptions, ctx: PassContext) -> dict[str, Any]:
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
            expected = apply_post(options.post, values, chosen, feeds.get("attention_mask"))
            if not options.post:
                expected = [values[runner.original_outputs.index(n)] for n in runner.artifact_outputs]
            checked.append(
                {"sample": sentence, "source": source, "plain_english": plain, "tolerance": options.atol}
                | compare(expected, got, options.atol, exact=True)
            )
        own = [d for d in differences if d["source"] == "sample"]
        if own:
            raise fail(
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
                pass_name=PASS_NAME,
                detail={"samples_checked": checked, "tokenizer_differences": differences},
            )
        return {
            "samples_checked": checked,
            "samples_origin": "samples+builtin" if user else "builtin",
            "max_abs_exact": max((c["max_abs"] for c in checked), default=None),
            "tokenizer_differences": differences,
            "tokenizer_differences_plain_english": sum(1 for d in differences if d["plain_english"]),
        }


def load_tokenizer(directory: Path, shown: str) -> Any:
    """The Hugging Face tokenizer in ``directory``; messages name it as the user did (``shown``), never by
    the server's path."""
    if not directory.is_dir():
        raise fail("PREPOST_TOKENIZER_INVALID", f"tokenizer {shown[:200]!r} is not a directory")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise PrepostDependencyError(
            f"text pre-processing needs transformers (the tokenizer itself is the reference): {exc}",
            pass_name=PASS_NAME,
        ) from exc
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        raise fail(
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


def default_max_length(directory: Path, tokenizer: Any) -> int | None:
    config = directory / "sentence_bert_config.json"
    if config.is_file():
        with contextlib.suppress(ValueError, OSError, TypeError):
            value = json.loads(config.read_text()).get("max_seq_length")
            if isinstance(value, int) and value >= 2:
                return value
    value = getattr(tokenizer, "model_max_length", None)
    return int(value) if isinstance(value, int) and 2 <= value <= 1_000_000 else None
