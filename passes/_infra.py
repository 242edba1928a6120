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

``__call__`` also refuses a result whose graph reads a value nothing defines (``passes/_dangling.py``) that
the input did not already read: a pass never hands on a dangling value.

Match before mutate: a pass decides every rewrite on an unmodified graph, records a ``NonMatch`` for each
candidate it declines (naming the node and the failed condition), and only then edits.

Everything the engine (``workers/``) knows about a pass is below: a class declaration, a base method a pass
may override, or a typed field of its ``PassResult``. The engine never asks a pass anything else, never
treats a pass by name, and never reads ``notes`` (they are for people: the report shows them verbatim).

====================================  ==========  ==================================================================
declaration                           default     what the engine does with it
====================================  ==========  ==================================================================
``name``, ``summary``                 required    catalogue, report, provenance metadata, error messages
``exact``                             True        the registry's ``safe`` preset holds exact passes only
``in_place``                          True        ``__call__`` checks the returned model's identity against it
``Options``                           no options  validated at submit time (unknown keys refused); recorded
``changes_inputs``                    False       the pass may replace the model's inputs (raw image/text in): it
                                                  runs on the raw samples ``raw_inputs()`` names, verifies itself
                                                  (``PassResult.inputs_changed``), and the job fails if it is not
                                                  applied (its client would get the old interface back)
``may_freeze_axes``                   False       the pass may make dynamic input/output axes static; the engine
                                                  generates every verification input from the model's inputs as
                                                  the pass leaves them, and accepts the axes it freezes (any other
                                                  pass that freezes one is rolled back)
``adds_files``                        ()          suffixes (replacing ``.onnx``) of the files the pass may put in
                                                  ``ctx.side_files``; the engine writes them beside every stage and
                                                  the artifact. ``__call__`` refuses a file not declared here
``raw_inputs()``                      {}          ``changes_inputs`` passes: the new inputs, name -> dtype kind; the
                                                  engine reads the user's samples.npz as such raw samples
