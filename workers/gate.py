"""The regression gate: the last word on what a job hands back.

::

    artifact (verified) ─> full or quick interleaved benchmark against the upload (or, after a pass replaced
    the inputs, against the stage right after it) ─┬─ out of tolerance or slower beyond noise:
                                                   │    the upload is returned (used_original), or the stage
                                                   │    right after the input change; with fail_on_regression
                                                   │    the job fails naming the guilty pass
                                                   ├─ preset fast (full benchmark, rollback_slower on), a tie
                                                   │    at the floor or a later turn (pooled gain under 3%,
                                                   │    under 10% at 95%, an answer still open): the upload is
                                                   │    returned, as above, never a failure (``decision.gate.tie``)
                                                   └─ else: optimized

The timing stops once this decision is taken over every input set (``BenchmarkParams.pooled_stop``,
workers/benchmark.py ``decided``): the pooled verdict settled or futile and no set able to turn clearly slower,
though one set's own interval may still straddle 1 +- 3%, which the decision does not read.

Before any timing, the same-program proof (workers/same_program.py): when ORT, at ORT_ENABLE_ALL on the job's
target, turns the artifact and the reference into equal graphs, the artifact is the same program as the upload
under ORT's optimizations, not slower by construction: it is handed back untimed (``decision.gate.same_program``;
the report's ``baseline`` then times the upload alone). A difference of one attribute or one weight falls through
to the timing.

When the ledger left its last group to the gate (``Ledger.left_to_gate``: a group whose A/B would have compared
the same two models as the gate) and the gate finds the artifact slower, ``decide_or_retry`` runs the passes
again on a fresh ledger pass by pass, as the ledger does with any slower group, and decides on that one.

An artifact that fails to run in the benchmark (which runs it at ORT's default level, as users do, where the
verification ran it with optimizations off) is refused like one out of tolerance (``decision.gate.benchmark_error``);
when that artifact was the ledger's untimed last group, ``decide_or_retry`` runs the passes again one by one too,
and the ledger rolls back the one the benchmark cannot run (``workers.benchmark.run_failure``).

The decision is the report's ``decision`` section; ``failure`` turns a failed one into the error the job
raises (VerificationError or RegressionError, carrying the report's path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.config import JobConfig
from core.errors import OnnxforgeError, RegressionError, VerificationError
from core.recipe import read_recipe
from passes._infra import Pass
from workers.benchmark import ORT_RUN_ERRORS, BenchmarkParams, Comparison, compare, run_failure
from workers.ledger import Ledger, Outcome
from workers.report import PassRecord
from workers.same_program import same_program
from workers.verify import Verifier

# Presets whose only aim is latency ("kept only where it pays on the target", passes/registry.py): their full
# gate stops on a tie (workers/benchmark.py, ``tie``) and hands back the upload. The others keep timing a tie to
# its end, as their artifact is worth having for what it is (exact clean-up, smaller weights) when not slower;
# so do jobs that opted out of timing-based choices (rollback_slower off) or of the full benchmark (whose quick
# gate of 5 blocks is too short to call a tie on).
TIE_RETURNS_UPLOAD = frozenset({"fast"})
# Interleaved blocks the serving-length look times (``_serving``), within the benchmark's time budget: enough for
# a 95% interval of a few percent on a quiet host, a few seconds on a large model's one row.
SERVING_BLOCKS = 20


@dataclasses.dataclass
class GateResult:
    benchmark: dict[str, Any] | None  # the report's benchmark section (full benchmarks only)
    decision: dict[str, Any]  # the report's decision section
    # Refused after a pass replaced the inputs: hand back the stage right after that pass, not the upload.
    fall_back_to_rebase: bool = False
    # The gate's interleaved timing of the upload on the job's own input sets (None when it timed another
    # reference, or nothing): the job's baseline, which is then not timed a second time.
    upload_timing: Comparison | None = None


def _ledger_ratio(record: PassRecord) -> float:
    latency = record.latency or {}
    return float(latency.get("p50_ms_after", 0.0)) / max(float(latency.get("p50_ms_before", 0.0)), 1e-9)


def decide(
    ledger: Ledger,
    outcome: Outcome,
    config: JobConfig,
    *,
    full: BenchmarkParams,
    quick: BenchmarkParams,
    progress: Callable[[str, float], None],
) -> GateResult:
    """Verify-then-benchmark decision on ``outcome.artifact`` against what the job must not regress from."""
    decision: dict[str, Any] = {
        "result": "optimized",
        "used_original": False,
        "reason": "",
        "failed_pass": None,
        "gate": {"verified": outcome.verification.ok, "slower": None, "benchmark_mode": None},
    }
    rebase = ledger.rebase
    if not ledger.kept:
        decision.update(
            result="original",
            used_original=True,
            reason="no pass was kept, so the uploaded model is returned unchanged",
        )
        return GateResult(None, decision)
    if not outcome.verification.ok:
        decision.update(
            result="original",
            used_original=True,
            reason=f"the optimized model is out of tolerance: {outcome.verification.reason}",
        )
        if config.fail_on_regression:
            decision.update(result="failed", used_original=False, failed_pass=ledger.kept[-1][1].name)
            return GateResult(None, decision)
        return GateResult(None, decision, _fall_back(ledger, decision))
    if rebase is not None and len(ledger.kept) == rebase.kept + 1:
        decision["gate"]["inputs_changed_by"] = rebase.pass_name
        decision["reason"] = (
            f"{rebase.pass_name} replaced the model's inputs and verified itself against the reference "
            "pre-processing; no later pass was kept, so there is nothing to time against (the uploaded model "
            "takes other inputs)"
        )
        return GateResult(None, decision)
    reference = rebase.reference if rebase is not None else ledger.setup.source
    recipe_b = read_recipe(outcome.artifact)  # the gate measures the session users are told to create
    proof = same_program(
        reference,
        outcome.artifact,
        target=config.target,
        intra_op_threads=ledger.setup.intra_op_threads,
        recipe_b=recipe_b,
    )
    decision["gate"]["same_program"] = proof["same"]
    if proof["same"]:
        decision["reason"] = (
            f"verified within tolerance, and ORT runs the same program for it as for the "
            f"{'reference' if rebase is not None else 'uploaded model'} (their graphs after ORT's own "
            f"optimizations, ORT_ENABLE_ALL on {config.target}, are equal; proved in {proof['seconds']:.1f} s): "
            f"not slower by construction, so not timed ({len(ledger.kept)} pass(es) kept)"
        )
        return GateResult(None, decision)
    progress("benchmarking", 0.0)
    # The gate decides on Comparison.slower (pooled, or one set clearly slower): its sets stop once that is taken.
    params = dataclasses.replace(full if config.benchmark else quick, pooled_stop=True)
    if config.preset in TIE_RETURNS_UPLOAD and config.benchmark and ledger.setup.rollback_slower:
        params = dataclasses.replace(params, tie_stop=True)  # on a tie the upload comes back: never slower
    try:
        comparison = compare(
            reference,
            outcome.artifact,
            ledger.input_sets,
            params,
            mode="full" if config.benchmark else "quick",
            recipe_b=recipe_b,
            pool=ledger.setup.pool,  # the reference's warm session, built for the baseline (or the input change)
        )
    except ORT_RUN_ERRORS as exc:  # run_failure: the artifact is no model to hand back
        decision["gate"]["benchmark_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        decision.update(
            result="original",
            used_original=True,
            reason=f"the optimized model {run_failure(exc)}; the uploaded model is returned",
        )
        if config.fail_on_regression:
            decision.update(result="failed", used_original=False, failed_pass=ledger.kept[-1][1].name)
            return GateResult(None, decision)
        return GateResult(None, decision, _fall_back(ledger, decision))
    progress("benchmarking", 1.0)
    decision["gate"].update(slower=comparison.slower, benchmark_mode=comparison.mode, speedup=comparison.speedup)
    benchmark = comparison.to_dict() if config.benchmark else None
    upload = comparison if rebase is None and ledger.input_sets is ledger.setup.input_sets else None
    if not comparison.slower and comparison.tie:
        decision["gate"]["tie"] = True
        per_set = ", ".join(f"{sh.verdict.paired_ratio:.3f}" for sh in comparison.shapes)
        pooled = comparison.pooled
        tied = (
            f"no faster than the uploaded model beyond the 3% floor (pooled paired ratio {pooled.paired_ratio:.3f}, "
            f"95% interval {pooled.ci95[0]:.3f}..{pooled.ci95[1]:.3f}; per input set {per_set}; no set faster "
            "beyond noise)"
        )
        serving = _serving(ledger, outcome, reference, params, recipe_b) if rebase is None else None
        if serving is not None:
            decision["gate"]["serving"] = serving.record
            if benchmark is not None and serving.comparison is not None:
                benchmark["serving"] = serving.comparison.to_dict()
            if serving.faster:
                decision["reason"] = (
                    f"verified within tolerance; on the generated input sets {tied}, a tie; at {serving.what} "
                    f"{serving.summary}: kept ({len(ledger.kept)} pass(es))"
                )
                return GateResult(benchmark, decision, upload_timing=upload)
        at_length = f"; at {serving.what} {serving.summary}" if serving is not None else ""
        decision.update(
            result="original",
            used_original=True,
            reason=f"verified within tolerance, but {tied}{at_length}: a tie, not timed further to prove it not "
            "slower; the uploaded model is returned",
        )
        return GateResult(benchmark, decision, _fall_back(ledger, decision), upload_timing=upload)
    if not comparison.slower:
        decision["reason"] = (
            f"verified within tolerance and not slower beyond noise (speedup {comparison.speedup:.3f}, "
            f"{len(ledger.kept)} pass(es) kept)"
        )
        return GateResult(benchmark, decision, upload_timing=upload)
    # The suspect: the kept pass whose own ledger measurement slowed the model most, if any did.
    suspects = sorted((ledger.records[i] for i, _ in ledger.kept), key=_ledger_ratio, reverse=True)
    failed = suspects[0].name if suspects and _ledger_ratio(suspects[0]) > 1.0 else None
    if failed is None and len(ledger.kept) == 1:  # untimed by the ledger (left to the gate), yet the only one
        failed = ledger.kept[0][1].name
    clearly = [sh.input_set for sh in comparison.shapes if sh.clearly_slower]
    where = f"on {', '.join(clearly)}" if clearly else f"overall (paired ratio {comparison.pooled.ratio:.3f})"
    decision.update(
        result="original",
        used_original=True,
        failed_pass=failed,
        reason=f"the optimized model is slower than the uploaded one beyond noise {where} "
        f"(speedup {comparison.speedup:.3f}); the uploaded model is returned",
    )
    if config.fail_on_regression:
        decision.update(result="failed", used_original=False)
        return GateResult(benchmark, decision, upload_timing=upload)
    return GateResult(benchmark, decision, _fall_back(ledger, decision), upload_timing=upload)


@dataclasses.dataclass
class _Serving:
    """The tie's second look (``Setup.serving_set``): the artifact verified and timed on one row at a serving
    length, where attention and the projections weigh more than on the generated sets' 8-32 tokens."""

    record: dict[str, Any]  # the report's decision.gate.serving
    summary: str  # for the decision's reason
    faster: bool = False
    comparison: Comparison | None = None

    @property
    def what(self) -> str:
        """How the reason names the set: an image model's is a size, a text model's a length."""
        return "a serving size" if "(serving size)" in str(self.record.get("input_set")) else "a serving length"


