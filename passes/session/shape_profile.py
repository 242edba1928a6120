"""shape_profile: pick ONNX Runtime session settings for a model with dynamic axes, by measuring them.

A model whose batch and sequence vary from call to call meets ORT's per-shape costs: the memory pattern
planned per input shape, the arena that grows (by powers of two, by default) to the largest shape seen
and keeps it. The right settings depend on the model and the traffic, so this pass measures them:

1. **Ranges.** Each dynamic dim gets a range or a list of buckets: the ``ranges``/``buckets`` options
   (keyed by dim name or by role, ``batch``/``sequence``), else the sizes seen in the context's samples
   (when they show at least two sizes), else 1..8 for batch-like and 8..512 for sequence-like dims, the
   sequence clamped to the model's position table when it has one.
2. **Trace.** ``calls`` calls of random sizes (seeded), inputs made for their role (ids within the
   embedding table, right-padded masks).
3. **Candidates.** Each replays the same trace in a **fresh process** (``python -m core.runtime
   --measure``; a process's peak RSS never goes down), ``repeats`` times, interleaved (round r runs the
   candidates in an order rotated by r): ORT's defaults; a warm-up call at the largest shape;
   ``enable_mem_pattern`` off; the CPU arena off; both; initializers outside the arena; the CPU arena
   growing by ``kSameAsRequested``; on CUDA, the CUDA arena's ``kSameAsRequested`` and a ``gpu_mem_limit``
   of 1.25x the default's measured peak. Each run gives per-call latency, first-seen-shape flags, the
   process's peak RSS (and GPU memory on CUDA when NVML is there) and the trace time (sum of the calls).
4. **Choice.** A candidate is *not slower* when the median of its per-round trace-time ratios to the
   default is at most 1 + margin, margin = min(``max_slowdown``, max(1%, the default's own run-to-run
   spread)). Among those, the one whose median peak memory is lowest, by more than
   ``min_memory_saving_mb`` and more than the spread of the peaks, wins; otherwise the default stays.
5. **Recipe.** The winner goes into ``metadata_props["onnxforge.session"]`` as JSON
   (``session_options``, ``session_config``, ``provider_options``, ``warmup``), which
   ``core.runtime.load`` applies. The graph is not touched; with the default kept, nothing is written.

Notes: ``notes["shape_profile"]`` holds the ranges, the trace, every candidate's figures and a ``plot``
block (per-call latency with spikes marked, peak memory per candidate) for the report.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
from pydantic import Field, field_validator

from core.errors import PassError
from core.recipe import RECIPE_KEY
from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult

DEFAULT_BATCH = (1, 8)
DEFAULT_SEQUENCE = (8, 512)
SPIKE_FACTOR = 2.0  # a call is a spike when it takes this many times what its size predicts
MIN_TIME_MARGIN = 0.01
EXTERNAL_DATA_THRESHOLD = 1_800_000_000
_ROOT = Path(__file__).resolve().parent.parent

_BATCH_DIM = re.compile(r"^(n|b|bs|batch.*|.*_batch|batch_size|num_batches)$", re.IGNORECASE)
_SEQ_DIM = re.compile(r"(seq|sequence|len|length|tokens?|time|steps?)", re.IGNORECASE)
_MASK_NAME = re.compile(r"mask", re.IGNORECASE)
_TOKEN_TYPE_NAME = re.compile(r"token_type|segment_ids", re.IGNORECASE)
_POSITION_NAME = re.compile(r"position_ids", re.IGNORECASE)

# name -> the recipe parts it sets; "warmup": True stands for one warm-up call at the largest shape of the ranges.
CPU_CANDIDATES: dict[str, dict[str, Any]] = {
    "default": {},
    "warmup_largest": {"warmup": True},
    "mem_pattern_off": {"session_options": {"enable_mem_pattern": False}},
    "cpu_arena_off": {"session_options": {"enable_cpu_mem_arena": False}},
    "mem_pattern_off_cpu_arena_off": {"session_options": {"enable_mem_pattern": False, "enable_cpu_mem_arena": False}},
    "initializers_outside_arena": {"session_config": {"session.use_device_allocator_for_initializers": "1"}},
    "cpu_arena_same_as_requested": {
        "provider_options": {"CPUExecutionProvider": {"arena_extend_strategy": "kSameAsRequested"}}
    },
}
CUDA_CANDIDATES: dict[str, dict[str, Any]] = {
    "cuda_arena_same_as_requested": {
        "provider_options": {"CUDAExecutionProvider": {"arena_extend_strategy": "kSameAsRequested"}}
    },
    # gpu_mem_limit is filled in from the default's measured peak GPU memory (x GPU_LIMIT_FACTOR).
    "cuda_mem_limit": {"provider_options": {"CUDAExecutionProvider": {"arena_extend_strategy": "kSameAsRequested"}}},
}
GPU_LIMIT_FACTOR = 1.25


class ShapeProfileOptions(PassOptions):
    ranges: dict[str, tuple[int, int]] | None = Field(
        None,
        description="Inclusive size range per dynamic dim, keyed by dim name or role ('batch', 'sequence'); "
        "default: from the samples, else 1..8 (batch) and 8..512 (sequence, clamped to the position table).",
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


class ShapeProfile(Pass):
    name = "shape_profile"
    summary = "Measure ORT session settings on a random-size call trace; store the leanest as a load recipe."
    exact = True
    in_place = True
    Options = ShapeProfileOptions

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        options: ShapeProfileOptions = self.options  # type: ignore[assignment]
        inputs = _graph_inputs(model)
        dynamic = _dynamic_dims(inputs)
        if not dynamic:
            return PassResult(
                model,
                False,
                {"candidates_measured": 0, "recipes_written": 0},
                [NonMatch("no graph input has a dynamic dim: every call has the same shape")],
                {"decision": "skipped: no dynamic axes"},
            )
        max_positions = options.max_positions or _max_positions(model)
        dims = _dim_plan(inputs, dynamic, options, ctx.samples, max_positions)
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
            ranges = _index_ranges(model)
            feeds = [_feeds(inputs, sizes, rng, ranges) for sizes in trace]
            np.savez(trace_path, **{f"{i}/{k}": v for i, feed in enumerate(feeds) for k, v in feed.items()})
            warmup = [{i.name: list(_shape(i, largest)) for i in inputs}]
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

        elements = [math.prod(sizes.values()) for sizes in trace]  # the spike rule scales latency by it
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


# ------------------------------------------------------------------------------------- measurement


def run_child(spec: Mapping[str, Any], spec_path: Path, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run ``python -m core.runtime --measure`` on ``spec`` in a fresh process; its JSON result, or
    ``{"error": ...}`` when it failed (a candidate the runtime rejects, a crash, the time limit)."""
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "core.runtime", "--measure", str(spec_path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-500:].strip() or f"exit {proc.returncode}"}
    out = spec.get("out")
    text = Path(out).read_text(encoding="utf-8") if out else proc.stdout
    return json.loads(text)


