"""The per-pass ledger: run each pass on the last accepted stage, verify it, time it, keep it or roll it back.

::

    for each pass, on a copy of the last accepted stage (a file, so rollback = reload):
      run ─> PassError? ─────────────────────────────────────> failed (rolled back, error recorded)
          ─> not modified? ──────────────────────────────────> no_change ("did nothing because ...")
          ─> written: the same bytes as the accepted stage? ─> no_change (neither verified nor timed)
          ─> onnx.checker ─ fails ───────────────────────────> rolled_back
          ─> inputs_changed (a changes_inputs pass)? ────────> applied on its own verification; its stage
                                                                becomes the reference of what follows (rebase)
          ─> froze a dynamic axis and not may_freeze_axes ──> rolled_back
          ─> verify vs the reference ─ out of tolerance ────> rolled_back (which output, how far off)
          ─> quick interleaved latency ─ slower beyond noise and rollback_slower ─> rolled_back
          ─> applied: this stage becomes the last accepted one
    finalize: the last stage + provenance, verified; if out of tolerance (an interaction of passes each
    verified alone), bisect the applied passes to name the first culprit, drop it, replay, re-check.

Everything the ledger knows about a pass comes from the pass contract (``passes/_infra.py``): its class
declarations and the typed fields of its ``PassResult``; never its name, never its notes.

Job time: benchmark sessions come from the job's ``SessionPool`` (``Setup.pool``), so the original's is built
once and the stage a pass was accepted as is timed as the next pass's A without a rebuild; the ledger keeps
only the original, the accepted stage and (after an input change) its reference alive. Each pass's time is
split in ``timings`` (load, transform, write and check, verify, benchmark) for the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from core.config import Tolerance
from core.errors import PassError, VerificationError
from core.inputs import InputSet
from core.recipe import read_recipe
from passes._infra import Pass, PassContext, PassResult, op_histogram
from workers import artifacts
from workers.benchmark import BenchmarkParams, Comparison, SessionPool, compare, measure
from workers.measurement import BenchmarkMeasure
from workers.model_check import check_model
from workers.report import PassRecord
from workers.verify import VerificationResult, Verifier, same_bytes

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
    baseline_p50: float  # the upload's quick latency
    provenance: artifacts.Provenance
    progress: ProgressFn
    pool: SessionPool = dataclasses.field(default_factory=SessionPool)  # the job's warm benchmark sessions

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
def _timed(timing: PassTiming, step: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        setattr(timing, step, getattr(timing, step) + time.perf_counter() - started)


@dataclasses.dataclass
class Outcome:
    """A ledger's artifact candidate: the last stage with provenance, its verification, any bisection."""

    artifact: Path
    verification: VerificationResult
    bisection: dict[str, Any] | None


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


def _histogram_delta(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    return {
        op: after.get(op, 0) - before.get(op, 0)
        for op in sorted(set(before) | set(after))
        if after.get(op, 0) != before.get(op, 0)
    }


def _why_nothing(non_matches: Sequence[Any]) -> str:
    if not non_matches:
        return "did nothing because it found no candidate in the graph"
    reasons = [f"{m.reason}" + (f" ({m.node})" if m.node else "") for m in non_matches[:3]]
    more = f" (+{len(non_matches) - 3} more)" if len(non_matches) > 3 else ""
    return "did nothing because " + "; ".join(reasons) + more


def _latency_summary(comparison: Comparison) -> dict[str, Any]:
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
    }


def _lost_axes(expected: dict[str, set[int]], model: ir.Model) -> list[str]:
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


def _remove_stage(path: Path, side: dict[str, bytes]) -> None:
    for stale in (path, path.with_name(path.name + ".data"), *(path.with_suffix(sfx) for sfx in side)):
        stale.unlink(missing_ok=True)


def _axis_freezers() -> str:
    """The passes that declare ``may_freeze_axes``, for the reason given to a pass that froze one anyway."""
    from passes import registry  # deferred for start-up cost: the registry imports every pass module

    return ", ".join(sorted(cls.name for cls in registry.PASSES if cls.may_freeze_axes)) or "no pass"