def _serving(
    ledger: Ledger, outcome: Outcome, reference: Path, params: BenchmarkParams, recipe_b: dict[str, Any] | None
) -> _Serving | None:
    """Verify, then time, the artifact on the serving-length set; kept only when faster there beyond noise and
    within tolerance (the generated sets already found it not slower). None when the job has no such set."""
    serving = ledger.setup.serving_set
    if serving is None:
        return None
    record: dict[str, Any] = {"input_set": serving.name, "verified": None, "faster": False}
    try:
        verifier = Verifier(
            reference,
            [serving],
            ledger.setup.tolerance,
            target=ledger.setup.target,
            intra_op_threads=ledger.setup.intra_op_threads,
        )
    except OnnxforgeError as exc:  # the upload refuses the length: nothing to compare at it
        record["error"] = f"the uploaded model fails on it: {exc}"[:300]
        return _Serving(record, f"({serving.name}) the uploaded model fails: {str(exc)[:160]}")
    verification = ledger.check(outcome.artifact, verifier=verifier)
    record["verified"] = verification.ok
    if not verification.ok:
        record["error"] = verification.reason
        return _Serving(record, f"({serving.name}) out of tolerance: {verification.reason}")
    # A fixed count of blocks: every early stop of the comparison answers "slower beyond noise?", which a tie
    # has answered already ("not slower" settles with an interval that still reaches 1.0); this asks "faster?".
    blocks = max(params.min_runs, SERVING_BLOCKS)
    fixed = dataclasses.replace(params, tie_stop=False, pooled_stop=False, min_runs=blocks, max_runs=blocks)
    try:
        comparison = compare(
            reference, outcome.artifact, [serving], fixed, mode="serving", recipe_b=recipe_b, pool=ledger.setup.pool
        )
    except ORT_RUN_ERRORS as exc:
        record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return _Serving(record, f"({serving.name}) failed to run: {type(exc).__name__}")
    verdict = comparison.shapes[0].verdict
    faster = bool(verdict.faster and not comparison.slower)
    record.update(faster=faster, speedup=verdict.speedup, paired_ratio=verdict.paired_ratio, ci95=list(verdict.ci95))
    lo, hi = verdict.ci95
    outcome_words = "faster beyond noise" if faster else "not faster beyond noise"
    summary = (
        f"({serving.name}) {outcome_words}: speedup {verdict.speedup:.3f}, paired ratio {verdict.paired_ratio:.3f} "
        f"(95% interval {lo:.3f}..{hi:.3f})"
    )
    return _Serving(record, summary, faster, comparison)