def _recipe(candidate: Mapping[str, Any], warmup: list[dict[str, list[int]]]) -> dict[str, Any]:
    return {
        "session_options": dict(candidate.get("session_options", {})),
        "session_config": dict(candidate.get("session_config", {})),
        "provider_options": {k: dict(v) for k, v in candidate.get("provider_options", {}).items()},
        "warmup": [dict(w) for w in warmup] if candidate.get("warmup") else [],
    }


def _candidates(options: ShapeProfileOptions, target: str) -> dict[str, dict[str, Any]]:
    """Candidates to measure: the options' list (plus the default) or all that apply to the target.
    CUDA candidates only when the CUDA EP is installed and the target is a GPU one."""
    import onnxruntime as ort

    cuda = target != "cpu" and "CUDAExecutionProvider" in ort.get_available_providers()
    pool = {**CPU_CANDIDATES, **(CUDA_CANDIDATES if cuda else {})}
    names = options.candidates if options.candidates is not None else list(pool)
    chosen = {"default": {}}
    for name in names:
        if name in pool:
            chosen[name] = json.loads(json.dumps(pool[name]))
    return chosen


def _spikes(latency_ms: Sequence[float], elements: Sequence[int]) -> list[int]:
    """Calls that took more than SPIKE_FACTOR times what their size predicts (median cost per element)."""
    per = statistics.median(lat / max(n, 1) for lat, n in zip(latency_ms, elements, strict=True))
    return [i for i, (lat, n) in enumerate(zip(latency_ms, elements, strict=True)) if lat > SPIKE_FACTOR * per * n]


