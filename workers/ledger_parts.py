"""The ledger's parts: what a ledger is set up with and hands back, per-pass timings, record summaries, the axis
check, bisection, which passes may be grouped, and the fingerprint that tells, without serialising a large
model, whether a pass changed anything.

Kept apart from ``workers/ledger.py`` so that the ledger reads as its loop; nothing here keeps state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from core.config import Tolerance
from core.inputs import InputSet
from core.recipe import read_recipe
from passes._infra import Pass
from workers import artifacts
from workers.benchmark import BenchmarkParams, Comparison, SessionPool, compare
from workers.report import PassRecord
from workers.verify import VerificationResult, Verifier

ProgressFn = Callable[[str, float], None]


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every ledger of a job shares (preset auto runs one ledger per candidate)."""

    source: Path  # the upload: the first accepted stage
    input_sets: list[InputSet]  # the verification and timing inputs of the original
    raw_sets: list[InputSet] | None  # the user's raw samples, for a changes_inputs pass
    verifier: Verifier  # reference outputs of the original on input_sets
    tolerance: Tolerance
    target: str
    intra_op_threads: int
    constant_fold_max_bytes: int
    quick: BenchmarkParams  # the per-pass timing
    rollback_slower: bool
    dynamic_axes: dict[str, set[int]]  # of the upload: no pass but a may_freeze_axes one may freeze them
    # The upload's latency, when known before the passes; None: the pipeline times the upload once, in the gate
    # (or alone after it), and fills it in on the records then (``Ledger.fill_baseline``).
    baseline_p50: float | None
    provenance: artifacts.Provenance
    progress: ProgressFn
    pool: SessionPool = dataclasses.field(default_factory=SessionPool)  # the job's warm benchmark sessions
    # Every set a pass declared (``PassResult.verify_inputs``) and every copy of one carried over an input change,
    # with its provenance: the report's ``input_sets`` list them. Shared by the job's ledgers, as the verifier
    # they are added to is (a set one candidate of preset auto declared verifies the later ones too).
    pass_sets: list[InputSet] = dataclasses.field(default_factory=list)
    group_passes: bool = True  # verify and time runs of groupable passes together (module docstring)
    # One row at a serving length (``core.inputs.serving_input_set``), for a gate that ties on the generated
    # sets; None when the sets came from the user or the model has no token sequence to lengthen.
    serving_set: InputSet | None = None

    @property
    def confirm(self) -> BenchmarkParams:
        """A second, three times longer quick measurement that confirms a slowdown before blaming a pass."""
        runs = 3 * self.quick.max_runs
        return dataclasses.replace(self.quick, min_runs=runs, max_runs=runs)


@dataclasses.dataclass(frozen=True)
class Rebase:
    """A pass replaced the model's inputs: its stage is the reference of what follows, fed raw inputs."""

    pass_name: str
    kept: int  # how many passes were applied before it
    reference: Path  # a copy of its stage (and side files): verification and the gate measure against it
    p50_ms: float  # its latency on raw input: the baseline of what follows


@dataclasses.dataclass
class Outcome:
    """A ledger's artifact candidate: the last stage with provenance, its verification, any bisection."""

    artifact: Path
    verification: VerificationResult
    bisection: dict[str, Any] | None


def quick_compare(setup: Setup, input_sets: list[InputSet], accepted: Path, path: Path) -> Comparison:
    """The quick interleaved A/B of a verified candidate against the accepted stage, on the pooled sessions."""
    recipes = {"recipe_a": read_recipe(accepted), "recipe_b": read_recipe(path)}
    comparison = compare(accepted, path, input_sets, setup.quick, mode="quick", pool=setup.pool, **recipes)
    if comparison.slower:
        # Confirm before blaming: a second, three times longer interleaved measurement decides.
        comparison = compare(
            accepted, path, input_sets, setup.confirm, mode="quick-confirm", pool=setup.pool, **recipes
        )
    return comparison


