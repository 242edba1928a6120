"""The ledger: run the passes on the last accepted stage, verify and time them, keep them or roll them back.

::

    a pass that is not groupable, alone, on a copy of the last accepted stage (a file, so rollback = reload):
      run ─> PassError? ─────────────────────────────────────> failed (rolled back, error recorded)
          ─> not modified? ──────────────────────────────────> no_change ("did nothing because ...")
          ─> written: the same bytes as the accepted stage? ─> no_change (neither verified nor timed)
          ─> onnx.checker ─ fails ───────────────────────────> rolled_back
          ─> inputs_changed (a changes_inputs pass)? ────────> applied on its own verification; its stage
                                                                becomes the reference of what follows (rebase),
                                                                on the raw inputs and the sets passes declared
                                                                that it can run (the others: dropped, reported)
          ─> froze a dynamic axis and not may_freeze_axes ──> rolled_back
          ─> verify vs the reference ─ out of tolerance ────> rolled_back (which output, how far off)
          ─> quick interleaved latency ─ slower beyond noise and rollback_slower ─> rolled_back
            (a model the timing cannot run at ORT's default level, as users run it: rolled_back too)
          ─> applied: this stage becomes the last accepted one
    a run of groupable passes (declared exact; no side file, input change or frozen axis), in memory:
      each pass on a snapshot (ir clone, tensors shared) ─ raised / not modified / same fingerprint ─>
          failed / no_change, the snapshot goes on; else it joins the pending group
          (a pass declaring valid_positions: the group before it is settled, then it alone)
      settle the group (before the next non-groupable pass, and at the end): written once, checked, verified
      once against the reference and timed once against the accepted stage, as above for one pass
          ─> every check passes: all its passes applied (``latency.group`` names them)
          ─> any check fails: each of its passes runs again alone (above), from the accepted stage, and so
             does each pass that failed or changed nothing on the model holding the group's changes (its
             input was not the accepted stage: a refused rotary fusion had left fuse_transformer an op it
             could not run)
    finalize: the last stage + provenance, verified (the stage's own verification stands for it when nothing it
    depends on changed since); if out of tolerance (an interaction of passes each verified alone), bisect the
    applied passes to name the first culprit, drop it, replay, re-check.

Guarantee: every applied pass was verified within tolerance and timed not slower beyond noise, either alone
or as part of the group it was applied with; a wrong or slower group is never kept as a group (its passes are
judged one by one). What grouping gives up: a pass slower alone can be kept when its group as a whole is not
slower. The gate (workers/gate.py) then times the artifact against the upload.

Everything the ledger knows about a pass comes from the pass contract (``passes/_infra.py``): its class
declarations and the typed fields of its ``PassResult``; never its name, never its notes.

Job time: a group costs one write, one verification session and one A/B, however many passes it holds, and
the model stays in memory between its passes. Benchmark sessions come from the job's ``SessionPool``
(``Setup.pool``), so the original's is built once and the stage a pass was accepted as is timed as the next
A without a rebuild; the ledger keeps only the original, the accepted stage and (after an input change) its
reference alive. Each pass's time is split in ``timings`` (load, transform, write and check, verify,
benchmark) for the report; a group's write, verification and timing are counted on its last pass.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import onnx_ir as ir

from core.errors import PassError, VerificationError
from core.inputs import InputSet
from passes._infra import Pass, PassContext, PassResult, op_histogram
from workers import artifacts
from workers.benchmark import ORT_RUN_ERRORS, Comparison, measure, run_failure
from workers.ledger_parts import (
    Member,
    Outcome,
    PassTiming,
    Rebase,
    Setup,
    applied_reason,
    axis_freezers,
    bisect_first_failing,
    carry_sets,
    fingerprint,
    groupable,
    histogram_delta,
    latency_summary,
    lost_axes,
    pass_sets,
    quick_compare,
    remove_stage,
    speed,
    timed,
    why_nothing,
)

__all__ = ["Ledger", "Outcome", "PassTiming", "Rebase", "Setup", "bisect_first_failing", "groupable"]
from workers.measurement import BenchmarkMeasure
from workers.model_check import check_model
from workers.report import PassRecord
from workers.verify import VerificationResult, Verifier, same_bytes

ProgressFn = Callable[[str, float], None]


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
        # The passes of a last group verified but left to the gate to time (``run(gate_times_last=True)``).
        self.left_to_gate: list[str] = []
        self.input_sets = setup.input_sets
        self.verifier = setup.verifier
        self.pass_sets = setup.pass_sets
        # The run's state: the accepted stage (a file), its latency, the in-memory model (the accepted stage
        # plus the pending group) and its fingerprint, the pending group and the valid positions it declares.
        self._accepted, self._accepted_p50 = setup.source, setup.baseline_p50
        self._model: ir.Model | None = None
        self._print = ""
        self._pending: list[Member] = []
        # Groupable passes that failed or changed nothing on the in-memory model while a group was pending: their
        # input held that group's changes, so if the group falls back they run again on the accepted stage.
        self._bystanders: list[Member] = []
        self._positions: dict[str, dict[str, Any]] = {}
        self._elsewhere_s = 0.0  # time inside a pass's turn spent settling the group before it
        # Each applied stage's verification and what it was verified against (``_verified_as``): the artifact
        # is that stage stamped with provenance metadata, which ORT never reads, so finalize reuses it.
        self._stage_checks: dict[Path, tuple[VerificationResult, tuple[Any, ...]]] = {}
        self.ctx = PassContext(
            target=setup.target,  # type: ignore[arg-type]
            samples=[s.feeds for s in setup.input_sets],
            constant_fold_max_bytes=setup.constant_fold_max_bytes,
            measure=BenchmarkMeasure(target=setup.target, intra_op_threads=setup.intra_op_threads),
            tolerance=setup.tolerance,
            samples_are_data=any(s.provenance.get("source") == "samples" for s in setup.input_sets),
        )

    def _verified_as(self, positions: dict[str, dict[str, Any]], side_file: str | None) -> tuple[Any, ...]:
        """What a verification result depends on besides the graph: the reference (the verifier and how many
        input sets it holds, as a pass may add some), the positions compared and the side file loaded."""
        return (id(self.verifier), len(self.verifier.input_sets), repr(sorted(positions.items())), side_file)

    def fill_baseline(self, p50: float) -> None:
        """The upload's latency, timed after the passes ran (``Setup.baseline_p50`` None): the "before" of the
        records measured against the upload, which were given none."""
        for record in self.records:
            if record.latency_ms_p50_before is None and record.status != "failed":
                record.latency_ms_p50_before = p50

    @property
    def kept_passes(self) -> list[Pass]:
        return [p for _, p in self.kept]

    def check(self, path: Path, *, positions: bool = True, verifier: Verifier | None = None) -> VerificationResult:
        """Verify the model at ``path`` against the current reference (or ``verifier``'s: the gate's
        serving-length set), with the side file passes asked for."""
        verifier = verifier or self.verifier
        return verifier.check(path, self.valid_positions if positions else None, adapter=self._adapter(path))

    def _adapter(self, path: Path, suffix: str | None = None) -> Path | None:
        suffix = suffix or self.verify_side_file
        return path.with_suffix(suffix) if suffix and path.with_suffix(suffix).exists() else None

    def _references(self) -> list[Path]:
        """The models everything is measured against: the upload, or after an input change its stage."""
        return [self.setup.source, *([self.rebase.reference] if self.rebase is not None else [])]

    # The passes -----------------------------------------------------------------------------------

    def run(self, passes: Sequence[Pass], work: Path, *, gate_times_last: bool = False) -> Path:
        """Run every pass; return the path of the last accepted stage (module docstring: groups, fallback).
        ``gate_times_last``: the caller's gate times the artifact against the upload and runs the ledger again
        pass by pass when it is slower, so a last group whose A would be the upload is verified, not timed."""
        self._accepted, self._accepted_p50 = self.setup.source, self.setup.baseline_p50
        self._model, self._print, self._pending, self._bystanders = None, "", [], []
        for index, p in enumerate(passes):
            self.setup.progress("passes", index / len(passes))
            grouped = self.setup.group_passes and groupable(p)
            if not grouped:
                self._flush(work)  # the group before it is settled first, on its own passes' clocks
            record = PassRecord(name=p.name, options=p.options.model_dump(mode="json"))
            self.records.append(record)
            timing = PassTiming(p.name)
            self.timings.append(timing)
            started, self._elsewhere_s = time.perf_counter(), 0.0
            candidate = None
            try:
                if grouped:
                    self._join(Member(index, p, record, timing), work)
                else:
                    candidate = self._try(index, p, record, timing, self._accepted, self._accepted_p50, work)
            finally:
                timing.total_s += time.perf_counter() - started - self._elsewhere_s
                record.duration_s = timing.total_s
            if grouped:
                continue
            if candidate is None and p.changes_inputs:
                # The job asked for another interface (raw input): without this pass the upload would come back
                # with the old one, and its client would break. Fail instead (PassErrors raised above keep
                # their own codes).
                raise PassError(f"{p.name} was not applied: {record.reason}", pass_name=p.name)
            if candidate is not None:
                self._accept([(index, p)], candidate, record.latency_ms_p50_after)
            self.setup.pool.retain([*self._references(), self._accepted])  # a rolled-back candidate's goes
        self._flush(work, gate_times=gate_times_last and self._accepted == self.setup.source and self.rebase is None)
        for record, timing in zip(self.records, self.timings, strict=True):
            record.duration_s = timing.total_s  # a group's checks were added to its last pass after its turn
        self.setup.progress("passes", 1.0)
        return self._accepted

    def _accept(
        self, passes: list[tuple[int, Pass]], candidate: Path, p50: float | None, model: ir.Model | None = None
    ) -> None:
        """``candidate`` is the accepted stage now; ``model``: it in memory (a group's), else it is read back."""
        if self._accepted != self.setup.source:
            self._accepted.unlink(missing_ok=True)
            self._accepted.with_name(self._accepted.name + ".data").unlink(missing_ok=True)
        self._accepted = candidate
        if p50 is not None:
            self._accepted_p50 = p50
        self.kept.extend(passes)
        self._model = model

    # A group: exact passes run one after the other in memory, checked once -------------------------

    def _join(self, member: Member, work: Path) -> None:
        """Run a groupable pass on the in-memory model (the accepted stage plus the pending passes); keep
        its change pending, or discard it (a failure, or no change) by going back to the snapshot."""
        p, record, timing = member.p, member.record, member.timing
        with timed(timing, "load_s"):
            if self._model is None:
                self._model = artifacts.load_ir(self._accepted)
                self._print = fingerprint(self._model)
            model, before_print = self._model, self._print
            before = op_histogram(model)
            snapshot = model.clone() if p.in_place else model  # clone: O(nodes), the tensors are shared
        record.nodes_before = record.nodes_after = sum(before.values())
        record.latency_ms_p50_before = self._accepted_p50
        self.ctx.side_files = dict(self.side_files)
        self._model = snapshot  # until the pass is known to have changed something valid
        if self._pending:  # kept off the model below unless it joins the group (then _pending holds it)
            self._bystanders.append(member)
        try:
            with timed(timing, "transform_s"):
                result = self._call(p, model)
                after = op_histogram(result.model)
        except PassError as exc:
            record.status, record.reason = "failed", f"pass raised, rolled back: {exc.message}"
            return
        except Exception as exc:  # a broken result (e.g. a graph op_histogram cannot walk)
            record.status, record.reason = "failed", f"pass broke the model, rolled back: {type(exc).__name__}: {exc}"
            return
        record.modified = bool(result.modified)
        record.counts = {k: int(v) for k, v in result.counts.items()}
        record.non_matches = [m.to_dict() for m in result.non_matches]
        record.notes = dict(result.notes)
        if not result.modified:
            record.status, record.reason = "no_change", why_nothing(result.non_matches)
            return
        self._verify_also(result, record, timing)
        with timed(timing, "write_s"):
            after_print = fingerprint(result.model)
        if after_print == before_print:
            record.status = "no_change"
            record.reason = "did nothing because the model it returned is the one it received (same graph and tensors)"
            return
        if self._bystanders and self._bystanders[-1] is member:
            self._bystanders.pop()  # it changed the model: a member of the group from here on
        record.nodes_after = sum(after.values())
        record.op_histogram_delta = histogram_delta(before, after)
        if not result.valid_positions:
            self._pending.append(member)
            self._model, self._print = result.model, after_print
            return
        # Verification of this pass and what follows compares valid positions only: the passes before it are
        # settled first, then this one alone.
        if self._settle(work):
            self._pending, self._positions = [member], dict(result.valid_positions)
            self._model, self._print = result.model, after_print
            self._settle(work)
            return
        # The group fell back pass by pass: this pass ran on a model that is not the accepted one.
        candidate = self._try(member.index, p, record, timing, self._accepted, self._accepted_p50, work)
        if candidate is not None:
            self._accept([(member.index, p)], candidate, record.latency_ms_p50_after)

    def _settle(self, work: Path) -> bool:
        """``_flush`` inside a pass's turn: its time is on the group's passes, not on the pass whose turn it is."""
        started = time.perf_counter()
        try:
            return self._flush(work)
        finally:
            self._elsewhere_s += time.perf_counter() - started

    def _flush(self, work: Path, *, gate_times: bool = False) -> bool:
        """Settle the pending group: written once, checked, verified once and timed once against the accepted
        stage. Applied together, or (two or more passes, any check failing) run again one by one as alone.
        Returns whether the accepted stage is now the in-memory model the group was run on."""
        pending, self._pending = self._pending, []
        bystanders, self._bystanders = self._bystanders, []
        positions = {**self.valid_positions, **self._positions}
        self._positions = {}
        if not pending:
            return True
        started = time.perf_counter()
        last, names = pending[-1], [m.p.name for m in pending]
        path = work / f"stage-{last.index:03d}.onnx"
        failure: str | None = None
        verification: VerificationResult | None = None
        comparison: Comparison | None = None
        with timed(last.timing, "write_s"):
            try:
                artifacts.save_ir(self._model, path)
                artifacts.write_side_files(path, self.side_files)
            except Exception as exc:
                failure = f"produced an invalid model: {type(exc).__name__}: {exc}"
            if failure is None and same_bytes(path, self._accepted):
                for m in pending:
                    m.record.status, m.record.nodes_after, m.record.op_histogram_delta = (
                        "no_change",
                        m.record.nodes_before,
                        {},
                    )
                    m.record.reason = f"did nothing because {' + '.join(names)} returned the bytes they received"
                remove_stage(path, self.side_files)
                last.timing.total_s += time.perf_counter() - started
                return True
            if failure is None:
                try:
                    check_model(path)
                except Exception as exc:
                    failure = f"produced an invalid model: {type(exc).__name__}: {exc}"
            lost = lost_axes(self.dynamic_axes, self._model) if failure is None else []
            if lost:
                failure = f"made dynamic axes static ({', '.join(lost[:5])}); only {axis_freezers()} may"
        if failure is None:
            with timed(last.timing, "verify_s"):
                verification = self.verifier.check(path, positions, adapter=self._adapter(path))
            if not verification.ok:
                failure = f"broke tolerance: {verification.reason}"
        if failure is None and not gate_times:
            with timed(last.timing, "benchmark_s"):
                try:
                    comparison = quick_compare(self.setup, self.input_sets, self._accepted, path)
                except ORT_RUN_ERRORS as exc:
                    failure = run_failure(exc)
            if comparison is not None and comparison.slower and self.setup.rollback_slower:
                failure = f"slower beyond noise: {speed(comparison)}"
        last.timing.total_s += time.perf_counter() - started
        for m in pending:
            m.record.verification = verification.worst() if verification is not None else None
            if comparison is not None:
                m.record.latency = latency_summary(comparison, names)
                m.record.latency_ms_p50_before, m.record.latency_ms_p50_after = comparison.p50_a_ms, comparison.p50_b_ms
        if failure is None:
            reason = applied_reason(comparison, names)
            for m in pending:
                m.record.status, m.record.reason = "applied", reason
            self.valid_positions = positions
            if verification is not None:
                self._stage_checks[path] = (verification, self._verified_as(positions, self.verify_side_file))
            self.left_to_gate = [] if comparison is not None else names
            p50 = comparison.p50_b_ms if comparison is not None else None
            self._accept([(m.index, m.p) for m in pending], path, p50, self._model)
            self.setup.pool.retain([*self._references(), self._accepted])
            return True
        remove_stage(path, self.side_files)
        self.setup.pool.retain([*self._references(), self._accepted])
        self._model = None
        if len(pending) == 1:
            pending[0].record.status, pending[0].record.reason = "rolled_back", failure
        # Run again one by one, each verified and timed alone (the old per-pass ledger): the group's passes, and
        # the passes that failed or changed nothing on a model holding the group's changes (TimesFM 2.5's rotary,
        # refused here, had left fuse_transformer's candidates a RotaryEmbedding they could not run).
        rerun = [m for m in pending if len(pending) > 1] + bystanders
        for m in sorted(rerun, key=lambda m: m.index):
            record = m.record
            record.verification = record.latency = record.latency_ms_p50_after = None
            record.op_histogram_delta = {}
            again = time.perf_counter()
            candidate = self._try(m.index, m.p, record, m.timing, self._accepted, self._accepted_p50, work)
            m.timing.total_s += time.perf_counter() - again
            group = " + ".join(names)
            if m in bystanders:
                record.reason = f"{record.reason} (run again: it had run on the group {group}, which {failure})"
            else:
                record.reason = f"{record.reason} (run alone: the group {group} {failure})"
            if candidate is not None:
                self._accept([(m.index, m.p)], candidate, record.latency_ms_p50_after)
            self.setup.pool.retain([*self._references(), self._accepted])
        return False

    def _verify_also(self, result: PassResult, record: PassRecord, timing: PassTiming) -> None:
        """A pass's ``verify_inputs`` join the sets this stage and every later one is verified on (the
        reference's outputs on them are computed once, here); the ones the reference refuses are noted."""
        if not result.verify_inputs:
            return
        reference = "original" if self.rebase is None else f"the model after {self.rebase.pass_name}"
        with timed(timing, "verify_s"):
            sets = pass_sets(result.verify_inputs, record.name, reference, self.verifier)
        refused = {s.name: s.provenance["error"] for s in sets if not s.provenance["accepted"]}
        if refused:
            key = "original" if self.rebase is None else "reference"
            record.notes[f"verify_inputs_refused_by_the_{key}"] = refused
        self._list(sets)

    def _list(self, sets: list[InputSet]) -> None:
        """Into the report's ``input_sets``, once: a pass run again (alone, after its group failed, or by the
        gate's second ledger) declares the same sets, which its verifier holds already."""
        listed = {(s.name, s.provenance["reference"]) for s in self.pass_sets}
        self.pass_sets.extend(s for s in sets if (s.name, s.provenance["reference"]) not in listed)

    def _carry_pass_sets(self, by: str, record: PassRecord, before: Verifier) -> None:
        """After the input change ``by`` made, the sets passes declared that the stages before it were verified
        on (``before`` holds them) go on verifying the later stages where the new reference can run them
        (``carry_sets``); each says whether it was carried or dropped and why (the report's ``input_sets``, and
        this pass's notes)."""
        met = [s for s in before.input_sets if s.provenance.get("source") == "pass"]
        if not met:
            return
        done = carry_sets(met, by, self.verifier)
        for s in met:
            copy, why = done[s.name]
            s.provenance["after_input_change"] = {"by": by, "carried": copy is not None, "why": why}
        self._list([c for c, _ in done.values() if c is not None])
        record.notes["verify_inputs_carried"] = [c.name for c, _ in done.values() if c is not None]
        dropped = {name: why for name, (c, why) in done.items() if c is None}
        if dropped:
            record.notes["verify_inputs_dropped"] = dropped

    def _call(self, p: Pass, model: Any) -> PassResult:
        """Run ``p``; a changes_inputs pass verifies itself on the raw samples (the user's, else its own)."""
        if not p.changes_inputs:
            self.ctx.references, self.ctx.reference_names = self._upload_outputs()
            try:
                return p(model, self.ctx)
            finally:
                self.ctx.references, self.ctx.reference_names = [], []
        samples, self.ctx.samples = self.ctx.samples, [s.feeds for s in self.setup.raw_sets or []]
        try:
            return p(model, self.ctx)
        finally:
            self.ctx.samples = samples

    def _upload_outputs(self) -> tuple[list[Any], list[str]]:
        """The upload's outputs on the context's samples (the verifier's reference) while the model a pass gets
        computes what the upload computes: every pass applied or pending before it exact, no input change, side
        file or valid positions. ``fuse_transformer`` then checks its candidates against them rather than
        running its input with optimizations off on every sample (~1.6 s of Whisper's encoder's job). A group
        whose earlier pass broke the model fails its verification, and its passes then run one by one, each on
        a verified stage."""
        before = [p for _, p in self.kept] + [m.p for m in self._pending]
        if (
            self.rebase is not None
            or self.side_files
            or self.valid_positions
            or self._positions
            or not all(p.exact and not p.changes_inputs for p in before)
        ):
            return [], []
        count = len(self.ctx.samples)
        held = [s.name for s in self.verifier.input_sets[:count]]
        if held != [s.name for s in self.input_sets[:count]] or len(self.verifier.reference) < count:
            return [], []
        return list(self.verifier.reference[:count]), list(self.verifier.output_names)

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
        with timed(timing, "load_s"):
            model = artifacts.load_ir(accepted)
            before = op_histogram(model)
        record.nodes_before = record.nodes_after = sum(before.values())
        record.latency_ms_p50_before = accepted_p50
        self.ctx.side_files = dict(self.side_files)  # a rolled-back pass's side files never survive it
        try:
            with timed(timing, "transform_s"):
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
            record.status, record.reason = "no_change", why_nothing(result.non_matches)
            return None  # whatever it touched is discarded: the next pass reloads the accepted stage
        self._verify_also(result, record, timing)
        record.nodes_after = sum(after.values())
        record.op_histogram_delta = histogram_delta(before, after)
        path = work / f"stage-{index:03d}.onnx"
        side = dict(self.ctx.side_files)
        verify_side_file = result.verify_with_side_file or self.verify_side_file
        with timed(timing, "write_s"):
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
                remove_stage(path, side)
                return None
            try:
                check_model(path)
            except Exception as exc:
                record.status, record.reason = "rolled_back", f"produced an invalid model: {type(exc).__name__}: {exc}"
                return None
            lost = [] if result.inputs_changed is not None else lost_axes(self.dynamic_axes, result.model)
        if result.inputs_changed is not None:
            with timed(timing, "verify_s"):  # mostly the new reference's outputs and its latency
                return self._rebase_on(index, p, result, record, path, side, verify_side_file)
        if lost and not p.may_freeze_axes:
            record.status, record.reason = (
                "rolled_back",
                f"made dynamic axes static ({', '.join(lost[:5])}); only {axis_freezers()} may, when the job "
                "asks for it",
            )
            return None
        positions = {**self.valid_positions, **result.valid_positions}
        with timed(timing, "verify_s"):
            verification = self.verifier.check(path, positions, adapter=self._adapter(path, verify_side_file))
        record.verification = verification.worst()
        if not verification.ok:
            record.status, record.reason = "rolled_back", f"broke tolerance: {verification.reason}"
            return None
        with timed(timing, "benchmark_s"):
            try:
                comparison = quick_compare(self.setup, self.input_sets, accepted, path)
            except ORT_RUN_ERRORS as exc:
                record.status, record.reason = "rolled_back", run_failure(exc)
                return None
        record.latency = latency_summary(comparison, [p.name])
        record.latency_ms_p50_before, record.latency_ms_p50_after = comparison.p50_a_ms, comparison.p50_b_ms
        if comparison.slower and self.setup.rollback_slower:
            record.status, record.reason = "rolled_back", f"slower beyond noise: {speed(comparison)}"
            return None
        record.status = "applied"
        self.valid_positions = positions
        self.side_files, self.verify_side_file = side, verify_side_file
        self._stage_checks[path] = (verification, self._verified_as(positions, verify_side_file))
        if lost:  # a may_freeze_axes pass, as asked: the axes it froze are no longer expected to be dynamic
            self.dynamic_axes = artifacts.dynamic_axes(path)
        record.reason = applied_reason(comparison, [p.name])
        return path

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
        before = self.verifier
        self.verifier = Verifier(
            reference,
            sets,
            self.setup.tolerance,
            target=self.setup.target,
            intra_op_threads=self.setup.intra_op_threads,
        )
        self._carry_pass_sets(p.name, record, before)
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
        model = self._model if self._model is not None and accepted == self._accepted else artifacts.load_ir(accepted)
        self._model = None  # stamped below: no longer the accepted stage
        artifact = artifacts.write_stamped(model, self.kept_passes, provenance, work / "artifact.onnx", self.side_files)
        # The artifact is the accepted stage plus provenance metadata (artifacts.stamp), which ORT does not read:
        # the stage's verification against the same reference, sets, positions and side file is the artifact's.
        known = self._stage_checks.get(accepted)
        if known is not None and known[1] == self._verified_as(self.valid_positions, self.verify_side_file):
            verification = known[0]
        else:
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