def _spread(values: Sequence[float]) -> float:
    """Half the range relative to the median: the run-to-run noise of a figure (0 with one run)."""
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    return (max(values) - min(values)) / 2 / med if med else 0.0


def _decide(
    runs: Mapping[str, list[dict[str, Any]]],
    candidates: Mapping[str, Mapping[str, Any]],
    options: ShapeProfileOptions,
    elements: Sequence[int],
) -> dict[str, Any]:
    default_runs = [r for r in runs["default"] if "error" not in r]
    if not default_runs:
        errors = [r["error"] for r in runs["default"]]
        raise PassError(f"the default session failed on the trace: {errors[:1]}", pass_name=ShapeProfile.name)
    calls = len(default_runs[0]["latency_ms"])
    default_times = [r["trace_s"] for r in runs["default"] if "error" not in r]
    time_noise = _spread(default_times)
    # With one run per candidate the noise is unmeasured: allow max_slowdown.
    margin = (
        min(options.max_slowdown, max(MIN_TIME_MARGIN, time_noise)) if len(default_times) > 1 else options.max_slowdown
    )
    default_peak = statistics.median(r["peak_rss_mb"] for r in default_runs)
    # Fastest-run trace time: the sum over calls of each call's fastest run (contention only adds time).
    default_best = sum(min(r["latency_ms"][i] for r in default_runs) for i in range(calls)) / 1000.0
    rows: list[dict[str, Any]] = []
    recipes: dict[str, Any] = {}
    for name, cand_runs in runs.items():
        ok = [r for r in cand_runs if "error" not in r]
        row: dict[str, Any] = {
            "name": name,
            "runs": len(cand_runs),
            "errors": [r["error"] for r in cand_runs if "error" in r],
        }
        recipes[name] = candidates[name].get("_recipe", _recipe(candidates[name], []))
        if len(ok) < len(cand_runs) or not ok:
            why = row["errors"][0][:200] if row["errors"] else "not measured (no GPU memory figure to size it)"
            row.update(eligible=False, reason=f"failed: {why}")
            rows.append(row)
            continue
        latency = [statistics.median(r["latency_ms"][i] for r in ok) for i in range(calls)]
        first_seen = [i for i in range(calls) if ok[0]["first_seen"][i]]
        spikes = _spikes(latency, elements)
        peaks = [r["peak_rss_mb"] for r in ok]
        ratios = [
            c["trace_s"] / d["trace_s"]
            for c, d in zip(cand_runs, runs["default"], strict=False)
            if "error" not in c and "error" not in d
        ]
        best = sum(min(r["latency_ms"][i] for r in ok) for i in range(calls)) / 1000.0
        gpu = [r["peak_gpu_mb"] for r in ok if r.get("peak_gpu_mb") is not None]
        row.update(
            peak_rss_mb=statistics.median(peaks),
            peak_rss_mb_runs=peaks,
            base_rss_mb=statistics.median(r["base_rss_mb"] for r in ok),
            peak_gpu_mb=statistics.median(gpu) if gpu else None,
            trace_s=statistics.median(r["trace_s"] for r in ok),
            trace_s_runs=[r["trace_s"] for r in ok],
            time_ratio=statistics.median(ratios) if ratios else 1.0,
            trace_s_best=best,
            time_ratio_best=best / default_best,
            load_s=statistics.median(r["load_s"] for r in ok),
            first_call_ms=latency[0],
            spikes=len(spikes),
            spike_excess_ms=_excess(latency, elements, spikes),
            latency_ms=latency,
            spike_calls=spikes,
            first_seen_calls=first_seen,
        )
        mem_noise = max(
            _spread(peaks) * row["peak_rss_mb"], _spread([r["peak_rss_mb"] for r in default_runs]) * default_peak
        )
        row["memory_saving_mb"] = default_peak - row["peak_rss_mb"]
        if name == "default":
            row.update(eligible=True, reason="ORT's defaults (the reference)")
        elif row["time_ratio"] > 1 + margin:
            row.update(eligible=False, reason=f"slower: trace time x{row['time_ratio']:.3f} > 1 + margin {margin:.3f}")
        elif row["time_ratio_best"] > 1 + options.max_slowdown:
            row.update(
                eligible=False,
                reason=f"slower: fastest-run trace time x{row['time_ratio_best']:.3f} > 1 + {options.max_slowdown}",
            )
        elif row["memory_saving_mb"] <= max(options.min_memory_saving_mb, 2 * mem_noise):
            row.update(
                eligible=False,
                reason=f"peak memory {row['peak_rss_mb']:.1f} MiB does not beat the default's {default_peak:.1f} MiB "
                f"by more than {max(options.min_memory_saving_mb, 2 * mem_noise):.1f} MiB",
            )
        else:
            row.update(eligible=True, reason=f"saves {row['memory_saving_mb']:.1f} MiB, trace x{row['time_ratio']:.3f}")
        rows.append(row)
    winners = sorted(
        (r for r in rows if r["eligible"] and r["name"] != "default"),
        key=lambda r: (r["peak_rss_mb"], r["time_ratio"]),
    )
    chosen = winners[0]["name"] if winners else "default"
    if chosen == "default":
        decision = "kept ORT's defaults: no candidate lowered peak memory without slowing the trace"
    else:
        best = winners[0]
        decision = (
            f"recipe {chosen}: peak RSS {best['peak_rss_mb']:.1f} MiB vs {default_peak:.1f} MiB (default), "
            f"trace time x{best['time_ratio']:.3f} (margin {margin:.3f})"
        )
    plot = {
        "latency": {
            "x": "call",
            "y": "latency_ms",
            "series": [
                {
                    "name": r["name"],
                    "chosen": r["name"] == chosen,
                    "latency_ms": r["latency_ms"],
                    "spikes": r["spike_calls"],
                    "first_seen": r["first_seen_calls"],
                }
                for r in rows
                if "latency_ms" in r
            ],
        },
        "peak_memory": {
            "y": "peak_rss_mb",
            "bars": [
                {"name": r["name"], "chosen": r["name"] == chosen, "peak_rss_mb": r["peak_rss_mb"],
                 "peak_gpu_mb": r["peak_gpu_mb"]}
                for r in rows
                if "peak_rss_mb" in r
            ],
        },
    }  # fmt: skip
    return {
        "chosen": chosen,
        "decision": decision,
        "margin": margin,
        "noise": {"trace_time": time_noise},
        "default": {
            "peak_rss_mb": default_peak,
            "trace_s": statistics.median(default_times),
            "trace_s_best": default_best,
        },
        "candidates": [{k: v for k, v in r.items() if k not in ("latency_ms",)} for r in rows],
        "recipes": recipes,
        "plot": plot,
    }


