"""The optimization pipeline with its per-pass ledger: passes -> verify -> benchmark -> report.

No Celery and no FastAPI here or in anything imported from here: the child process of a worker and
``onnxforge optimize`` both call ``run_pipeline`` directly.

::

    load ─> resolve passes ─> inputs + reference outputs ─> baseline latency (quick)
      └─> for each pass, on a copy of the last accepted stage (a file, so rollback = reload):
            run ─> PassError? ─────────────────────────────> failed (rolled back, error recorded)
                ─> not modified? ──────────────────────────> no_change ("did nothing because ...")
                ─> onnx.checker, verify vs the ORIGINAL ─ no ─> rolled_back (which output, how far off)
                ─> quick interleaved latency ─ slower beyond noise and rollback_slower ─> rolled_back
                ─> applied: this stage becomes the last accepted one
      └─> artifact = last stage + provenance metadata; verify it; if out of tolerance, bisect the applied
          passes to name the guilty one, drop it, replay, re-check
      └─> full benchmark original vs artifact (interleaved) ─> REGRESSION GATE:
            slower beyond noise or out of tolerance ─> hand back the uploaded model (used_original) or,
            with fail_on_regression, raise RegressionError / VerificationError naming the pass
      └─> report.json + report.html

Determinism: passes run in a fixed order on a model loaded the same way, names are never invented here,
and the artifact carries no timestamp; only ``onnxforge.job_id`` differs between two runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import onnx_ir as ir

from core.config import EXACT_TOLERANCE, JobConfig, Tolerance
from core.errors import InvalidModelError, PassError, RegressionError, VerificationError
from core.recipe import RECIPE_KEY, read_recipe
from core.version import __version__
from passes._infra import Pass, PassContext, op_histogram
from workers import report as report_mod
from workers.benchmark import BenchmarkParams, Comparison, compare, host_info, measure
from workers.verify import InputSet, Verifier, load_raw_samples, make_input_sets, providers_for

if TYPE_CHECKING:
    from core.settings import PipelineSettings

MODEL_FILE = "model.onnx"
# Above this many bytes of tensors, models are written with their weights in MODEL_FILE + ".data":
# a single protobuf cannot exceed 2 GiB.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000
META_PREFIX = "onnxforge."

ProgressFn = Callable[[str, float], None]


@dataclasses.dataclass
class ResolvedPasses:
    passes: list[Pass]
    preset: str | None
    tolerance: Tolerance
    # Preset auto: (candidate name, its passes) to try in turn; the passes above are then unused.
    variants: list[tuple[str, list[Pass]]] | None = None


PassResolver = Callable[[JobConfig, "PipelineSettings"], ResolvedPasses]
AUTO_DEFAULT_BUDGET_S = 600.0
# Written by passes and kept through _stamp: tune_session's recipe, and prepost's note that the artifact needs
# onnxruntime-extensions and how to register it (a consumer cannot load the model without it).
KEPT_META = frozenset({RECIPE_KEY, META_PREFIX + "requires", META_PREFIX + "register"})


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
    from passes import registry  # deferred: the registry imports every pass module

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


# ------------------------------------------------------------------------------------------- helpers


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _load_proto(path: Path) -> onnx.ModelProto:
    try:
        proto = onnx.load(str(path), load_external_data=True)
        onnx.checker.check_model(str(path))
    except Exception as exc:
        raise InvalidModelError(
            f"the model does not load or check: {type(exc).__name__}: {exc}", code="INVALID_MODEL"
        ) from exc
    return proto


def _load_ir(path: Path) -> ir.Model:
    return ir.serde.deserialize_model(onnx.load(str(path), load_external_data=True))


def _tensor_bytes(model: ir.Model) -> int:
    total = 0
    for value in model.graph.initializers.values():
        if value.const_value is not None:
            total += int(value.const_value.nbytes)
    return total


def _save_ir(model: ir.Model, path: Path) -> list[Path]:
    """Write ``model`` to ``path``; weights go to ``<name>.data`` beside it above the 2 GiB-ish threshold."""
    data = path.with_name(path.name + ".data")
    with contextlib.suppress(FileNotFoundError):
        data.unlink()
    if _tensor_bytes(model) > EXTERNAL_DATA_THRESHOLD:
        ir.save(model, path, external_data=data.name, size_threshold_bytes=1024)
        return [data]
    ir.save(model, path)
    return []


def _write_side_files(path: Path, side_files: dict[str, bytes]) -> None:
    """Write a pass's side files next to the model at ``path`` (``stage.onnx`` -> ``stage.onnx_adapter``)."""
    for suffix, data in side_files.items():
        path.with_suffix(suffix).write_bytes(data)