class Ledger:
    """One run of passes over the upload: the records, the applied passes, and what they left behind."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.records: list[PassRecord] = []
        self.timings: list[PassTiming] = []  # one per record
        self.kept: list[tuple[int, Pass]] = []  # (index into records, pass) of applied passes
        # Outputs whose pad positions an applied pass left undefined, and the input marking the valid ones.
        self.valid_positions: dict[str, dict[str, Any]] = {}
        # Side files of the applied passes, and the one verification must load once a pass asked for it.
        self.side_files: dict[str, bytes] = {}
        self.verify_side_file: str | None = None
        self.dynamic_axes = {k: set(v) for k, v in setup.dynamic_axes.items()}
        # After a rebase, verification and timing use the rebased stage and the raw inputs.
        self.rebase: Rebase | None = None
        self.input_sets = setup.input_sets
        self.verifier = setup.verifier
        self.ctx = PassContext(
            target=setup.target,  # type: ignore[arg-type]
            samples=[s.feeds for s in setup.input_sets],
            constant_fold_max_bytes=setup.constant_fold_max_bytes,
            measure=BenchmarkMeasure(target=setup.target, intra_op_threads=setup.intra_op_threads),
        )

    @property
    def kept_passes(self) -> list[Pass]:
        return [p for _, p in self.kept]

    def check(self, path: Path, *, positions: bool = True) -> VerificationResult:
        """Verify the model at ``path`` against the current reference, with the side file passes asked for."""
        return self.verifier.check(path, self.valid_positions if positions else None, adapter=self._adapter(path))

    def _adapter(self, path: Path, suffix: str | None = None) -> Path | None:
        suffix = suffix or self.verify_side_file
        return path.with_suffix(suffix) if suffix and path.with_suffix(suffix).exists() else None

    def _references(self) -> list[Path]:
        """The models everything is measured against: the upload, or after an input change its stage."""
        return [self.setup.source, *([self.rebase.reference] if self.rebase is not None else [])]

    # The passes -----------------------------------------------------------------------------------

    def run(self, passes: Sequence[Pass], work: Path) -> Path:
        """Run every pass on a copy of the last accepted stage; return the path of the last accepted one."""
        accepted = self.setup.source
        accepted_p50 = self.setup.baseline_p50
        for index, p in enumerate(passes):
            self.setup.progress("passes", index / len(passes))
            record = PassRecord(name=p.name, options=p.options.model_dump(mode="json"))
            self.records.append(record)
            timing = PassTiming(p.name)
            self.timings.append(timing)
            started = time.perf_counter()
            try:
                candidate = self._try(index, p, record, timing, accepted, accepted_p50, work)
            finally:
                record.duration_s = timing.total_s = time.perf_counter() - started
            if candidate is None and p.changes_inputs:
                # The job asked for another interface (raw input): without this pass the upload would come back
                # with the old one, and its client would break. Fail instead (PassErrors raised above keep
                # their own codes).
                raise PassError(f"{p.name} was not applied: {record.reason}", pass_name=p.name)
            if candidate is not None:
                if accepted != self.setup.source:
                    accepted.unlink(missing_ok=True)
                    accepted.with_name(accepted.name + ".data").unlink(missing_ok=True)
                accepted = candidate
                if record.latency_ms_p50_after is not None:
                    accepted_p50 = record.latency_ms_p50_after
                self.kept.append((index, p))
            self.setup.pool.retain([*self._references(), accepted])  # a rolled-back candidate's session goes
        self.setup.progress("passes", 1.0)
        return accepted

    def _call(self, p: Pass, model: Any) -> PassResult:
        """Run ``p``; a changes_inputs pass verifies itself on the raw samples (the user's, else its own)."""
        if not p.changes_inputs:
            return p(model, self.ctx)
        samples, self.ctx.samples = self.ctx.samples, [s.feeds for s in self.setup.raw_sets or []]
        try:
            return p(model, self.ctx)
        finally:
            self.ctx.samples = samples

    def _try(  # noqa: PLR0917  (private helper; the ledger loop is its only caller)
        self,
        index: int,
        p: Pass,
        record: PassRecord,
        timing: PassTiming,
        accepted: Path,
        accepted_p50: float,
        work: Path,
    ) -> Path | None:
        with _timed(timing, "load_s"):
            model = artifacts.load_ir(accepted)
            before = op_histogram(model)
        record.nodes_before = record.nodes_after = sum(before.values())
        record.latency_ms_p50_before = accepted_p50
        self.ctx.side_files = dict(self.side_files)  # a rolled-back pass's side files never survive it
        try:
            with _timed(timing, "transform_s"):
                result = self._call(p, model)
                after = op_histogram(result.model)
        except PassError as exc:
            record.status, record.reason = "failed", f"pass raised, rolled back: {exc.message}"
            if p.changes_inputs:
                raise  # with its own code: see run
            return None
        except Exception as exc:  # a broken result (e.g. a graph op_histogram cannot walk)
            record.status, record.reason = (
                "failed",
                f"pass broke the model, rolled back: {type(exc).__name__}: {exc}",
            )
            return None
        record.modified = bool(result.modified)
        record.counts = {k: int(v) for k, v in result.counts.items()}
        record.non_matches = [m.to_dict() for m in result.non_matches]
        record.notes = dict(result.notes)
        if not result.modified:
            record.status, record.reason = "no_change", _why_nothing(result.non_matches)
            return None  # whatever it touched is discarded: the next pass reloads the accepted stage
        record.nodes_after = sum(after.values())
        record.op_histogram_delta = _histogram_delta(before, after)
        path = work / f"stage-{index:03d}.onnx"
        side = dict(self.ctx.side_files)
        verify_side_file = result.verify_with_side_file or self.verify_side_file
        with _timed(timing, "write_s"):
            try:
                artifacts.save_ir(result.model, path)
                artifacts.write_side_files(path, side)
            except Exception as exc:
                record.status, record.reason = "rolled_back", f"produced an invalid model: {type(exc).__name__}: {exc}"
                return None
            if result.inputs_changed is None and side == self.side_files and same_bytes(path, accepted):
                # It said it changed something, yet wrote the model it received: nothing to verify or time.
                record.status = "no_change"
                record.reason = "did nothing because the model it returned serializes to the bytes it received"
                record.nodes_after, record.op_histogram_delta = record.nodes_before, {}
                _remove_stage(path, side)
                return None
            try:
                check_model(path)
            except Exception as exc:
                record.status, record.reason = "rolled_back", f"produced an invalid model: {type(exc).__name__}: {exc}"
                return None
            lost = [] if result.inputs_changed is not None else _lost_axes(self.dynamic_axes, result.model)
        if result.inputs_changed is not None:
            with _timed(timing, "verify_s"):  # mostly the new reference's outputs and its latency
                return self._rebase_on(index, p, result, record, path, side, verify_side_file)
        if lost and not p.may_freeze_axes:
            record.status, record.reason = (
                "rolled_back",
                f"made dynamic axes static ({', '.join(lost[:5])}); only {_axis_freezers()} may, when the job "
                "asks for it",
            )
            return None
        positions = {**self.valid_positions, **result.valid_positions}
        with _timed(timing, "verify_s"):
            verification = self.verifier.check(path, positions, adapter=self._adapter(path, verify_side_file))
        record.verification = verification.worst()
        if not verification.ok:
            record.status, record.reason = "rolled_back", f"broke tolerance: {verification.reason}"
            return None
        with _timed(timing, "benchmark_s"):
            comparison = self._compare(accepted, path)
        record.latency = _latency_summary(comparison)
        record.latency_ms_p50_before, record.latency_ms_p50_after = comparison.p50_a_ms, comparison.p50_b_ms
        speed = (
            f"p50 {comparison.p50_a_ms:.4g} -> {comparison.p50_b_ms:.4g} ms "
            f"(speedup {comparison.speedup:.3f}, paired ratio {comparison.pooled.ratio:.3f}, "
            f"noise margin {record.latency['margin']:.1%})"
        )
        clearly = record.latency["input_sets_clearly_slower"]
        if clearly:
            speed += f"; clearly slower on {', '.join(clearly)}"
        if comparison.slower and self.setup.rollback_slower:
            record.status, record.reason = "rolled_back", f"slower beyond noise: {speed}"
            return None
        record.status = "applied"
        self.valid_positions = positions
        self.side_files, self.verify_side_file = side, verify_side_file
        if lost:  # a may_freeze_axes pass, as asked: the axes it froze are no longer expected to be dynamic
            self.dynamic_axes = artifacts.dynamic_axes(path)
        record.reason = f"verified within tolerance; {speed}" + (
            "; slower beyond noise but kept (rollback_slower is off)" if comparison.slower else ""
        )
        return path

    def _compare(self, accepted: Path, path: Path) -> Comparison:
        """The quick interleaved A/B of a verified candidate against the accepted stage, on the pooled sessions."""
        recipes = {"recipe_a": read_recipe(accepted), "recipe_b": read_recipe(path)}
        pool = self.setup.pool
        comparison = compare(accepted, path, self.input_sets, self.setup.quick, mode="quick", pool=pool, **recipes)
        if comparison.slower:
            # Confirm before blaming: a second, three times longer interleaved measurement decides.
            comparison = compare(
                accepted, path, self.input_sets, self.setup.confirm, mode="quick-confirm", pool=pool, **recipes
            )
        return comparison

    def _rebase_on(  # noqa: PLR0917  (private helper of _try)
        self,
        index: int,
        p: Pass,
        result: PassResult,
        record: PassRecord,
        path: Path,
        side: dict[str, bytes],
        verify_side_file: str | None,
    ) -> Path:
        """Accept a pass that replaced the model's inputs on its own verification, and make its stage the
        reference of what follows.

        The generic check feeds the old and the new model the same tensors, which cannot work here: the pass
        compared its raw-input model with the original fed by the reference pre-processing (tokenizer,
        Pillow + numpy) and raised if they differ. Later passes are verified against this stage, on the raw
        inputs the pass verified (or the user's raw samples), and the gate measures against it too."""
        change = result.inputs_changed
        assert change is not None
        sets = self.setup.raw_sets or [
            InputSet(f"raw {i} ({', '.join(f)})", f) for i, f in enumerate(change.verified_inputs[:8])
        ]
        if not sets:
            raise VerificationError(f"{p.name} changed the inputs but gave no raw input to verify the later passes")
        reference = path.with_name(f"reference-{index}.onnx")
        shutil.copyfile(path, reference)
        artifacts.write_side_files(reference, side)
        self.verifier = Verifier(
            reference,
            sets,
            self.setup.tolerance,
            target=self.setup.target,
            intra_op_threads=self.setup.intra_op_threads,
        )
        stats = measure(reference, sets, self.setup.quick, pool=self.setup.pool)
        p50 = sum(st.p50_ms for st in stats) / len(stats)
        record.verification = {
            "ok": True,
            "reason": None,
            "by": p.name,
            "max_abs": change.max_abs,
            "max_abs_lossy": change.max_abs_lossy,
            "samples": change.samples_checked,
        }
        record.latency_ms_p50_after = p50
        record.status = "applied"
        record.reason = (
            f"inputs changed to {change.inputs}: verified by the pass itself against the original fed by the "
            f"reference pre-processing on {change.samples_checked} sample(s) "
            f"(max abs {change.max_abs}); later passes are verified against this model on its raw "
            f"inputs; p50 {p50:.4g} ms on raw input, decoding/tokenizing included (not comparable with the "
            f"previous stage)"
        )
        self.rebase = Rebase(p.name, len(self.kept), reference, p50)
        self.input_sets = sets
        self.ctx.samples = [s.feeds for s in sets]
        self.valid_positions = {}  # they named the old inputs
        self.dynamic_axes = artifacts.dynamic_axes(path)
        self.side_files, self.verify_side_file = side, verify_side_file
        return path

    # The artifact ---------------------------------------------------------------------------------

    def _replay(self, passes: Sequence[Pass], path: Path) -> Path:
        """Run ``passes`` from the upload again, without checks, into ``path`` (and its side files)."""
        model = artifacts.load_ir(self.setup.source)
        self.ctx.side_files = {}
        current, self.ctx.samples = self.ctx.samples, [s.feeds for s in self.setup.input_sets]
        try:
            for p in passes:
                model = self._call(p, model).model  # as in the ledger: a changes_inputs pass on raw samples
                if p.changes_inputs:  # and the passes after it on the inputs it verified, as in the ledger
                    self.ctx.samples = current
        finally:
            self.ctx.samples = current
        artifacts.save_ir(model, path)
        artifacts.write_side_files(path, self.ctx.side_files, stale={*self.side_files, *self.ctx.side_files})
        return path

    def finalize(self, work: Path, accepted: Path) -> Outcome:
        """The artifact (last stage + provenance), verified; bisect the applied passes if it fails."""
        provenance = self.setup.provenance
        self.setup.pool.retain(self._references())  # the last stage's session: the artifact is timed, not it
        if not self.kept:
            return Outcome(self.setup.source, self.verifier.check(self.setup.source), None)
        artifact = artifacts.write_stamped(
            artifacts.load_ir(accepted), self.kept_passes, provenance, work / "artifact.onnx", self.side_files
        )
        verification = self.check(artifact)
        bisection: dict[str, Any] | None = None
        while not verification.ok and self.kept:
            # Each stage passed on its own, so this is an interaction (or the stamped artifact differs).
            passes = self.kept_passes
            probe = work / "bisect.onnx"

            def fails(k: int, passes: list[Pass] = passes, probe: Path = probe) -> bool:
                if self.rebase is not None and k <= self.rebase.kept + 1:
                    return False  # up to the input change: verified on their own, against other inputs
                return not self.check(self._replay(passes[:k], probe)).ok

            try:
                guilty = bisect_first_failing(len(passes), fails)
            except Exception as exc:  # replay itself failed: drop the last applied pass
                guilty = len(passes) - 1
                verification.reason = f"{verification.reason}; replay failed: {exc}"
            record_index, guilty_pass = self.kept.pop(guilty)
            record = self.records[record_index]
            record.status = "rolled_back"
            record.reason = (
                f"bisection: the combined model fails ({verification.reason}); this pass is the first culprit"
            )
            bisection = {
                "reason": verification.reason,
                "guilty_pass": guilty_pass.name,
                "guilty_index": record_index,
                "dropped": [*(bisection or {}).get("dropped", []), guilty_pass.name],
            }
            if not self.kept:
                return Outcome(self.setup.source, self.verifier.check(self.setup.source), bisection)
            model = artifacts.load_ir(self._replay(self.kept_passes, work / "replayed.onnx"))
            self.side_files = dict(self.ctx.side_files)
            artifacts.write_stamped(model, self.kept_passes, provenance, artifact, self.side_files)
            verification = self.check(artifact)
        return Outcome(artifact, verification, bisection)

    def rebased_artifact(self, work: Path) -> tuple[Path, VerificationResult]:
        """The gate refused what the passes after the rebase made: hand back the rebased stage instead of the
        upload (whose interface the job asked to replace); the later passes are marked rolled back."""
        assert self.rebase is not None
        cut = self.rebase.kept + 1
        for record_index, _ in self.kept[cut:]:
            self.records[record_index].status = "rolled_back"
            self.records[record_index].reason = "the gate refused the passes after the input change; see decision"
        self.kept = self.kept[:cut]
        self.side_files = artifacts.read_side_files(self.rebase.reference, self.side_files)
        artifact = artifacts.write_stamped(
            artifacts.load_ir(self.rebase.reference),
            self.kept_passes,
            self.setup.provenance,
            work / "artifact-rebased.onnx",
            self.side_files,
        )
        return artifact, self.check(artifact, positions=False)