def _excess(latency: Sequence[float], elements: Sequence[int], spikes: Sequence[int]) -> float:
    per = statistics.median(lat / max(n, 1) for lat, n in zip(latency, elements, strict=True))
    return float(sum(latency[i] - per * elements[i] for i in spikes))


# ------------------------------------------------------------------------------------- the graph


class _Input:
    def __init__(self, name: str, dtype: np.dtype[Any], dims: list[int | str]) -> None:
        self.name = name
        self.dtype = dtype
        self.dims = dims  # int: fixed; str: a dynamic dim's name (unnamed ones get "<input>:<axis>")


def _graph_inputs(model: ir.Model) -> list[_Input]:
    initializers = set(model.graph.initializers)
    out = []
    for value in model.graph.inputs:
        if value.name in initializers or value.dtype is None or value.shape is None:
            continue
        dims: list[int | str] = []
        for axis, dim in enumerate(value.shape):
            if isinstance(dim, int):
                dims.append(dim)
            else:
                dims.append(dim.value if dim.value else f"{value.name}:{axis}")
        out.append(_Input(value.name, np.dtype(value.dtype.numpy()), dims))
    return out


def _dynamic_dims(inputs: Sequence[_Input]) -> dict[str, str]:
    """Dynamic dim name -> role ('batch' or 'sequence'), in order of first appearance."""
    roles: dict[str, str] = {}
    for spec in inputs:
        for axis, dim in enumerate(spec.dims):
            if isinstance(dim, str) and dim not in roles:
                if _BATCH_DIM.match(dim):
                    roles[dim] = "batch"
                elif _SEQ_DIM.search(dim):
                    roles[dim] = "sequence"
                else:
                    roles[dim] = "batch" if axis == 0 else "sequence"
    return roles


