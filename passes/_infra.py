"""The pass contract: options, results, context and the base class every pass derives from.

Modelled on onnx-ir's ``onnx_ir.passes`` (``PassBase``, ``PassResult``, in-place vs functional) with three
additions the ledger needs: a typed options model that refuses unknown keys (Olive ignores them), the reason
for every non-match (ORT's fusions return silently), and a context carrying sample inputs and the target,
so that input-dependent passes (label and padding sparsity) can decide whether they pay.

A pass writes only ``call(model, ctx) -> PassResult``. ``__call__`` enforces the contract:

=================  =====================================  ============================================
declared            what ``call`` must return               typical use
=================  =====================================  ============================================
in_place=True       the same ``ir.Model`` object, mutated   graph rewrites (cheap, no copy)
in_place=False      a new ``ir.Model``; input untouched    passes that round-trip through other tools
=================  =====================================  ============================================

Match before mutate: a pass decides every rewrite on an unmodified graph, records a ``NonMatch`` for each
candidate it declines (naming the node and the failed condition), and only then edits.
"""

from __future__ import annotations

import abc
import dataclasses
from collections import Counter
from typing import Any, ClassVar, Literal

import numpy as np
import onnx_ir as ir
from pydantic import BaseModel, ConfigDict, ValidationError

from core.errors import InvalidPassOptionsError, PassError

Target = Literal["cpu", "cuda", "tensorrt"]


class PassOptions(BaseModel):
    """Base of every pass's options. Unknown keys are an error, never ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclasses.dataclass(frozen=True)
class NonMatch:
    """A candidate the pass looked at and declined, and why. Goes into the report verbatim."""

    reason: str
    node: str | None = None
    op_type: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "op_type": self.op_type, "reason": self.reason}


@dataclasses.dataclass
class PassResult:
    model: ir.Model
    modified: bool
    # What the pass did, by kind, e.g. {"nodes_removed": 3} or {"slices_moved": 2}. Numbers only.
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    non_matches: list[NonMatch] = dataclasses.field(default_factory=list)
    # Facts and decisions worth showing a person, e.g. {"label_density": 0.15, "decision": "applied"}.
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PassContext:
    """What a pass may know besides the graph. Everything is optional: passes must cope without it."""

    target: Target = "cpu"
    # Representative inputs by graph-input name: the user's samples.npz, else the verification inputs.
    samples: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    constant_fold_max_bytes: int = 1 << 20
    # Files a pass produces besides the model, by the suffix that replaces ``.onnx`` in the model's file name
    # (extract_adapters: {".onnx_adapter": bytes}). The pipeline writes them next to every stage and the
    # artifact (model.onnx_adapter) and the service zips them with it. Bytes, not paths: nothing to clean up.
    side_files: dict[str, bytes] = dataclasses.field(default_factory=dict)


class Pass(abc.ABC):
    """Base class of every onnxforge pass. Subclasses set the class variables and implement ``call``."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for the catalogue
    # True when the rewrite computes the same function up to float rounding; the `safe` preset holds only
    # exact passes. Quantization and float16 are not exact.
    exact: ClassVar[bool] = True
    in_place: ClassVar[bool] = True
    Options: ClassVar[type[PassOptions]] = PassOptions

    def __init__(self, options: PassOptions | dict[str, Any] | None = None) -> None:
        self.options = self.parse_options(options)

    @classmethod
    def parse_options(cls, options: PassOptions | dict[str, Any] | None) -> PassOptions:
        if isinstance(options, cls.Options):
            return options
        if isinstance(options, PassOptions):
            raise InvalidPassOptionsError(
                f"options of type {type(options).__name__} given to pass {cls.name}", pass_name=cls.name
            )
        try:
            return cls.Options.model_validate(options or {})
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(options)'}: {err['msg']}" for err in exc.errors()
            )
            raise InvalidPassOptionsError(
                f"invalid options for pass {cls.name}: {problems}",
                pass_name=cls.name,
                detail={"errors": [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()]},
            ) from exc

    @classmethod
    def options_schema(cls) -> dict[str, Any]:
        return cls.Options.model_json_schema()

    @abc.abstractmethod
    def call(self, model: ir.Model, ctx: PassContext) -> PassResult: ...

    def __call__(self, model: ir.Model, ctx: PassContext | None = None) -> PassResult:
        ctx = ctx or PassContext()
        try:
            result = self.call(model, ctx)
        except PassError:
            raise
        except Exception as exc:  # a pass bug must name the pass, never crash the pipeline anonymously
            raise PassError(f"{type(exc).__name__}: {exc}", pass_name=self.name) from exc
        if not isinstance(result, PassResult):
            raise PassError(f"returned {type(result).__name__}, not PassResult", pass_name=self.name)
        if self.in_place and result.model is not model:
            raise PassError("declared in-place but returned a different model", pass_name=self.name)
        if not self.in_place and result.model is model:
            raise PassError("declared functional but returned its input model", pass_name=self.name)
        return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"


def op_histogram(model: ir.Model) -> Counter[str]:
    """Count of nodes by op type (``domain::Op`` outside the default domain), subgraphs included."""
    counts: Counter[str] = Counter()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        counts[key] += 1
    return counts


def node_count(model: ir.Model) -> int:
    return sum(op_histogram(model).values())