def _external_files(path: Path) -> list[str]:
    """Relative locations of the external-data files the (already loaded and checked) model refers to.

    Read from the graph alone: ``onnx.load(load_external_data=True)`` inlines the weights and forgets
    where they came from."""
    proto = onnx.load(str(path), load_external_data=False)
    locations: list[str] = []
    for tensor in onnx.external_data_helper._get_all_tensors(proto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location" and entry.value not in locations:
                    locations.append(entry.value)
    return locations


def _proto_dynamic_axes(proto: onnx.ModelProto) -> dict[str, set[int]]:
    """``input:<name>`` / ``output:<name>`` -> the axes declared dynamic (a dim_param or no value)."""
    initializers = {i.name for i in proto.graph.initializer}
    axes: dict[str, set[int]] = {}
    for kind, values in (("input", proto.graph.input), ("output", proto.graph.output)):
        for value in values:
            if value.name in initializers or not value.type.HasField("tensor_type"):
                continue
            shape = value.type.tensor_type.shape if value.type.tensor_type.HasField("shape") else None
            if shape is None:
                continue
            dynamic = {i for i, d in enumerate(shape.dim) if not d.HasField("dim_value")}
            if dynamic:
                axes[f"{kind}:{value.name}"] = dynamic
    return axes


def dynamic_axes(path: Path) -> dict[str, set[int]]:
    return _proto_dynamic_axes(onnx.load(str(path), load_external_data=False))


def lost_axes(expected: dict[str, set[int]], path: Path) -> list[str]:
    """The axes dynamic in ``expected`` that the model at ``path`` declares static (or dropped)."""
    now = dynamic_axes(path)
    return [
        f"{key} axis {axis}" for key, axes in sorted(expected.items()) for axis in sorted(axes - now.get(key, set()))
    ]


def _session_entry(recipe: dict[str, Any] | None) -> dict[str, Any] | None:
    if recipe is None:
        return None
    keys = ("session_options", "session_config", "provider_options")
    return {**{k: recipe.get(k) or {} for k in keys}, "warmup": recipe.get("warmup") or []}


def _input_proto(proto: onnx.ModelProto, resolved: ResolvedPasses) -> onnx.ModelProto:
    """The model whose inputs the input sets are generated from: with fix_shapes requested, its I/O frozen
    the way the pass will freeze them, so that every set runs on the fixed model."""
    from passes.session.fix_shapes import FixShapes

    every = [*resolved.passes, *(p for _, ps in resolved.variants or [] for p in ps)]
    fixers = [p for p in every if isinstance(p, FixShapes)]
    if not fixers:
        return proto
    model = ir.serde.deserialize_model(proto)
    for fixer in fixers[:1]:
        with contextlib.suppress(Exception):
            fixer(model)
    fixed = onnx.ModelProto()
    fixed.CopyFrom(proto)
    typed = ir.serde.serialize_model(model)
    del fixed.graph.input[:]
    fixed.graph.input.extend(typed.graph.input)
    return fixed


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


def _latency_summary(comparison: Comparison) -> dict[str, Any]:
    return {
        "p50_ms_before": comparison.p50_a_ms,
        "p50_ms_after": comparison.p50_b_ms,
        "speedup": comparison.speedup,
        "slower": comparison.slower,
        "margin": comparison.pooled.margin,
        "confirmed": comparison.mode == "quick-confirm",
        "noisy": any(s.a.noisy or s.b.noisy for s in comparison.shapes),
        "runs": comparison.params.min_runs,
        "input_sets_clearly_slower": [sh.input_set for sh in comparison.shapes if sh.clearly_slower],
    }


def _ledger_ratio(record: report_mod.PassRecord) -> float:
    latency = record.latency or {}
    return float(latency.get("p50_ms_after", 0.0)) / max(float(latency.get("p50_ms_before", 0.0)), 1e-9)


class _Progress:
    def __init__(self, fn: ProgressFn | None) -> None:
        self.fn = fn

    def __call__(self, stage: str, fraction: float) -> None:
        if self.fn is not None:
            self.fn(stage, max(0.0, min(1.0, fraction)))


# ------------------------------------------------------------------------------------------ pipeline


class _Run:
    """State of one pipeline run; ``run_pipeline`` is the public entry."""

    def __init__(self, request: PipelineRequest) -> None:
        self.req = request
        self.config = request.config
        self.settings = request.settings
        self.target = self.config.target
        self.progress = _Progress(request.progress)
        self.rollback_slower = (
            self.config.rollback_slower if self.config.rollback_slower is not None else self.settings.rollback_slower
        )
        self.quick = BenchmarkParams.from_settings(self.settings, target=self.target, quick=True)
        self.full = BenchmarkParams.from_settings(self.settings, target=self.target)
        runs = 3 * self.quick.min_runs
        self.confirm = dataclasses.replace(self.quick, min_runs=runs, max_runs=runs)
        self.records: list[report_mod.PassRecord] = []
        self.kept: list[tuple[int, Pass]] = []  # (index into records, pass) of applied passes
        # Outputs whose pad positions an applied pass left undefined, and the input marking the valid ones.
        self.valid_positions: dict[str, dict[str, Any]] = {}
        # Side files of the applied passes (ctx.side_files after the last accepted one), and the one whose
        # adapter verification must activate (a pass's notes["verify_with_adapter"]), once any pass set it.
        self.side_files: dict[str, bytes] = {}
        self.verify_adapter: str | None = None
        self.candidates: list[dict[str, Any]] | None = None  # preset auto: every candidate tried
        # Set once a pass replaced the model's inputs (prepost): from then on its stage is the reference of
        # verification and of the gate, fed the raw inputs the pass verified.
        self.rebase: dict[str, Any] | None = None
        self.raw_sets: list[InputSet] | None = None  # the user's raw samples (samples.npz), if any
        self.rebase_fallback = False

    # The stages ------------------------------------------------------------------------------------

    def run(self) -> PipelineResult:
        started = time.perf_counter()
        req = self.req
        out = req.output_dir
        out.mkdir(parents=True, exist_ok=True)
        self.progress("loading", 0.0)
        source_sha = sha256_file(req.model_path)
        proto = _load_proto(req.model_path)
        source_external = _external_files(req.model_path)
        resolved = (req.pass_resolver or resolve_passes)(self.config, self.settings)
        self.resolved = resolved
        providers_for(self.target)  # a target this worker cannot serve fails before any work
        every = [*resolved.passes, *(p for _, ps in resolved.variants or [] for p in ps)]
        if req.input_root is not None:
            for p in every:
                confine = getattr(p, "confine_paths", None)
                if confine is not None:
                    confine(req.input_root)
        raw_inputs = {k: v for p in every if getattr(p, "changes_inputs", False) for k, v in p.raw_inputs().items()}
        if raw_inputs and req.samples_path is not None:
            # samples.npz may hold the raw inputs (images, sentences) rather than the original's tensors
            self.raw_sets = load_raw_samples(req.samples_path, raw_inputs)
        samples_path = req.samples_path if self.raw_sets is None else None
        self.dynamic_axes = _proto_dynamic_axes(proto)
        input_sets = make_input_sets(
            _input_proto(proto, resolved),
            count=self.settings.verify_shape_sets,
            seed=self.config.seed,
            shapes=self.config.shapes,
            samples_path=samples_path,
        )
        names: set[str] = set()
        self.input_sets = [s for s in input_sets if not (s.name in names or names.add(s.name))]
        self.original_sets = self.input_sets
        self.origin = "shapes" if self.config.shapes else "samples" if samples_path else "generated"
        original_ir = ir.serde.deserialize_model(proto)
        del proto
        self.hist_before = op_histogram(original_ir)
        del original_ir
        self.verifier = Verifier(
            req.model_path,
            self.input_sets,
            resolved.tolerance,
            target=self.target,
            intra_op_threads=self.settings.intra_op_threads,
        )
        self.ctx = PassContext(
            target=self.target,
            samples=[s.feeds for s in self.input_sets],
            constant_fold_max_bytes=self.settings.constant_fold_max_bytes,
        )
        self.progress("loading", 1.0)

        work = Path(tempfile.mkdtemp(prefix=".work-", dir=out))
        try:
            baseline = measure(req.model_path, self.input_sets, self.quick)
            self.baseline_p50 = sum(s.p50_ms for s in baseline) / len(baseline)
            self.baseline = {
                "p50_ms": self.baseline_p50,
                "input_sets": [
                    {"name": s.name, **st.to_dict()} for s, st in zip(self.input_sets, baseline, strict=True)
                ],
            }
            if resolved.variants is not None:
                artifact, verification, bisection = self._auto(work, source_sha)
            else:
                accepted = self._ledger(work, resolved.passes)
                self.progress("verifying", 0.0)
                artifact, verification, bisection = self._finalize(work, accepted, source_sha)
            self.progress("verifying", 1.0)
            benchmark, decision = self._gate(artifact, verification)
            if self.rebase_fallback:
                artifact, verification = self._rebase_artifact(work, source_sha)
            self.progress("reporting", 0.0)
            used_original = decision["used_original"]
            final_path, external, side = self._write_artifact(decision, artifact, source_external)
            if used_original:
                verification = self.verifier.check(final_path)  # the upload defines every position
            report = self._report(
                source_sha=source_sha,
                source_external=source_external,
                verification=verification,
                bisection=bisection,
                benchmark=benchmark,
                decision=decision,
                final_path=final_path,
                external=external,
                side=side,
                duration=time.perf_counter() - started,
            )
            json_path, html_path = report_mod.write_report(report, out)
            self.progress("reporting", 1.0)
            if decision["result"] == "failed":
                self._raise(decision, json_path)
            return PipelineResult(final_path, report, json_path, html_path, used_original, external, side)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _write_artifact(
        self, decision: dict[str, Any], artifact: Path, source_external: list[str]
    ) -> tuple[Path, list[Path], list[Path]]:
        """Put the returned model in the output dir: the optimized artifact, or the upload byte for byte.

        Files are copied to a temporary name and renamed into place, so a reader never sees half a model,
        and an output dir that is also the upload's dir never loses the upload before it is copied."""
        out, source = self.req.output_dir, self.req.model_path
        if decision["result"] == "failed":
            return artifact, [], []  # reported on, never handed back
        final_path = out / MODEL_FILE
        if decision["used_original"]:
            files = [(source, final_path)] + [(source.parent / loc, out / loc) for loc in source_external]
        else:
            files = [(artifact, final_path)]
            data = artifact.with_name(artifact.name + ".data")
            if data.exists():
                files.append((data, out / (MODEL_FILE + ".data")))
        side = [(artifact.with_suffix(sfx), final_path.with_suffix(sfx)) for sfx in sorted(self.side_files)]
        if decision["used_original"]:
            side = []
        for suffix in self.side_files:  # left over from an earlier attempt that kept the side file
            if not side:
                final_path.with_suffix(suffix).unlink(missing_ok=True)
        stale = out / (MODEL_FILE + ".data")
        if all(stale.resolve() != dst.resolve() for _, dst in files) and stale.resolve() not in {
            (source.parent / loc).resolve() for loc in source_external
        }:
            stale.unlink(missing_ok=True)  # left over from an earlier attempt in the same dir
        for src, dst in files:
            if src.resolve() == dst.resolve():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(f".{dst.name}.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        for src, dst in side:
            tmp = dst.with_name(f".{dst.name}.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        return final_path, [dst for _, dst in files[1:]], [dst for _, dst in side]

    def _ledger(self, work: Path, passes: Sequence[Pass]) -> Path:
        """Run every pass on a copy of the last accepted stage; return the path of the last accepted one."""
        accepted = self.req.model_path
        accepted_p50 = self.baseline_p50
        for index, p in enumerate(passes):
            self.progress("passes", index / len(passes))
            record = report_mod.PassRecord(name=p.name, options=p.options.model_dump(mode="json"))
            self.records.append(record)
            started = time.perf_counter()
            try:
                candidate = self._try_pass(index, p, record, accepted, accepted_p50, work)
            finally:
                record.duration_s = time.perf_counter() - started
            if candidate is None and getattr(p, "changes_inputs", False):
                # The job asked for another interface (raw input): without this pass the upload would come back
                # with the old one, and its client would break. Fail instead (PassErrors raised above keep
                # their own codes).
                raise PassError(f"{p.name} was not applied: {record.reason}", pass_name=p.name)
            if candidate is not None:
                if accepted != self.req.model_path:
                    accepted.unlink(missing_ok=True)
                    accepted.with_name(accepted.name + ".data").unlink(missing_ok=True)
                accepted = candidate
                if record.latency_ms_p50_after is not None:
                    accepted_p50 = record.latency_ms_p50_after
                self.kept.append((index, p))
        self.progress("passes", 1.0)
        return accepted

    def _auto(self, work: Path, source_sha: str) -> tuple[Path, Any, dict[str, Any] | None]:
        """Preset auto: run each candidate's passes through the ledger, verify and benchmark its artifact
        against the original (interleaved), and keep the fastest within tolerance. The chosen candidate's
        ledger becomes the report's ``passes``; every candidate goes to ``candidates``."""
        variants = self.resolved.variants or []
        budget = self.config.time_budget_s or AUTO_DEFAULT_BUDGET_S
        started = time.perf_counter()
        expected_axes = {k: set(v) for k, v in self.dynamic_axes.items()}
        self.candidates = []
        measured: list[tuple[dict[str, Any], tuple[Any, ...]]] = []
        fallback: tuple[Any, ...] | None = None
        for i, (name, passes) in enumerate(variants):
            entry: dict[str, Any] = {
                "name": name,
                "passes": [p.name for p in passes],
                "p50_ms": None,
                "speedup": None,
                "verification": None,
                "status": "skipped",
                "reason": "",
            }
            self.candidates.append(entry)
            elapsed = time.perf_counter() - started
            if i > 0 and elapsed >= budget:
                entry["reason"] = f"time budget spent ({elapsed:.1f} s of {budget:g} s)"
                continue
            self.progress("passes", i / max(len(variants), 1))
            self.records, self.kept, self.valid_positions = [], [], {}
            self.dynamic_axes = {k: set(v) for k, v in expected_axes.items()}
            vwork = work / f"candidate-{i}"
            vwork.mkdir()
            accepted = self._ledger(vwork, passes)
            artifact, verification, bisection = self._finalize(vwork, accepted, source_sha)
            state = (self.records, self.kept, self.valid_positions, self.dynamic_axes)
            state += (artifact, verification, bisection)
            fallback = fallback or state
            entry["passes"] = [p.name for _, p in self.kept]
            entry["verification"] = verification.worst()
            if not verification.ok:
                entry.update(status="rejected", reason=f"out of tolerance: {verification.reason}")
                continue
            left = max(budget - (time.perf_counter() - started), 0.0)
            share = left / max(len(variants) - i, 1) / max(2 * len(self.input_sets), 1)
            params = dataclasses.replace(self.full, max_seconds=max(0.05, min(self.full.max_seconds, share)))
            comparison = compare(
                self.req.model_path, artifact, self.input_sets, params, mode="auto", recipe_b=read_recipe(artifact)
            )
            entry.update(
                status="measured",
                p50_ms=comparison.p50_b_ms,
                speedup=comparison.speedup,
                reason=f"{len(self.kept)} pass(es) kept; p50 {comparison.p50_a_ms:.4g} -> {comparison.p50_b_ms:.4g} ms "
                f"against the original, interleaved",
            )
            measured.append((entry, state))
        if measured:
            best_entry, state = max(measured, key=lambda item: item[0]["speedup"])
            best_entry["status"] = "chosen"
            best_entry["reason"] = "fastest within tolerance; " + best_entry["reason"]
        else:
            # Nothing verified: hand the gate no kept pass (so it returns the upload), with the first ledger.
            records, bisection = (fallback[0], fallback[6]) if fallback else ([], None)
            original = self.req.model_path
            state = (records, [], {}, expected_axes, original, self.verifier.check(original), bisection)
        self.records, self.kept, self.valid_positions, self.dynamic_axes = state[:4]
        self.progress("passes", 1.0)
        return state[4], state[5], state[6]

    def _try_pass(  # noqa: PLR0917  (private helper; the ledger loop is its only caller)
        self,
        index: int,
        p: Pass,
        record: report_mod.PassRecord,
        accepted: Path,
        accepted_p50: float,
        work: Path,
    ) -> Path | None:
        model = _load_ir(accepted)
        before = op_histogram(model)
        record.nodes_before = record.nodes_after = sum(before.values())
        record.latency_ms_p50_before = accepted_p50
        self.ctx.side_files = dict(self.side_files)  # a rolled-back pass's side files never survive it
        changes_inputs = bool(getattr(p, "changes_inputs", False))
        samples = self.ctx.samples
        if changes_inputs:  # it verifies itself on raw samples (the user's, else its built-in ones)
            self.ctx.samples = [s.feeds for s in self.raw_sets or []]
        try:
            result = p(model, self.ctx)
            after = op_histogram(result.model)
        except PassError as exc:
            record.status, record.reason = "failed", f"pass raised, rolled back: {exc.message}"
            if changes_inputs:
                raise  # with its own code: see _ledger
            return None
        except Exception as exc:  # a broken result (e.g. a graph op_histogram cannot walk)
            record.status, record.reason = (
                "failed",
                f"pass broke the model, rolled back: {type(exc).__name__}: {exc}",
            )
            return None
        finally:
            self.ctx.samples = samples
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
        verify_adapter = result.notes.get("verify_with_adapter") or self.verify_adapter
        try:
            _save_ir(result.model, path)
            _write_side_files(path, side)
            onnx.checker.check_model(str(path))
        except Exception as exc:
            record.status, record.reason = (
                "rolled_back",
                f"produced an invalid model: {type(exc).__name__}: {exc}",
            )
            return None
        if changes_inputs and result.notes.get("changes_inputs"):
            return self._rebase_on(index, p, record, path, side, verify_adapter)
        lost = lost_axes(self.dynamic_axes, path)
        if lost and p.name != "fix_shapes":
            record.status, record.reason = (
                "rolled_back",
                f"made dynamic axes static ({', '.join(lost[:5])}); only fix_shapes may, when the job asks for it",
            )
            return None
        positions = {**self.valid_positions, **result.notes.get("valid_positions", {})}
        verification = self.verifier.check(path, positions, adapter=self._adapter(path, verify_adapter))
        record.verification = verification.worst()
        if not verification.ok:
            record.status, record.reason = "rolled_back", f"broke tolerance: {verification.reason}"
            return None
        recipes = {"recipe_a": read_recipe(accepted), "recipe_b": read_recipe(path)}
        comparison = compare(accepted, path, self.input_sets, self.quick, mode="quick", **recipes)
        if comparison.slower:
            # Confirm before blaming: a second, three times longer interleaved measurement decides.
            comparison = compare(accepted, path, self.input_sets, self.confirm, mode="quick-confirm", **recipes)
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
        if comparison.slower and self.rollback_slower:
            record.status, record.reason = "rolled_back", f"slower beyond noise: {speed}"
            return None
        record.status = "applied"
        self.valid_positions = positions
        self.side_files, self.verify_adapter = side, verify_adapter
        if lost:  # fix_shapes, as asked: the axes it froze are no longer expected to be dynamic
            self.dynamic_axes = dynamic_axes(path)
        record.reason = f"verified within tolerance; {speed}" + (
            "; slower beyond noise but kept (rollback_slower is off)" if comparison.slower else ""
        )
        return path

    def _rebase_on(  # noqa: PLR0917  (private helper of _try_pass)
        self,
        index: int,
        p: Pass,
        record: report_mod.PassRecord,
        path: Path,
        side: dict[str, bytes],
        verify_adapter: str | None,
    ) -> Path:
        """Accept a pass that replaced the model's inputs (prepost) on its own verification, and make its stage
        the reference of what follows.

        The generic check feeds the old and the new model the same tensors, which cannot work here: the pass
        compared its raw-input artifact with the original fed by the reference pre-processing (tokenizer,
        Pillow + numpy) and raised if they differ. Later passes are verified against this stage, on the raw
        inputs the pass verified (or the user's raw samples), and the gate measures against it too."""
        sets = self.raw_sets or [
            InputSet(f"raw {i} ({', '.join(f)})", f) for i, f in enumerate(getattr(p, "verified_inputs", [])[:8])
        ]
        if not sets:
            raise VerificationError(f"{p.name} changed the inputs but gave no raw input to verify the later passes")
        reference = path.with_name(f"reference-{index}.onnx")
        shutil.copyfile(path, reference)
        _write_side_files(reference, side)
        self.verifier = Verifier(
            reference,
            sets,
            self.resolved.tolerance,
            target=self.target,
            intra_op_threads=self.settings.intra_op_threads,
        )
        stats = measure(reference, sets, self.quick)
        p50 = sum(st.p50_ms for st in stats) / len(stats)
        notes = record.notes
        record.verification = {
            "ok": True,
            "reason": None,
            "by": p.name,
            "max_abs": notes.get("max_abs_exact"),
            "max_abs_lossy": notes.get("max_abs_lossy"),
            "samples": len(notes.get("samples_checked", [])),
        }
        record.latency_ms_p50_after = p50
        record.status = "applied"
        record.reason = (
            f"inputs changed to {notes.get('inputs')}: verified by the pass itself against the original fed by the "
            f"reference pre-processing on {len(notes.get('samples_checked', []))} sample(s) "
            f"(max abs {notes.get('max_abs_exact')}); later passes are verified against this model on its raw "
            f"inputs; p50 {p50:.4g} ms on raw input, decoding/tokenizing included (not comparable with the "
            f"previous stage)"
        )
        self.rebase = {"pass": p.name, "record": index, "kept": len(self.kept), "reference": reference, "p50": p50}
        self.input_sets = sets
        self.ctx.samples = [s.feeds for s in sets]
        self.valid_positions = {}  # they named the old inputs
        self.dynamic_axes = dynamic_axes(path)
        self.side_files, self.verify_adapter = side, verify_adapter
        return path

    def _rebase_artifact(self, work: Path, source_sha: str) -> tuple[Path, Any]:
        """The gate refused what the passes after the rebase made: hand back the rebased stage instead of the
        upload (whose interface the job asked to replace); the later passes are marked rolled back."""
        assert self.rebase is not None
        cut = self.rebase["kept"] + 1
        for record_index, _ in self.kept[cut:]:
            self.records[record_index].status = "rolled_back"
            self.records[record_index].reason = "the gate refused the passes after the input change; see decision"
        self.kept = self.kept[:cut]
        artifact = work / "artifact-rebased.onnx"
        model = _load_ir(self.rebase["reference"])
        self._stamp(model, [p for _, p in self.kept], source_sha)
        _save_ir(model, artifact)
        self.side_files = {
            sfx: self.rebase["reference"].with_suffix(sfx).read_bytes()
            for sfx in self.side_files
            if self.rebase["reference"].with_suffix(sfx).exists()
        }
        _write_side_files(artifact, self.side_files)
        return artifact, self.verifier.check(artifact, adapter=self._adapter(artifact))

    def _stamp(self, model: ir.Model, passes: Sequence[Pass], source_sha: str) -> None:
        props = {k: v for k, v in model.metadata_props.items() if not k.startswith(META_PREFIX) or k in KEPT_META}
        props[META_PREFIX + "version"] = __version__
        props[META_PREFIX + "preset"] = self.resolved.preset or ""
        props[META_PREFIX + "passes"] = json.dumps(
            [{"name": p.name, "options": p.options.model_dump(mode="json")} for p in passes],
            sort_keys=True,
            separators=(",", ":"),
        )
        props[META_PREFIX + "source_sha256"] = source_sha
        if self.req.job_id:
            props[META_PREFIX + "job_id"] = self.req.job_id
        model.metadata_props.clear()
        model.metadata_props.update(props)

    def _adapter(self, path: Path, suffix: str | None = None) -> Path | None:
        """The adapter verification activates for the model at ``path``, if a pass declared one."""
        suffix = suffix or self.verify_adapter
        return path.with_suffix(suffix) if suffix and path.with_suffix(suffix).exists() else None

    def _replay(self, passes: Sequence[Pass], path: Path) -> Path:
        model = _load_ir(self.req.model_path)
        self.ctx.side_files = {}
        samples, self.ctx.samples = self.ctx.samples, [s.feeds for s in self.original_sets]
        try:
            for p in passes:
                if getattr(p, "changes_inputs", False):  # as in the ledger: its raw samples, then its own
                    self.ctx.samples = [s.feeds for s in self.raw_sets or []]
                    model = p(model, self.ctx).model
                    self.ctx.samples = samples
                else:
                    model = p(model, self.ctx).model
        finally:
            self.ctx.samples = samples
        _save_ir(model, path)
        for suffix in {*self.side_files, *self.ctx.side_files}:
            path.with_suffix(suffix).unlink(missing_ok=True)
        _write_side_files(path, self.ctx.side_files)
        return path

    def _finalize(self, work: Path, accepted: Path, source_sha: str) -> tuple[Path, Any, dict[str, Any] | None]:
        """The artifact (last stage + provenance), verified; bisect the applied passes if it fails."""
        if not self.kept:
            return self.req.model_path, self.verifier.check(self.req.model_path), None
        artifact = work / "artifact.onnx"
        model = _load_ir(accepted)
        self._stamp(model, [p for _, p in self.kept], source_sha)
        _save_ir(model, artifact)
        _write_side_files(artifact, self.side_files)
        verification = self.verifier.check(artifact, self.valid_positions, adapter=self._adapter(artifact))
        bisection: dict[str, Any] | None = None
        while not verification.ok and self.kept:
            # Each stage passed on its own, so this is an interaction (or the stamped artifact differs).
            passes = [p for _, p in self.kept]
            probe = work / "bisect.onnx"

            def fails(k: int, passes: list[Pass] = passes, probe: Path = probe) -> bool:
                if self.rebase is not None and k <= self.rebase["kept"] + 1:
                    return False  # up to the input change: verified on their own, against other inputs
                replayed = self._replay(passes[:k], probe)
                return not self.verifier.check(replayed, self.valid_positions, adapter=self._adapter(replayed)).ok

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
                return self.req.model_path, self.verifier.check(self.req.model_path), bisection
            model = _load_ir(self._replay([p for _, p in self.kept], work / "replayed.onnx"))
            self.side_files = dict(self.ctx.side_files)
            self._stamp(model, [p for _, p in self.kept], source_sha)
            _save_ir(model, artifact)
            _write_side_files(artifact, self.side_files)
            verification = self.verifier.check(artifact, self.valid_positions, adapter=self._adapter(artifact))
        return artifact, verification, bisection

    def _gate(self, artifact: Path, verification: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """The regression gate: (benchmark section, decision section)."""
        decision: dict[str, Any] = {
            "result": "optimized",
            "used_original": False,
            "reason": "",
            "failed_pass": None,
            "gate": {"verified": verification.ok, "slower": None, "benchmark_mode": None},
        }
        if not self.kept:
            decision.update(
                result="original",
                used_original=True,
                reason="no pass was kept, so the uploaded model is returned unchanged",
            )
            return None, decision
        if not verification.ok:
            decision.update(
                result="original",
                used_original=True,
                reason=f"the optimized model is out of tolerance: {verification.reason}",
            )
            if self.config.fail_on_regression:
                decision.update(result="failed", used_original=False, failed_pass=self.kept[-1][1].name)
            else:
                self._fall_back_to_rebase(decision)
            return None, decision
        if self.rebase is not None and len(self.kept) == self.rebase["kept"] + 1:
            decision["gate"]["inputs_changed_by"] = self.rebase["pass"]
            decision["reason"] = (
                f"{self.rebase['pass']} replaced the model's inputs and verified itself against the reference "
                "pre-processing; no later pass was kept, so there is nothing to time against (the uploaded model "
                "takes other inputs)"
            )
            return None, decision
        self.progress("benchmarking", 0.0)
        params = self.full if self.config.benchmark else self.quick
        reference = self.rebase["reference"] if self.rebase is not None else self.req.model_path
        comparison = compare(
            reference,
            artifact,
            self.input_sets,
            params,
            mode="full" if self.config.benchmark else "quick",
            recipe_b=read_recipe(artifact),  # the gate measures the session users are told to create
        )
        self.progress("benchmarking", 1.0)
        decision["gate"].update(slower=comparison.slower, benchmark_mode=comparison.mode, speedup=comparison.speedup)
        if comparison.slower:
            # The suspect: the kept pass whose own ledger measurement slowed the model most, if any did.
            suspects = sorted((self.records[i] for i, _ in self.kept), key=_ledger_ratio, reverse=True)
            failed = suspects[0].name if suspects and _ledger_ratio(suspects[0]) > 1.0 else None
            clearly = [sh.input_set for sh in comparison.shapes if sh.clearly_slower]
            where = f"on {', '.join(clearly)}" if clearly else f"overall (paired ratio {comparison.pooled.ratio:.3f})"
            decision.update(
                result="original",
                used_original=True,
                failed_pass=failed,
                reason=f"the optimized model is slower than the uploaded one beyond noise {where} "
                f"(speedup {comparison.speedup:.3f}); the uploaded model is returned",
            )
            if self.config.fail_on_regression:
                decision.update(result="failed", used_original=False)
            else:
                self._fall_back_to_rebase(decision)
        else:
            decision["reason"] = (
                f"verified within tolerance and not slower beyond noise (speedup {comparison.speedup:.3f}, "
                f"{len(self.kept)} pass(es) kept)"
            )
        return comparison.to_dict() if self.config.benchmark else None, decision

    def _fall_back_to_rebase(self, decision: dict[str, Any]) -> None:
        """After an input change the upload is no fallback (its client sends other inputs): the stage right after
        the input-changing pass is, as it passed that pass's own verification."""
        if self.rebase is None:
            return
        self.rebase_fallback = True
        decision["gate"]["inputs_changed_by"] = self.rebase["pass"]
        after = f"the model right after {self.rebase['pass']} is returned"
        reason = decision["reason"]
        reason = (
            reason.replace("the uploaded model is returned", after) if "is returned" in reason else f"{reason}; {after}"
        )
        decision.update(result="optimized", used_original=False, reason=reason)

    def _raise(self, decision: dict[str, Any], json_path: Path) -> None:
        detail = {"report_json": str(json_path), "reason": decision["reason"]}
        passes_before = [p.name for _, p in self.kept]
        if decision["gate"].get("verified") is False:
            raise VerificationError(
                decision["reason"],
                pass_name=decision["failed_pass"],
                passes_before=passes_before,
                detail=detail,
            )
        raise RegressionError(
            decision["reason"], pass_name=decision["failed_pass"], passes_before=passes_before, detail=detail
        )

    def _report(
        self,
        *,
        source_sha: str,
        source_external: list[str],
        verification: Any,
        bisection: dict[str, Any] | None,
        benchmark: dict[str, Any] | None,
        decision: dict[str, Any],
        final_path: Path,
        external: list[Path],
        side: list[Path],
        duration: float,
    ) -> dict[str, Any]:
        import numpy as np
        import onnxruntime as ort

        final_ir = _load_ir(final_path)
        hist_after = op_histogram(final_ir)
        statuses = Counter(r.status for r in self.records)
        if benchmark is not None:
            p50_before, p50_after = benchmark["p50_ms_original"], benchmark["p50_ms_optimized"]
            speedup = benchmark["speedup"]
        else:
            # After an input change the upload's latency (tensors in) compares with nothing: the stage right
            # after the change (raw input in) is the baseline.
            p50_before = self.rebase["p50"] if self.rebase is not None else self.baseline_p50
            p50_after = self.records[self.kept[-1][0]].latency_ms_p50_after if self.kept else self.baseline_p50
            speedup = p50_before / p50_after if p50_after else None
        if decision["used_original"]:
            p50_after, speedup = p50_before, 1.0
        return {
            "schema_version": report_mod.SCHEMA_VERSION,
            "job_id": self.req.job_id,
            "versions": {
                "onnxforge": __version__,
                "onnx": onnx.__version__,
                "onnxruntime": ort.__version__,
                "onnx_ir": ir.__version__,
                "numpy": np.__version__,
            },
            "host": host_info(target=self.target, intra_op_threads=self.settings.intra_op_threads),
            "source": {
                "file_name": self.req.model_path.name,
                "sha256": source_sha,
                "size_bytes": self.req.model_path.stat().st_size,
                "external_data": source_external,
            },
            "config": self.config.model_dump(mode="json"),
            "preset": self.resolved.preset,
            "tolerance": self.resolved.tolerance.model_dump(mode="json"),
            "input_sets": [_input_set_entry(s, self.origin) for s in self.original_sets]
            + (  # after an input change: the raw inputs the later passes and the gate used (the pass's own)
                [_input_set_entry(s, "samples" if self.raw_sets else "generated") for s in self.input_sets]
                if self.rebase is not None
                else []
            ),
            "baseline": self.baseline,
            "passes": [r.to_dict() for r in self.records],
            "verification": verification.to_dict(),
            "bisection": bisection,
            "benchmark": benchmark,
            "decision": decision,
            "op_histogram": {
                "before": dict(sorted(self.hist_before.items())),
                "after": dict(sorted(hist_after.items())),
            },
            "summary": {
                "nodes_before": sum(self.hist_before.values()),
                "nodes_after": sum(hist_after.values()),
                "p50_ms_before": p50_before,
                "p50_ms_after": p50_after,
                "speedup": speedup,
                "passes_applied": statuses.get("applied", 0),
                "passes_rolled_back": statuses.get("rolled_back", 0),
                "passes_no_change": statuses.get("no_change", 0),
                "passes_failed": statuses.get("failed", 0),
            },
            "candidates": self.candidates,
            "session": None if decision["used_original"] else _session_entry(read_recipe(final_path)),
            "artifact": None
            if decision["result"] == "failed"
            else {
                "file_name": final_path.name,
                "sha256": sha256_file(final_path),
                "size_bytes": final_path.stat().st_size,
                "external_data": [p.relative_to(self.req.output_dir).as_posix() for p in external],
                "side_files": [p.name for p in side],
                "metadata_props": {k: v for k, v in final_ir.metadata_props.items() if k.startswith(META_PREFIX)},
            },
            "duration_s": duration,
        }


def _input_set_entry(input_set: InputSet, origin: str) -> dict[str, Any]:
    return {"name": input_set.name, "origin": origin, "shapes": input_set.shapes()}


def run_pipeline(request: PipelineRequest) -> PipelineResult:
    """Optimize ``request.model_path`` into ``request.output_dir``; see the module docstring.

    Raises InvalidModelError / InvalidInputError / OnnxforgeError subclasses for bad input (before any
    pass runs), and RegressionError / VerificationError only when ``config.fail_on_regression`` is set.
    """
    return _Run(request).run()