def _max_positions(model: ir.Model) -> int | None:
    """Rows of the position-embedding table (a constant named like ``position_embeddings`` read by a
    Gather, or a ``position_ids`` buffer [1, N]), else None."""
    sizes = []
    for name, value in model.graph.initializers.items():
        shape = value.shape
        if shape is None or not all(isinstance(d, int) for d in shape):
            continue
        lower = name.lower()
        if "position_embeddings" in lower and len(shape) == 2:
            sizes.append(int(shape[0]))
        elif "position_ids" in lower and len(shape) == 2 and shape[0] == 1:
            sizes.append(int(shape[1]))
    return min(sizes) if sizes else None


def _dim_plan(
    inputs: Sequence[_Input],
    dynamic: Mapping[str, str],
    options: ShapeProfileOptions,
    samples: Sequence[Mapping[str, np.ndarray]],
    max_positions: int | None,
) -> dict[str, dict[str, Any]]:
    """Per dynamic dim: role, inclusive range (and buckets when given), and where they came from."""
    axes = {(spec.name, axis): dim for spec in inputs for axis, dim in enumerate(spec.dims) if isinstance(dim, str)}
    seen: dict[str, set[int]] = {name: set() for name in dynamic}
    for sample in samples:
        for name, array in sample.items():
            for axis, size in enumerate(np.shape(array)):
                dim = axes.get((name, axis))
                if dim is not None:
                    seen[dim].add(int(size))
    plan: dict[str, dict[str, Any]] = {}
    for dim, role in dynamic.items():
        cap = max_positions if role == "sequence" else None
        buckets = (options.buckets or {}).get(dim) or (options.buckets or {}).get(role)
        given = (options.ranges or {}).get(dim) or (options.ranges or {}).get(role)
        entry: dict[str, Any] = {"role": role, "buckets": None}
        if buckets:
            sizes = sorted({min(s, cap) if cap else s for s in buckets})
            entry.update(range=[sizes[0], sizes[-1]], buckets=sizes, source="option")
        elif given:
            entry.update(range=list(given), source="option")
        elif len(seen[dim]) >= 2:
            entry.update(range=[min(seen[dim]), max(seen[dim])], source="samples")
        else:
            entry.update(range=list(DEFAULT_BATCH if role == "batch" else DEFAULT_SEQUENCE), source="default")
        if cap and entry["range"][1] > cap:
            entry["range"] = [min(entry["range"][0], cap), cap]
            entry["clamped_to"] = cap
        plan[dim] = entry
    return plan


