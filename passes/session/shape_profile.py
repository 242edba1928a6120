"""shape_profile: pick ONNX Runtime session settings for a model with dynamic axes, by measuring them.

A model whose batch and sequence vary from call to call meets ORT's per-shape costs: the memory pattern
planned per input shape, the arena that grows (by powers of two, by default) to the largest shape seen
and keeps it. The right settings depend on the model and the traffic, so this pass measures them:

1. **Ranges.** Each dynamic dim the caller chooses (``core.inputs``: dims fixed by the graph, such as a
   ViT's image side, or derived, such as a mask over past + new tokens, follow from the others) gets a
   range or a list of buckets: the ``ranges``/``buckets`` options (keyed by dim name or by role,
   ``batch``/``sequence``/``past``), else the sizes seen in the context's samples (when they show at least
   two sizes), else a serving-like distribution drawn from the model: batch 1, 2, 4, 8 with weights
   .4/.3/.2/.1, sequence log-uniform from 8 (or the convolution stack's minimum, for audio) up to the
   model's position table (512 without one), a past log-uniform up to half the table.
2. **Trace.** ``calls`` calls of random sizes (seeded), inputs made for their role by ``core.inputs``.
3. **Candidates.** Each replays the same trace in a **fresh process** (``python -m core.runtime
   --measure``), ``repeats`` times, interleaved (round r runs the candidates in an order rotated by r):
   ORT's defaults; a warm-up call at the largest shape; ``enable_mem_pattern`` off; the CPU arena off;
   both; initializers outside the arena; the CPU arena growing by ``kSameAsRequested``; on CUDA, the CUDA
   arena's ``kSameAsRequested`` and a ``gpu_mem_limit`` of 1.25x the default's measured peak. Each run
   gives per-call latency, first-seen-shape flags, the trace time (sum of the calls), GPU memory on CUDA
   when NVML is there, and the **serving memory**: the trace's RSS peak (a high-water mark restarted once
   the session is loaded) above the RSS before the load, i.e. weights, arena growth and per-shape buffers
   without the transient peak of parsing the model, which dominates the process's peak RSS and hid every
   difference between candidates (issue 17). ``arena_growth_mb`` (trace peak above the loaded session)
   is reported beside it.
4. **Choice.** A candidate is *not slower* when the median of its per-round trace-time ratios to the
   default is at most 1 + margin, margin = min(``max_slowdown``, max(1%, the default's own run-to-run
   spread)). Among those, the one whose median serving memory is lowest, by more than
   ``min_memory_saving_mb`` and more than the spread of the runs, wins; otherwise the default stays.
5. **Recipe.** The winner goes into ``metadata_props["onnxforge.session"]`` as JSON
   (``session_options``, ``session_config``, ``provider_options``, ``warmup``), which
   ``core.runtime.load`` applies. The graph is not touched; with the default kept, nothing is written.

Notes: ``notes["shape_profile"]`` holds the ranges, the trace, every candidate's figures and a ``plot``
block (per-call latency with spikes marked, serving memory per candidate) for the report. The
measurement and the rule live in ``passes/session/_shape_profile_measure.py``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
from pydantic import Field, field_validator

from core.inputs import InputSynthesis
from core.model_files import save_model
from core.recipe import RECIPE_KEY
from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes.session._shape_profile_measure import (
    CPU_CANDIDATES,
    CUDA_CANDIDATES,
    GPU_LIMIT_FACTOR,
    _candidates,
    _decide,
    _recipe,
    _spikes,
    run_child,
    serving_mb,
)

__all__ = [
    "CPU_CANDIDATES",
    "CUDA_CANDIDATES",
    "ShapeProfile",
    "ShapeProfileOptions",
    "_candidates",
    "_recipe",
    "_spikes",
    "run_child",
    "serving_mb",
]

# Serving traffic: mostly single requests, some small batches; lengths spread over orders of magnitude.
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8)
DEFAULT_BATCH_WEIGHTS = (0.4, 0.3, 0.2, 0.1)
DEFAULT_MIN_SEQUENCE = 8
DEFAULT_MAX_SEQUENCE = 512  # without a position table


class ShapeProfileOptions(PassOptions):
    ranges: dict[str, tuple[int, int]] | None = Field(
        None,
        description="Inclusive size range per dynamic dim, keyed by dim name or role ('batch', 'sequence'); "
        "default: from the samples, else batch 1/2/4/8 weighted to 1, sequence log-uniform from 8 to the "
        "position table (512 without one).",
    )
    buckets: dict[str, list[int]] | None = Field(
        None, description="Sizes to draw from per dynamic dim (dim name or role); wins over ranges."
    )
    calls: int = Field(40, ge=2, le=1000, description="Calls in the random-size trace.")
    repeats: int = Field(3, ge=1, le=20, description="Fresh-process runs of the trace per candidate, interleaved.")
    seed: int = Field(0, description="Seed of the trace's sizes and values.")
    candidates: list[str] | None = Field(
        None, description="Candidate settings to try (default: all that apply to the target); 'default' is implied."
    )
    max_slowdown: float = Field(
        0.05, ge=0, le=1, description="Trace-time ratio to the default allowed at most, whatever the noise."
    )
    min_memory_saving_mb: float = Field(
        4.0, ge=0, description="Peak-memory saving (MiB) a candidate must show, beyond the measured spread."
    )
    max_positions: int | None = Field(
        None, ge=1, description="Cap of sequence-like dims (default: the model's position table, if found)."
    )
    timeout_s: float = Field(600.0, gt=0, description="Time limit of one measurement process.")

    @field_validator("ranges")
    @classmethod
    def _ranges_ordered(cls, value: dict[str, tuple[int, int]] | None) -> dict[str, tuple[int, int]] | None:
        for name, (lo, hi) in (value or {}).items():
            if lo < 1 or hi < lo:
                raise ValueError(f"range of {name!r} must be 1 <= lo <= hi")
        return value

    @field_validator("buckets")
    @classmethod
    def _buckets_positive(cls, value: dict[str, list[int]] | None) -> dict[str, list[int]] | None:
        for name, sizes in (value or {}).items():
            if not sizes or min(sizes) < 1:
                raise ValueError(f"buckets of {name!r} must be a non-empty list of sizes >= 1")
        return value

    @field_validator("candidates")
    @classmethod
    def _known_candidates(cls, value: list[str] | None) -> list[str] | None:
        known = {*CPU_CANDIDATES, *CUDA_CANDIDATES}
        for name in value or []:
            if name not in known:
                raise ValueError(f"unknown candidate {name!r} (known: {', '.join(sorted(known))})")
        return value


class ShapeProfile(Pass[ShapeProfileOptions]):
    name = "shape_profile"
    summary = "Measure ORT session settings on a random-size call trace; store the leanest as a load recipe."
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        options = self.options
        synthesis = InputSynthesis(model, seed=options.seed)
        dynamic = synthesis.free_dims()
        if not dynamic:
            return PassResult(
                model,
                False,
                {"candidates_measured": 0, "recipes_written": 0},
                [NonMatch("no graph input has a dynamic dim: every call has the same shape")],
                {"decision": "skipped: no dynamic axes"},
            )
        max_positions = options.max_positions or synthesis.facts.max_positions
        dims = _dim_plan(synthesis, dynamic, options, ctx.samples, max_positions)
        rng = np.random.default_rng(options.seed)
        trace = [_draw(dims, rng) for _ in range(options.calls)]
        largest = {name: plan["buckets"][-1] if plan["buckets"] else plan["range"][1] for name, plan in dims.items()}
        candidates = _candidates(options, ctx.target)
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if ctx.target != "cpu" else None

        work = Path(tempfile.mkdtemp(prefix="onnxforge-shape-profile-"))
        try:
            model_path = work / "model.onnx"
            _save_copy(model, model_path)
            trace_path = work / "trace.npz"
            feeds = [synthesis.feeds_for_sizes(sizes, rng) for sizes in trace]
            np.savez(trace_path, **{f"{i}/{k}": v for i, feed in enumerate(feeds) for k, v in feed.items()})
            warmup = [{name: list(shape) for name, shape in synthesis.bind(0, preset=largest).items()}]
            runs = self._measure_all(
                candidates=candidates,
                model_path=model_path,
                trace_path=trace_path,
                warmup=warmup,
                providers=providers,
                options=options,
                work=work,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)

        elements = [
            math.prod(max(v, 1) for v in sizes.values()) for sizes in trace
        ]  # the spike rule scales latency by it
        report = _decide(runs, candidates, options, elements)
        report["dims"] = dims
        report["trace"] = trace
        report["calls"], report["repeats"], report["seed"] = options.calls, options.repeats, options.seed
        report["max_positions"] = max_positions
        chosen = report["chosen"]
        counts = {"candidates_measured": len(candidates), "recipes_written": 0}
        notes: dict[str, Any] = {"decision": report["decision"], "shape_profile": report}
        if chosen == "default":
            return PassResult(model, False, counts, [NonMatch(report["decision"])], notes)
        recipe = report["recipes"][chosen]
        model.metadata_props[RECIPE_KEY] = json.dumps(recipe, sort_keys=True, separators=(",", ":"))
        counts["recipes_written"] = 1
        return PassResult(model, True, counts, [], notes)

    def _measure_all(
        self,
        *,
        candidates: dict[str, dict[str, Any]],
        model_path: Path,
        trace_path: Path,
        warmup: list[dict[str, list[int]]],
        providers: list[str] | None,
        options: ShapeProfileOptions,
        work: Path,
    ) -> dict[str, list[dict[str, Any]]]:
        names = list(candidates)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for round_ in range(options.repeats):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            if "cuda_mem_limit" in order:  # its limit comes from the default's measurement
                order.remove("cuda_mem_limit")
                order.insert(order.index("default") + 1, "cuda_mem_limit")
            for name in order:
                recipe = _recipe(candidates[name], warmup)
                if name == "cuda_mem_limit":
                    peaks = [r["peak_gpu_mb"] for r in runs["default"] if r.get("peak_gpu_mb")]
                    if not peaks:
                        continue  # no GPU memory figure to size the limit from
                    limit = int(max(peaks) * GPU_LIMIT_FACTOR * (1 << 20))
                    recipe["provider_options"]["CUDAExecutionProvider"]["gpu_mem_limit"] = str(limit)
                candidates[name]["_recipe"] = recipe
                spec = {
                    "model": str(model_path),
                    "trace": str(trace_path),
                    "calls": options.calls,
                    "recipe": recipe,
                    "providers": providers,
                    "out": str(work / f"{name}-{round_}.json"),
                }
                runs[name].append(run_child(spec, work / f"{name}-{round_}.spec.json", options.timeout_s))
        return runs


# ------------------------------------------------------------------------------------- the trace


def _default_range(role: str, minimum: int, max_positions: int | None) -> dict[str, Any]:
    if role == "batch":
        return {"range": [1, DEFAULT_BATCH_BUCKETS[-1]], "buckets": list(DEFAULT_BATCH_BUCKETS),
                "weights": list(DEFAULT_BATCH_WEIGHTS), "distribution": "weighted"}  # fmt: skip
    top = max_positions or DEFAULT_MAX_SEQUENCE
    if role == "past":
        return {"range": [0, max(top // 2, 1)], "distribution": "log-uniform"}
    if minimum > 1:  # raw audio: from the convolution stack's minimum to 64 times it (wav2vec2: 0.025-1.6 s)
        return {"range": [minimum, 64 * minimum], "distribution": "log-uniform"}
    return {"range": [DEFAULT_MIN_SEQUENCE, max(top, DEFAULT_MIN_SEQUENCE)], "distribution": "log-uniform"}


def _dim_plan(
    synthesis: InputSynthesis,
    dynamic: Mapping[str, Mapping[str, Any]],
    options: ShapeProfileOptions,
    samples: Sequence[Mapping[str, np.ndarray]],
    max_positions: int | None,
) -> dict[str, dict[str, Any]]:
    """Per dynamic dim: role, inclusive range (and buckets when given), its distribution and its source."""
    axes = {(spec.name, axis): dim for spec in synthesis.specs for axis, dim in enumerate(spec.dims) if dim in dynamic}
    seen: dict[str, set[int]] = {name: set() for name in dynamic}
    for sample in samples:
        for name, array in sample.items():
            for axis, size in enumerate(np.shape(array)):
                dim = axes.get((name, axis))
                if dim is not None:
                    seen[dim].add(int(size))
    plan: dict[str, dict[str, Any]] = {}
    for dim, info in dynamic.items():
        role, minimum = info["role"], info["min"]
        cap = max_positions if role in ("sequence", "past") and not minimum > 1 else None
        buckets = (options.buckets or {}).get(dim) or (options.buckets or {}).get(role)
        given = (options.ranges or {}).get(dim) or (options.ranges or {}).get(role)
        entry: dict[str, Any] = {"role": role, "buckets": None}
        if buckets:
            sizes = sorted({min(s, cap) if cap else s for s in buckets})
            entry.update(range=[sizes[0], sizes[-1]], buckets=sizes, source="option", distribution="uniform")
        elif given:
            entry.update(range=list(given), source="option", distribution="uniform")
        elif len(seen[dim]) >= 2:
            entry.update(range=[min(seen[dim]), max(seen[dim])], source="samples", distribution="uniform")
        else:
            entry.update(_default_range(role, minimum, max_positions), source="default")
        if cap and entry["range"][1] > cap:
            entry["range"] = [min(entry["range"][0], cap), cap]
            entry["clamped_to"] = cap
        plan[dim] = entry
    if max_positions and any(e["role"] == "past" for e in plan.values()):
        half = max(max_positions // 2 - 1, 1)  # past + new tokens must fit the position table
        for entry in plan.values():
            if entry["role"] in ("sequence", "past") and entry["range"][1] > half:
                entry["range"] = [min(entry["range"][0], half), half]
                entry["clamped_to"] = half
    return plan


def _draw(dims: Mapping[str, Mapping[str, Any]], rng: np.random.Generator) -> dict[str, int]:
    sizes = {}
    for name, plan in dims.items():
        lo, hi = plan["range"]
        if plan["buckets"]:
            sizes[name] = int(rng.choice(plan["buckets"], p=plan.get("weights")))
        elif plan.get("distribution") == "log-uniform" and hi > lo:
            # log(1 + x) so that a past may be 0; short calls are as likely per octave as long ones
            sizes[name] = int(min(hi, max(lo, round(math.expm1(rng.uniform(math.log1p(lo), math.log1p(hi)))))))
        else:
            sizes[name] = int(rng.integers(lo, hi + 1))
    return sizes


def _save_copy(model: ir.Model, path: Path) -> None:
    """The model as the children load it, without an earlier recipe (each candidate brings its own)."""
    saved = model.metadata_props.pop(RECIPE_KEY, None)
    try:
        save_model(model, path)
    finally:
        if saved is not None:
            model.metadata_props[RECIPE_KEY] = saved
    with contextlib.suppress(OSError):
        os.chmod(path, 0o600)
