"""The optimization pipeline: one job's stages, top to bottom. No Celery and no FastAPI here or in anything
imported from here: the child process of a worker and ``onnxforge optimize`` both call ``run_pipeline``.

::

    load: the upload (checked), its passes (unknown names and bad options refused here), their file options
      confined to the upload, the verification inputs, the original's reference outputs
    baseline: the upload's warm benchmark session (built once for every A/B against it); its latency is the
      gate's interleaved timing of it when the gate times it on the job's input sets, else timed alone then
    passes: the ledger (workers/ledger.py) runs, verifies, times and keeps or rolls back each pass, then
      writes the artifact and bisects it if the applied passes interact; preset auto runs one ledger per
      candidate and keeps the fastest (workers/auto_search.py)
    gate: verified and not slower beyond noise, else the upload comes back (workers/gate.py)
    artifact: the returned model, its external data and side files, into the output dir (workers/artifacts.py)
    decoder: a KV-cache decoder's prefill and decode, original vs returned, within its budget
      (workers/decoder_benchmark.py; other models: skipped with the reason)
    report: report.json + report.html (workers/report_builder.py, workers/report.py)

The wall time of each stage (and of each pass's steps) goes to the report's ``timings``. The original's
reference outputs are computed once per job (``Verifier``), and its warm benchmark session lives in the job's
``SessionPool`` from the baseline to the gate.

What the engine knows about a pass is the pass contract (``passes/_infra.py``). Determinism: passes run in a
fixed order on a model loaded the same way, names are never invented here, and the artifact carries no
timestamp; only ``onnxforge.job_id`` differs between two runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import onnx_ir as ir

from core.config import EXACT_TOLERANCE, JobConfig, Tolerance
from core.inputs import InputSet, InputSynthesis, load_raw_samples, make_input_sets, serving_input_set
from core.precision import compute_precision
from passes._infra import Pass, op_histogram
from workers import artifacts, auto_search, gate, output_adapters
from workers import report as report_mod
from workers.benchmark import BenchmarkParams, Runs, SessionPool, measure
from workers.decoder_benchmark import decoder_section
from workers.gate import GateResult
from workers.ledger import Ledger, Setup
from workers.report_builder import build_report
from workers.sessions import providers_for
from workers.verify import Verifier

if TYPE_CHECKING:
    from core.settings import PipelineSettings

ProgressFn = Callable[[str, float], None]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ResolvedPasses:
    passes: list[Pass]
    preset: str | None
    tolerance: Tolerance
    # Preset auto: (candidate name, its passes) to try in turn; the passes above are then unused.
    variants: list[tuple[str, list[Pass]]] | None = None

    def every(self) -> list[Pass]:
        return [*self.passes, *(p for _, ps in self.variants or [] for p in ps)]


PassResolver = Callable[[JobConfig, "PipelineSettings"], ResolvedPasses]


@dataclasses.dataclass
class PipelineRequest:
    model_path: Path  # .onnx inside a directory that also holds its external-data files
    output_dir: Path  # model.onnx (+ external data), report.json, report.html are written here
    config: JobConfig
    settings: PipelineSettings
    samples_path: Path | None = None
    job_id: str | None = None
    progress: ProgressFn | None = None  # (stage, fraction 0..1)
    # Where the passes come from; None: passes.registry (config.passes, else the preset). Tests inject.
    pass_resolver: PassResolver | None = None
    # The service's job input dir (the upload or its extracted archive): file options of passes (prepost's
    # tokenizer) must resolve inside it. None (the CLI): local paths are the user's own.
    input_root: Path | None = None


@dataclasses.dataclass
class PipelineResult:
    model_path: Path
    report: dict[str, Any]
    report_json_path: Path
    report_html_path: Path
    used_original: bool  # the artifact is the uploaded model, byte for byte
    external_data: list[Path]
    # Files a pass produced that travel with the model (model.onnx_adapter); not referenced by the graph.
    side_files: list[Path] = dataclasses.field(default_factory=list)


def resolve_passes(config: JobConfig, settings: PipelineSettings) -> ResolvedPasses:
    """Passes of a job from the registry. Unknown names and bad options raise here, before anything runs."""
    from passes import registry  # deferred for start-up cost: the registry imports every pass module

    specs = config.pass_specs()
    if specs is not None:
        return ResolvedPasses(registry.build_passes(specs), None, config.tolerance or EXACT_TOLERANCE)
    preset = registry.get_preset(config.preset or settings.default_preset)
    tolerance = config.tolerance or preset.tolerance
    if preset.candidates:
        variants = []
        for name in preset.candidates:
            if name == "int8" and not registry.tolerance_allows(tolerance, registry.PRESETS["int8"].tolerance):
                continue  # int8 only when the job's tolerance is as loose as int8's (the opt-in)
            if name == "fp16" and (
                config.target == "cpu" or not registry.tolerance_allows(tolerance, registry.PRESETS["fp16"].tolerance)
            ):
                continue  # fp16 only on GPU targets, and only when the tolerance allows it
            variants.append((name, registry.build_passes(registry.variant_specs(name))))
        return ResolvedPasses([], preset.name, tolerance, variants)
    passes = registry.build_passes(preset.specs)
    return ResolvedPasses(passes, preset.name, tolerance)


# ------------------------------------------------------------------------------------------ the inputs


@dataclasses.dataclass
class _Inputs:
    sets: list[InputSet]  # the verification and timing inputs of the original
    origin: str  # "shapes" | "samples" | "generated", for the report
    raw_sets: list[InputSet] | None  # the user's raw samples, when a pass changes the inputs
    serving: InputSet | None = None  # the gate's serving-length set (generated sets only)


def _input_proto(proto: onnx.ModelProto, every: list[Pass]) -> onnx.ModelProto:
    """The model whose inputs the input sets are generated from: with a pass that may freeze axes requested,
    its I/O frozen the way the (first such) pass will freeze them, so that every set runs on the frozen model."""
    freezer = next((p for p in every if p.may_freeze_axes), None)
    if freezer is None:
        return proto
    model = ir.serde.deserialize_model(proto)
    with contextlib.suppress(Exception):  # a pass that refuses leaves the inputs as they are
        freezer(model)
    fixed = onnx.ModelProto()
    fixed.CopyFrom(proto)
    typed = ir.serde.serialize_model(model)
    del fixed.graph.input[:]
    fixed.graph.input.extend(typed.graph.input)
    return fixed


def _inputs(request: PipelineRequest, proto: onnx.ModelProto, every: list[Pass]) -> _Inputs:
    """Input sets from the config's shapes, the user's samples, else generated by input role; when a pass
    changes the inputs, samples.npz may hold its raw inputs (images, sentences) instead."""
    raw_inputs = {k: v for p in every if p.changes_inputs for k, v in p.raw_inputs().items()}
    raw_sets = None
    if raw_inputs and request.samples_path is not None:
        raw_sets = load_raw_samples(request.samples_path, raw_inputs)
    samples_path = request.samples_path if raw_sets is None else None
    input_proto = _input_proto(proto, every)
    origin = "shapes" if request.config.shapes else "samples" if samples_path else "generated"
    synthesis = InputSynthesis(input_proto, seed=request.config.seed) if origin != "samples" else None
    generated = make_input_sets(
        input_proto,
        count=request.settings.verify_shape_sets,
        seed=request.config.seed,
        shapes=request.config.shapes,
        samples_path=samples_path,
        synthesis=synthesis,
    )
    names: set[str] = set()
    sets = [s for s in generated if not (s.name in names or names.add(s.name))]
    serving = None
    if synthesis is not None and origin == "generated" and raw_sets is None:
        try:
            serving = serving_input_set(
                synthesis,
                sets,
                length=request.settings.gate_serving_length,
                image_side=request.settings.gate_serving_image_side,
            )
        except Exception as exc:  # an optional second look: a model not sized at that length keeps its job
            log.warning("no serving-length set for the gate: %s: %s", type(exc).__name__, exc)
    return _Inputs(sets, origin, raw_sets, serving)


class _Stages:
    """Wall time per stage, for the report's ``timings`` (``with stages("gate"): ...``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float | None] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            key = f"{name}_s"
            self.seconds[key] = (self.seconds.get(key) or 0.0) + time.perf_counter() - started