def _draw(dims: Mapping[str, Mapping[str, Any]], rng: np.random.Generator) -> dict[str, int]:
    sizes = {}
    for name, plan in dims.items():
        if plan["buckets"]:
            sizes[name] = int(rng.choice(plan["buckets"]))
        else:
            lo, hi = plan["range"]
            sizes[name] = int(rng.integers(lo, hi + 1))
    return sizes


def _shape(spec: _Input, sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else sizes[d] for d in spec.dims)


def _index_ranges(model: ir.Model) -> dict[str, int]:
    """Graph inputs read (directly or through a Cast) as Gather indices into a constant table: its rows."""
    aliases = {v.name: v.name for v in model.graph.inputs}
    ranges: dict[str, int] = {}
    for node in model.graph:
        if node.op_type in ("Cast", "Identity", "Unsqueeze", "Reshape") and node.inputs and node.inputs[0] is not None:
            source = aliases.get(node.inputs[0].name)
            if source is not None:
                aliases[node.outputs[0].name] = source
        if node.op_type == "Gather" and len(node.inputs) >= 2 and node.inputs[0] is not None and node.inputs[1]:
            source = aliases.get(node.inputs[1].name)
            table = node.inputs[0]
            if source is None or table.const_value is None or table.shape is None or not len(table.shape):
                continue
            rows = table.shape[0]
            if isinstance(rows, int):
                ranges[source] = min(ranges.get(source, rows), rows)
    return ranges


def _feeds(
    inputs: Sequence[_Input], sizes: Mapping[str, int], rng: np.random.Generator, ranges: Mapping[str, int]
) -> dict[str, np.ndarray]:
    feeds = {}
    for spec in inputs:
        shape = _shape(spec, sizes)
        kind = spec.dtype.kind
        if _MASK_NAME.search(spec.name) and kind in "biuf":
            seq = shape[-1] if shape else 1
            rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
            lengths = rng.integers(1, seq + 1, size=rows) if seq else np.zeros(rows, np.int64)
            if rows:
                lengths[0] = seq
            mask = np.arange(seq)[None, :] < lengths[:, None]
            feeds[spec.name] = mask.reshape(shape).astype(spec.dtype)
        elif kind == "b":
            feeds[spec.name] = np.ones(shape, dtype=bool)
        elif kind in "iu":
            if _TOKEN_TYPE_NAME.search(spec.name):
                feeds[spec.name] = np.zeros(shape, dtype=spec.dtype)
            elif _POSITION_NAME.search(spec.name) and shape:
                feeds[spec.name] = np.broadcast_to(np.arange(shape[-1]), shape).astype(spec.dtype)
            else:
                high = ranges.get(spec.name, 100)
                feeds[spec.name] = rng.integers(0, max(high, 1), size=shape).astype(spec.dtype)
        elif kind == "f":
            feeds[spec.name] = rng.standard_normal(size=shape).astype(spec.dtype)
        else:
            raise PassError(f"input {spec.name!r} of dtype {spec.dtype}: no trace inputs can be made")
    return feeds


def _save_copy(model: ir.Model, path: Path) -> None:
    """The model as the children load it, without an earlier recipe (each candidate brings its own)."""
    saved = model.metadata_props.pop(RECIPE_KEY, None)
    try:
        size = sum(int(v.const_value.nbytes) for v in model.graph.initializers.values() if v.const_value is not None)
        if size > EXTERNAL_DATA_THRESHOLD:
            ir.save(model, path, external_data=path.name + ".data", size_threshold_bytes=1024)
        else:
            ir.save(model, path)
    finally:
        if saved is not None:
            model.metadata_props[RECIPE_KEY] = saved
    with contextlib.suppress(OSError):
        os.chmod(path, 0o600)