@dataclasses.dataclass
class Member:
    """A pass of the pending group: run in memory, not yet verified nor timed."""

    index: int
    p: Pass
    record: PassRecord
    timing: PassTiming


def groupable(p: Pass) -> bool:
    """Whether a pass may be verified and timed together with its neighbours: declared exact, and touching
    nothing but the graph (no side file, no input change, no frozen axis, each of which has its own check)."""
    return p.exact and not (p.changes_inputs or p.may_freeze_axes or p.adds_files)


def speed(comparison: Comparison) -> str:
    speed = (
        f"p50 {comparison.p50_a_ms:.4g} -> {comparison.p50_b_ms:.4g} ms "
        f"(speedup {comparison.speedup:.3f}, paired ratio {comparison.pooled.ratio:.3f}, "
        f"noise margin {comparison.pooled.margin:.1%})"
    )
    clearly = [sh.input_set for sh in comparison.shapes if sh.clearly_slower]
    return speed + (f"; clearly slower on {', '.join(clearly)}" if clearly else "")


def applied_reason(comparison: Comparison | None, names: Sequence[str]) -> str:
    """``comparison`` None: the gate times this group (``Ledger.run(gate_times_last=True)``)."""
    group = f"; verified and timed as one group ({' + '.join(names)})" if len(names) > 1 else ""
    if comparison is None:
        return f"verified within tolerance; timed by the regression gate, against the upload{group}"
    kept = "; slower beyond noise but kept (rollback_slower is off)" if comparison.slower else ""
    return f"verified within tolerance; {speed(comparison)}{group}{kept}"


@dataclasses.dataclass
class PassTiming:
    """Where one pass's time went (the report's ``timings.passes[]``); a step that did not run stays 0."""

    name: str
    load_s: float = 0.0  # the accepted stage read back from disk for the pass to work on
    transform_s: float = 0.0  # the pass itself
    write_s: float = 0.0  # its model written, compared with the accepted stage, checked (onnx.checker, axes)
    verify_s: float = 0.0  # against the reference outputs
    benchmark_s: float = 0.0  # the quick interleaved A/B (and its confirmation)
    total_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@contextlib.contextmanager