def decide_or_retry(
    ledger: Ledger,
    outcome: Outcome,
    config: JobConfig,
    *,
    passes: list[Pass],
    work: Path,
    full: BenchmarkParams,
    quick: BenchmarkParams,
    progress: Callable[[str, float], None],
) -> tuple[Ledger, Outcome, GateResult]:
    """``decide``; when the ledger left its last group's timing to the gate and the gate finds the artifact
    slower, or cannot run it at ORT's default level, the passes run again pass by pass (each verified and timed
    alone, the one that fails to run rolled back) on a fresh ledger, whose artifact decides."""
    verdict = decide(ledger, outcome, config, full=full, quick=quick, progress=progress)
    gate = verdict.decision["gate"]
    slower = bool(gate.get("slower")) and ledger.setup.rollback_slower
    if not (ledger.left_to_gate and (slower or "benchmark_error" in gate)):
        return ledger, outcome, verdict
    again = Ledger(dataclasses.replace(ledger.setup, group_passes=False))
    outcome = again.finalize(work, again.run(passes, work))
    return again, outcome, decide(again, outcome, config, full=full, quick=quick, progress=progress)


def _fall_back(ledger: Ledger, decision: dict[str, Any]) -> bool:
    """After an input change the upload is no fallback (its client sends other inputs): the stage right after
    the input-changing pass is, as it passed that pass's own verification."""
    if ledger.rebase is None:
        return False
    decision["gate"]["inputs_changed_by"] = ledger.rebase.pass_name
    after = f"the model right after {ledger.rebase.pass_name} is returned"
    reason = decision["reason"]
    reason = (
        reason.replace("the uploaded model is returned", after) if "is returned" in reason else f"{reason}; {after}"
    )
    decision.update(result="optimized", used_original=False, reason=reason)
    return True


def failure(decision: dict[str, Any], passes_before: list[str], report_json: Path) -> OnnxforgeError:
    """The error a job with ``fail_on_regression`` raises for a failed decision; the report is written."""
    detail = {"report_json": str(report_json), "reason": decision["reason"]}
    if decision["gate"].get("verified") is False:
        return VerificationError(
            decision["reason"], pass_name=decision["failed_pass"], passes_before=passes_before, detail=detail
        )
    return RegressionError(
        decision["reason"], pass_name=decision["failed_pass"], passes_before=passes_before, detail=detail
    )