``confine_paths(root)``               no-op       called by the service before any pass runs: file options must
                                                  resolve inside ``root`` (the job's upload), else raise
``PassResult.valid_positions``        {}          output -> the input marking where it is defined; verification of
                                                  this and every later stage compares those positions only
``PassResult.verify_with_side_file``  None        a suffix in ``adds_files``: verification of this and every later
                                                  stage loads that side file into the session (an adapter)
``PassResult.verify_inputs``          {}          set name -> feeds the job's own input sets do not reach and the
                                                  rewrite depends on (fuse_gqa: a cache at a sliding window's edge);
                                                  the engine runs the original on them and verifies this and every
                                                  later stage on them too (a set the original refuses is dropped);
                                                  after an input change, on the new model fed by input name where
                                                  it takes no input the set lacks; each is in the report's
                                                  ``input_sets`` (origin ``pass``), kept or dropped and why
``PassResult.inputs_changed``         None        ``changes_inputs`` passes: an ``InputChange`` saying how the pass
                                                  verified itself; the engine accepts the stage on it, then
                                                  verifies and times later passes against this stage on its
                                                  ``verified_inputs`` (or the user's raw samples)
``PassContext.measure``               None        set by the engine: times two sessions interleaved and gives the
                                                  noise-aware verdict (``Measure``); passes never import workers
``PassContext.references``            empty       set by the engine while the model a pass gets computes what the
                                                  upload computes (every pass before it exact, no input change,
                                                  side file or valid positions): the upload's outputs on each of
                                                  ``samples`` (ORT, optimizations off), named by
                                                  ``reference_names``; a pass checking its candidates against its
                                                  input may check them against these instead of running it
====================================  ==========  ==================================================================
"""

from __future__ import annotations

import abc
import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar, get_args, get_origin

import numpy as np
import onnx_ir as ir
from pydantic import BaseModel, ConfigDict, ValidationError

from core.config import Tolerance
from core.errors import InvalidPassOptionsError, PassError
from core.verdict import Verdict
from passes._dangling import dangling_values

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


@dataclasses.dataclass(frozen=True)
class InputChange:
    """How a ``changes_inputs`` pass verified the model it made, whose inputs are not the original's.

    The engine's generic check feeds the old and the new model the same tensors, which cannot work here, so
    the pass compares its artifact (fed raw input) with the original (fed the reference pre-processing of the
    same input) itself, and raises when they differ."""

    inputs: list[dict[str, str]]  # the new graph inputs: {"name": ..., "dtype": ...}
    # The raw feeds the pass verified on; the engine verifies and times the passes after this one on them.
    verified_inputs: list[dict[str, np.ndarray]]
    samples_checked: int
    max_abs: float | None = None  # worst absolute error where the comparison is exact up to rounding
    max_abs_lossy: float | None = None  # worst where a resize or a lossy decoder legitimately differs


@dataclasses.dataclass
class PassResult:
    model: ir.Model
    modified: bool
    # What the pass did, by kind, e.g. {"nodes_removed": 3} or {"slices_moved": 2}. Numbers only.
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    non_matches: list[NonMatch] = dataclasses.field(default_factory=list)
    # Facts and decisions worth showing a person, e.g. {"label_density": 0.15, "decision": "applied"}. The
    # engine never reads them: what it acts on is in the typed fields below.
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Outputs left undefined at some positions -> where they are defined, e.g.
    # {"last_hidden_state": {"mask_input": "attention_mask", "axes": [0, 1]}} (padding_elimination).
    valid_positions: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # A suffix from the pass's ``adds_files`` whose file verification must load (extract_adapters' adapter).
    verify_with_side_file: str | None = None
    inputs_changed: InputChange | None = None  # only from a pass that declares ``changes_inputs``
    # More verification input sets, by name, each feeds by graph-input name (module docstring).
    verify_inputs: dict[str, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)


class Measure(Protocol):
    """Latency measurement, a service of the engine (``workers/measurement.py``) offered through the context.

    Times ``model_b`` against ``model_a`` interleaved in one process (each with its session recipe, as
    ``core.recipe`` applies it) on ``feeds``, ``runs`` paired runs per feed, and returns the pooled
    noise-aware verdict of ``core.verdict``: ``faster`` and ``slower`` mean beyond noise."""

    def __call__(
        self,
        model_a: Path,
        model_b: Path,
        feeds: Sequence[Mapping[str, np.ndarray]],
        *,
        runs: int,
        recipe_a: Mapping[str, Any] | None = None,
        recipe_b: Mapping[str, Any] | None = None,
    ) -> Verdict: ...


@dataclasses.dataclass
class PassContext:
    """What a pass may know besides the graph. Everything is optional: passes must cope without it."""

    target: Target = "cpu"
    # Representative inputs by graph-input name: the user's samples.npz, else the verification inputs.
    samples: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    constant_fold_max_bytes: int = 1 << 20
    # Files a pass produces besides the model, by the suffix that replaces ``.onnx`` in the model's file name
    # (extract_adapters: {".onnx_adapter": bytes}); a pass declares the suffixes in ``adds_files``. The
    # engine writes them next to every stage and the artifact (model.onnx_adapter) and the service zips them
    # with it. Bytes, not paths: nothing to clean up.
    side_files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    # The engine's latency measurement; None outside the engine (a pass that needs it then declines).
    measure: Measure | None = None
    # The upload's outputs on ``samples`` (one list per sample, in ``reference_names`` order), given only while
    # the model a pass gets computes what the upload computes (module docstring's table); empty otherwise.
    references: list[Sequence[np.ndarray]] = dataclasses.field(default_factory=list)
    reference_names: list[str] = dataclasses.field(default_factory=list)
    # The job's verification tolerance: the engine holds every output of a pass's result to it. A lossy pass
    # that searches for what it may change (the quantizers) holds its candidates to it too, so that what it
    # hands back is not rolled back for an output its own budget did not look at (a KV cache). None outside
    # the engine.
    tolerance: Tolerance | None = None
    # False when the samples are the engine's generated inputs (the user sent none): their token ids are uniform
    # random, no text, so a pass that judges a language model's greedy tokens draws its sequences elsewhere
    # (quantize_int4: from the original model). True outside the engine: the caller's samples are taken as data.
    samples_are_data: bool = True


OptionsT = TypeVar("OptionsT", bound=PassOptions)


class Pass(abc.ABC, Generic[OptionsT]):
    """Base class of every onnxforge pass. Subclasses set the class variables and implement ``call``.

    The class variables and the two no-op methods are the pass's declarations to the engine (the table in
    the module docstring). ``class X(Pass[XOptions])`` declares ``Options = XOptions`` and types
    ``self.options`` as ``XOptions`` in one place; a plain ``Pass`` subclass may still set ``Options``."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for the catalogue
    # True when the rewrite computes the same function up to float rounding; the `safe` preset holds only
    # exact passes. Quantization and float16 are not exact.
    exact: ClassVar[bool] = True
    in_place: ClassVar[bool] = True
    Options: ClassVar[type[PassOptions]] = PassOptions
    changes_inputs: ClassVar[bool] = False
    may_freeze_axes: ClassVar[bool] = False
    adds_files: ClassVar[tuple[str, ...]] = ()
    options: OptionsT

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Only this class's own bases: a subclass of a concrete pass inherits its parent's Options as is.
        for base in cls.__dict__.get("__orig_bases__", ()):
            if get_origin(base) is Pass:
                (options_type,) = get_args(base)
                if not (isinstance(options_type, type) and issubclass(options_type, PassOptions)):
                    raise TypeError(f"{cls.__name__}: Pass[...] takes a PassOptions subclass, not {options_type!r}")
                if "Options" in cls.__dict__ and cls.__dict__["Options"] is not options_type:
                    raise TypeError(f"{cls.__name__}: Options differs from the Pass[...] type argument")
                cls.Options = options_type

    def __init__(self, options: PassOptions | dict[str, Any] | None = None) -> None:
        self.options = self.parse_options(options)

    @classmethod
    def parse_options(cls, options: PassOptions | dict[str, Any] | None) -> OptionsT:
        if isinstance(options, cls.Options):
            return options  # type: ignore[return-value]  # cls.Options is OptionsT for a Pass[OptionsT]
        if isinstance(options, PassOptions):
            raise InvalidPassOptionsError(
                f"options of type {type(options).__name__} given to pass {cls.name}", pass_name=cls.name
            )
        try:
            return cls.Options.model_validate(options or {})  # type: ignore[return-value]  # as above
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

    def raw_inputs(self) -> dict[str, str]:
        """A ``changes_inputs`` pass's new inputs: name -> numpy dtype kind ("uint8", "string")."""
        return {}

    def confine_paths(self, root: Path) -> None:
        """Resolve file options inside ``root`` (the service's job input dir), or raise. The CLI never calls
        this: a local path is the user's own."""
        del root  # a pass without file options has nothing to confine

    @abc.abstractmethod
    def call(self, model: ir.Model, ctx: PassContext) -> PassResult: ...

    def __call__(self, model: ir.Model, ctx: PassContext | None = None) -> PassResult:
        ctx = ctx or PassContext()
        files_before = set(ctx.side_files)
        # Read before the call: an in-place pass mutates the model. A graph that came in broken is not its doing.
        dangling_before = set(dangling_values(model.graph))
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
        undeclared = sorted(set(ctx.side_files) - files_before - set(self.adds_files))
        if undeclared:
            raise PassError(f"added side files {undeclared} it does not declare in adds_files", pass_name=self.name)
        if result.verify_with_side_file is not None and result.verify_with_side_file not in self.adds_files:
            raise PassError(
                f"asks verification to load {result.verify_with_side_file!r}, which is not in its adds_files",
                pass_name=self.name,
            )
        if result.inputs_changed is not None and not self.changes_inputs:
            raise PassError("changed the model's inputs without declaring changes_inputs", pass_name=self.name)
        # A value nothing defines surfaces much later (ORT refuses the stage, or a later pass reads a stale
        # constant); refused here, the failure names the pass that lost it.
        lost = [d for d in dangling_values(result.model.graph) if d not in dangling_before]
        if lost:
            shown = "; ".join(lost[:3]) + (f" (+{len(lost) - 3} more)" if len(lost) > 3 else "")
            raise PassError(f"handed on a graph with values nothing defines: {shown}", pass_name=self.name)
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