def _progress(fn: ProgressFn | None) -> ProgressFn:
    def report(stage: str, fraction: float) -> None:
        if fn is not None:
            fn(stage, max(0.0, min(1.0, fraction)))

    return report


# --------------------------------------------------------------------------------------------- the job


def run_pipeline(request: PipelineRequest) -> PipelineResult:
    """Optimize ``request.model_path`` into ``request.output_dir``; see the module docstring.

    Raises InvalidModelError / InvalidInputError / OnnxforgeError subclasses for bad input (before any
    pass runs), and RegressionError / VerificationError only when ``config.fail_on_regression`` is set.
    """
    started = time.perf_counter()
    config, settings, out, source = request.config, request.settings, request.output_dir, request.model_path
    progress = _progress(request.progress)
    out.mkdir(parents=True, exist_ok=True)
    stages = _Stages()

    # load
    progress("loading", 0.0)
    with stages("load"):
        source_sha = artifacts.sha256_file(source)
        proto, zipmaps = artifacts.load_checked(source)
        source_external = artifacts.external_files(source)
        resolved = (request.pass_resolver or resolve_passes)(config, settings)
        # float32 outputs of half-precision arithmetic are compared at that precision's floor (core.precision)
        resolved.tolerance = resolved.tolerance.in_precision(compute_precision(proto))
        providers_for(config.target)  # a target this worker cannot serve fails before any work
        every = resolved.every()
        if request.input_root is not None:
            for p in every:
                p.confine_paths(request.input_root)
        hist_before = output_adapters.count_zipmaps(op_histogram(ir.serde.deserialize_model(proto)), zipmaps)
        dynamic_axes = artifacts.proto_dynamic_axes(proto)
    upload = source
    try:
        if zipmaps is not None:  # the job runs on the upload without them (workers/output_adapters.py)
            source = out / ".upload-without-zipmap.onnx"
            onnx.save(proto, str(source))
        with stages("inputs"):  # the input sets, and the original's reference outputs on them (once per job)
            inputs = _inputs(request, proto, every)
            del proto
            verifier = Verifier(
                source,
                inputs.sets,
                resolved.tolerance,
                target=config.target,
                intra_op_threads=settings.intra_op_threads,
            )
    except BaseException:
        if source != upload:
            source.unlink(missing_ok=True)
        raise
    progress("loading", 1.0)

    quick = BenchmarkParams.from_settings(settings, target=config.target, quick=True)
    full = BenchmarkParams.from_settings(settings, target=config.target)
    work = Path(tempfile.mkdtemp(prefix=".work-", dir=out))
    pool = SessionPool()  # the original's warm benchmark session, from the baseline to the gate
    try:
        # baseline: the session now; the latency from the gate, which times the upload anyway (_baseline)
        with stages("baseline"):
            runs, _ = pool.runs(source, [s.feeds for s in inputs.sets], quick, keep_outputs=True)
            upload_drift = _drift(verifier, runs)
        setup = Setup(
            source=source,
            input_sets=inputs.sets,
            raw_sets=inputs.raw_sets,
            verifier=verifier,
            tolerance=resolved.tolerance,
            target=config.target,
            intra_op_threads=settings.intra_op_threads,
            constant_fold_max_bytes=settings.constant_fold_max_bytes,
            quick=quick,
            rollback_slower=settings.rollback_slower if config.rollback_slower is None else config.rollback_slower,
            dynamic_axes=dynamic_axes,
            baseline_p50=None,  # timed once, by the gate (or alone after it): Ledger.fill_baseline
            provenance=artifacts.Provenance(source_sha, resolved.preset, request.job_id),
            progress=progress,
            pool=pool,
            serving_set=inputs.serving,
        )

        # passes
        candidates = None
        if resolved.variants is not None:
            with stages("passes"):  # each candidate's ledger and artifact: finalize_s stays null
                found = auto_search.search(setup, resolved.variants, work, budget_s=config.time_budget_s, full=full)
            ledger, outcome, candidates = found.ledger, found.outcome, found.candidates
        else:
            ledger = Ledger(setup)
            with stages("passes"):
                accepted = ledger.run(resolved.passes, work, gate_times_last=True)  # see gate.decide_or_retry
            progress("verifying", 0.0)
            with stages("finalize"):
                outcome = ledger.finalize(work, accepted)
        progress("verifying", 1.0)

        # gate
        with stages("gate"):
            ledger, outcome, verdict = gate.decide_or_retry(  # a slower group left to the gate: its passes alone
                ledger, outcome, config, passes=resolved.passes, work=work, full=full, quick=quick, progress=progress
            )
            artifact, verification = outcome.artifact, outcome.verification
            if verdict.fall_back_to_rebase:
                artifact, verification = ledger.rebased_artifact(work)
        with stages("baseline"):
            baseline = _baseline(verdict, source, inputs.sets, quick, pool)
        ledger.fill_baseline(baseline["p50_ms"])
        pool.close()

        # artifact
        progress("reporting", 0.0)
        decision = verdict.decision
        if upload_drift["ok"] is False:
            decision["reason"] += f"; {UNSTABLE}: {upload_drift['reason']}"
        if zipmaps is not None and decision["result"] != "failed":
            decision["reason"] += f"; note: {zipmaps.note()}"
        final_path, external, side = artifact, [], []  # a failed job's artifact is reported on, never handed back
        with stages("artifact"):
            if decision["result"] != "failed":
                if zipmaps is not None and not decision["used_original"]:
                    output_adapters.reattach(artifact, zipmaps)
                    output_adapters.check_reattached(upload, artifact, inputs.sets[0].feeds, resolved.tolerance)
                final_path, external, side = artifacts.place(
                    use_original=decision["used_original"],
                    artifact=artifact,
                    source=upload,
                    source_external=source_external,
                    output_dir=out,
                    side_suffixes=ledger.side_files,
                )
            if decision["used_original"]:
                verification = verifier.check(source)  # the upload defines every position

        # decoder: prefill and decode of a KV-cache decoder, original vs the model handed back
        progress("decoder", 0.0)  # its own stage in the job row's timings: seconds on a decoder
        with stages("decoder"):
            failed, same = decision["result"] == "failed", decision["used_original"]
            decoder = decoder_section(
                source, final_path, config, settings, failed=failed, input_sets=inputs.sets, same_model=same
            )
        progress("reporting", 0.0)

        # report
        report_started = time.perf_counter()
        report = build_report(
            job_id=request.job_id,
            config=config,
            preset=resolved.preset,
            tolerance=resolved.tolerance,
            intra_op_threads=settings.intra_op_threads,
            source=upload,
            source_sha=source_sha,
            source_external=source_external,
            hist_before=hist_before,
            original_sets=inputs.sets,
            origin=inputs.origin,
            baseline=baseline,
            ledger=ledger,
            candidates=candidates,
            outcome=outcome,
            verification=verification,
            gate=verdict,
            final_path=final_path,
            output_dir=out,
            external=external,
            side=side,
            duration_s=time.perf_counter() - started,
            timings=_timings(stages, ledger, pool),
            decoder=decoder,
            upload_drift=upload_drift,
        )
        report["timings"]["report_s"] = time.perf_counter() - report_started  # the write below is not counted
        report["duration_s"] = report["timings"]["total_s"] = time.perf_counter() - started
        json_path, html_path = report_mod.write_report(report, out)
        progress("reporting", 1.0)
        if decision["result"] == "failed":
            raise gate.failure(decision, [p.name for p in ledger.kept_passes], json_path)
        return PipelineResult(final_path, report, json_path, html_path, decision["used_original"], external, side)
    finally:
        pool.close()
        shutil.rmtree(work, ignore_errors=True)
        if source != upload:
            source.unlink(missing_ok=True)