def timed(timing: PassTiming, step: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        setattr(timing, step, getattr(timing, step) + time.perf_counter() - started)


def bisect_first_failing(count: int, fails: Callable[[int], bool]) -> int:
    """Index of the first pass whose prefix fails: the smallest k with ``fails(k)`` (prefix of k passes),
    minus one. Assumes ``fails(0)`` is False (the original) and ``fails(count)`` is True."""
    lo, hi = 0, count
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fails(mid):
            hi = mid
        else:
            lo = mid
    return hi - 1


def histogram_delta(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    return {
        op: after.get(op, 0) - before.get(op, 0)
        for op in sorted(set(before) | set(after))
        if after.get(op, 0) != before.get(op, 0)
    }


def why_nothing(non_matches: Sequence[Any]) -> str:
    if not non_matches:
        return "did nothing because it found no candidate in the graph"
    reasons = [f"{m.reason}" + (f" ({m.node})" if m.node else "") for m in non_matches[:3]]
    more = f" (+{len(non_matches) - 3} more)" if len(non_matches) > 3 else ""
    return "did nothing because " + "; ".join(reasons) + more


def latency_summary(comparison: Comparison, group: Sequence[str]) -> dict[str, Any]:
    """The record's ``latency``; ``group``: the passes timed together in this one comparison."""
    return {
        "p50_ms_before": comparison.p50_a_ms,
        "p50_ms_after": comparison.p50_b_ms,
        "speedup": comparison.speedup,
        "slower": comparison.slower,
        "margin": comparison.pooled.margin,
        "confirmed": comparison.mode == "quick-confirm",
        "noisy": any(s.a.noisy or s.b.noisy for s in comparison.shapes),
        "runs": min(s.a.runs for s in comparison.shapes),  # timing stops once the answer is settled
        "input_sets_clearly_slower": [sh.input_set for sh in comparison.shapes if sh.clearly_slower],
        "group": list(group),
    }


def lost_axes(expected: dict[str, set[int]], model: ir.Model) -> list[str]:
    """``artifacts.lost_axes`` of the model just written, read from memory: only its inputs and outputs are
    serialized, where reading the file back would parse every weight."""
    graph = model.graph
    io = onnx.ModelProto()
    io.graph.input.extend(ir.serde.serialize_value(v) for v in graph.inputs if v.name not in graph.initializers)
    io.graph.output.extend(ir.serde.serialize_value(v) for v in graph.outputs)
    now = artifacts.proto_dynamic_axes(io)
    return [
        f"{key} axis {axis}" for key, axes in sorted(expected.items()) for axis in sorted(axes - now.get(key, set()))
    ]


def pass_sets(
    declared: dict[str, dict[str, Any]], pass_name: str, reference: str, verifier: Verifier
) -> list[InputSet]:
    """A pass's ``verify_inputs`` as input sets whose provenance says, for the report's ``input_sets``, who
    asked for them and why, what computed their expected outputs (``reference``), and whether it ran them
    (``accepted``; ``error`` when not: the set is dropped, as no output is defined there). The reference's
    outputs are computed here (``Verifier.add_sets``)."""
    why = (
        f"declared by {pass_name} (PassResult.verify_inputs): inputs the job's own sets do not reach and its "
        "rewrite depends on (the set's name says which); this stage and every later one are verified on them"
    )
    taken = {s.name: s for s in verifier.input_sets}
    sets, mine = [], []
    for name, feeds in declared.items():
        provenance = {"source": "pass", "pass": pass_name, "why": why, "reference": reference}
        holder = taken.get(name)
        if holder is not None and holder.provenance.get("pass") != pass_name:
            # The verifier holds sets by name: another set of this name would never be run.
            owner = holder.provenance.get("pass")
            error = f"not run: the name is taken by {f'a set {owner} declared' if owner else 'a set of the job'}"
            sets.append(InputSet(name, feeds, {**provenance, "accepted": False, "error": error}))
            continue
        mine.append(InputSet(name, feeds, provenance))
    _add_marked(verifier, mine)
    return [*sets, *mine]


def _add_marked(verifier: Verifier, sets: list[InputSet]) -> dict[str, str]:
    """``Verifier.add_sets``, each set's provenance marked ``accepted`` (with the ``error`` where its reference
    refused it); returns the refused, name -> error."""
    refused = verifier.add_sets(sets)
    for s in sets:
        s.provenance["accepted"] = s.name not in refused
        if s.name in refused:
            s.provenance["error"] = refused[s.name]
    return refused


def carry_sets(met: Sequence[InputSet], by: str, verifier: Verifier) -> dict[str, tuple[InputSet | None, str]]:
    """Carry the pass-declared sets ``met`` over the input change ``by`` made to ``verifier``'s reference (the
    model after it): each set fed by the names that reference still takes, its outputs computed there. The
    job's own sets give way to the change's raw inputs, which a pass's tensors have no counterpart in; a set
    survives only where the new reference names no input the set lacks and runs it. Returns, per set name, the
    carried copy (None: dropped) and why."""
    names, done = verifier.input_names, {}
    copies = []
    for s in met:
        missing = [n for n in names if n not in s.feeds]
        if missing:
            done[s.name] = (
                None,
                f"dropped: the model after {by} takes {', '.join(missing)}, which this set has no value for (an "
                "input change cannot be undone on a set's tensors)",
            )
            continue
        left = [n for n in s.feeds if n not in names]
        copy = InputSet(
            f"{s.name} (after {by})",
            {n: s.feeds[n] for n in names},
            {
                **{k: v for k, v in s.provenance.items() if k not in ("accepted", "error", "after_input_change")},
                "reference": f"the model after {by}",
                "carried_from": s.name,
            },
        )
        copies.append(copy)
        without = f", without {', '.join(left)} (no longer inputs)" if left else ""
        fed = f"fed by input name{without}"
        done[s.name] = (copy, f"carried: {fed}, its outputs computed by the model after {by}")
    refused = _add_marked(verifier, copies)
    for copy in copies:
        if copy.name in refused:
            done[copy.provenance["carried_from"]] = (
                None,
                f"dropped: the model after {by} refuses it: {refused[copy.name]}",
            )
    return done


def remove_stage(path: Path, side: dict[str, bytes]) -> None:
    for stale in (path, path.with_name(path.name + ".data"), *(path.with_suffix(sfx) for sfx in side)):
        stale.unlink(missing_ok=True)


def axis_freezers() -> str:
    """The passes that declare ``may_freeze_axes``, for the reason given to a pass that froze one anyway."""
    from passes import registry  # deferred for start-up cost: the registry imports every pass module

    return ", ".join(sorted(cls.name for cls in registry.PASSES if cls.may_freeze_axes)) or "no pass"


def _value_key(value: ir.Value | None) -> str:
    if value is None:
        return "-"
    return f"{value.name}|{value.type}|{value.shape}|{value.doc_string}|{sorted(value.metadata_props.items())}"


def _attribute_key(attr: Any) -> str:
    value = attr.value
    if isinstance(value, ir.TensorProtocol):
        return f"{attr.name}:tensor@{id(value)}"  # the same object, not the same values: see fingerprint
    if isinstance(value, ir.Graph):
        return f"{attr.name}:graph@{id(value)}"  # its nodes are walked with the other graphs
    if isinstance(value, Sequence) and value and isinstance(value[0], ir.Graph):
        return f"{attr.name}:graphs@{[id(g) for g in value]}"
    return f"{attr.name}:{attr.type}:{value!r}"


def _nodes_key(digest: Any, nodes: Any) -> None:
    for node in nodes:
        attrs = ",".join(_attribute_key(a) for a in node.attributes.values())
        digest.update(
            f"N{node.domain}|{node.op_type}|{node.overload}|{node.name}|{node.doc_string}|"
            f"{sorted(node.metadata_props.items())}|{[v.name if v is not None else '-' for v in node.inputs]}|"
            f"{[_value_key(v) for v in node.outputs]}|{attrs}\n".encode()
        )


def fingerprint(model: ir.Model) -> str:
    """A digest of everything a pass may change in ``model`` except tensor bytes: model and graph fields, every
    node (op, attributes, inputs, outputs with their types and shapes), graph inputs and outputs, and which
    tensor object each initializer holds. O(nodes), where writing the model would copy every weight.

    Equal fingerprints mean the same model (a tensor is compared by identity: a pass that puts a new tensor
    in place of an equal one counts as a change, the safe side). The ledger uses it to tell, inside a group
    of passes run in memory, a pass that changed nothing from one that did."""
    digest = hashlib.sha256()
    digest.update(
        f"M{model.ir_version}|{model.producer_name}|{model.producer_version}|{model.domain}|"
        f"{model.model_version}|{model.doc_string}|{sorted(model.metadata_props.items())}|"
        f"{sorted(model.opset_imports.items())}\n".encode()
    )
    for graph in model.graphs():
        digest.update(
            f"G{graph.name}|{graph.doc_string}|{sorted(graph.metadata_props.items())}|"
            f"{[_value_key(v) for v in graph.inputs]}|{[_value_key(v) for v in graph.outputs]}\n".encode()
        )
        for name, value in graph.initializers.items():
            digest.update(f"I{name}|{_value_key(value)}|{id(value.const_value)}\n".encode())
        _nodes_key(digest, graph)
    for function in model.functions.values():
        digest.update(f"F{function.identifier()}|{[v.name for v in function.inputs]}|{function.outputs}\n".encode())
        _nodes_key(digest, function)
    return digest.hexdigest()