# The decision's note when ORT's own optimizations move the upload's outputs beyond the tolerance.
UNSTABLE = (
    "note: ORT's own default optimizations move the uploaded model's outputs beyond the tolerance (its outputs are "
    "not continuous in rounding: a TopK, ArgMax or NMS over near-tied scores), so a rewrite that changes rounding "
    "cannot verify on these inputs; samples with decisive scores let it"
)


def _drift(verifier: Verifier, runs: Runs) -> dict[str, Any]:
    """``Verifier.drift`` of the baseline's session, from the outputs of its first runs (no run more); a failure
    to measure it is reported, never the job's end."""
    try:
        return verifier.drift(runs.first_run_outputs)
    except Exception as exc:  # the upload ran at this level in the baseline already: reported, not raised
        return {"ok": None, "reason": f"not measured: {type(exc).__name__}: {str(exc)[:200]}"}
    finally:
        runs.first_outputs.clear()  # a language model's logits: not held until the gate


def _baseline(
    verdict: GateResult, source: Path, sets: list[InputSet], quick: BenchmarkParams, pool: SessionPool
) -> dict[str, Any]:
    """The report's ``baseline``: the upload's latency per input set. When the gate timed the upload on these
    input sets (interleaved with the artifact, on the same warm session), its runs of the upload are the
    figures; else (no pass kept, an input change, a failed verification, the artifact proved the same program)
    the upload is timed alone now, at the quick floor of timed runs per set."""
    timing = verdict.upload_timing
    if timing is not None:
        stats = [shape.a for shape in timing.shapes]
        timed_by = "gate"
    else:
        # The gate has decided without these runs: they inform the report and decide nothing, so the floor the
        # ledger's quick comparisons never go below (5 runs, fewer only when ledger_runs is) and no more. A CNN's
        # sets are batch 1, 2 and 4: ledger_runs (10) each was most of the baseline stage, ~0.8 s of resnet's 3.4 s
        # job (issue 17), whose peer benchmarks in 0.5 s.
        stats = measure(source, sets, dataclasses.replace(quick, max_runs=quick.min_runs), pool=pool)
        timed_by = "alone"
    return {
        "p50_ms": sum(s.p50_ms for s in stats) / len(stats),
        "timed_by": timed_by,
        "input_sets": [{"name": s.name, **st.to_dict()} for s, st in zip(sets, stats, strict=True)],
    }


STAGES = ("load", "inputs", "baseline", "passes", "finalize", "gate", "artifact", "decoder", "report")


def _timings(stages: _Stages, ledger: Ledger, pool: SessionPool) -> dict[str, Any]:
    """The report's ``timings``: seconds per stage (null for a stage this job did not have), per pass, and how
    many benchmark sessions were built and reused."""
    return {
        **{f"{name}_s": stages.seconds.get(f"{name}_s") for name in STAGES},
        "total_s": None,
        "passes": [t.to_dict() for t in ledger.timings],
        "sessions": pool.counts(),
    }
