"""shape_profile's measurement and decision: each candidate replays the trace in a fresh process, and the
leanest candidate that is not slower wins (the rule is in ``passes/session/shape_profile.py``'s docstring).

Memory is the trace's own: the measurement child restarts the kernel's RSS high-water mark once the
session is loaded, so ``serving_mb`` (trace peak above the process's RSS before the load) counts the
session's weights, its arena's growth and the per-shape buffers, not the transient peak of parsing the
model, which dominated the process's peak RSS and hid every difference between candidates.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from core.errors import PassError

SPIKE_FACTOR = 2.0  # a call is a spike when it takes this many times what its size predicts
MIN_TIME_MARGIN = 0.01
_ROOT = Path(__file__).resolve().parent.parent.parent
PASS_NAME = "shape_profile"

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


def _candidates(options: Any, target: str) -> dict[str, dict[str, Any]]:
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


def serving_mb(run: Mapping[str, Any]) -> float:
    """The memory a run's session held while serving the trace: its trace peak above the RSS before the
    load (weights, arena growth, per-shape buffers), without the load's transient peak. A child that
    reports no trace peak falls back to the process's peak RSS."""
    if run.get("trace_peak_rss_mb") is not None and run.get("base_rss_mb") is not None:
        return float(run["trace_peak_rss_mb"]) - float(run["base_rss_mb"])
    return float(run["peak_rss_mb"])


def _decide(
    runs: Mapping[str, list[dict[str, Any]]],
    candidates: Mapping[str, Mapping[str, Any]],
    options: Any,
    elements: Sequence[int],
) -> dict[str, Any]:
    default_runs = [r for r in runs["default"] if "error" not in r]
    if not default_runs:
        errors = [r["error"] for r in runs["default"]]
        raise PassError(f"the default session failed on the trace: {errors[:1]}", pass_name=PASS_NAME)
    calls = len(default_runs[0]["latency_ms"])
    default_times = [r["trace_s"] for r in runs["default"] if "error" not in r]
    time_noise = _spread(default_times)
    # With one run per candidate the noise is unmeasured: allow max_slowdown.
    margin = (
        min(options.max_slowdown, max(MIN_TIME_MARGIN, time_noise)) if len(default_times) > 1 else options.max_slowdown
    )
    default_peak = statistics.median(serving_mb(r) for r in default_runs)
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
        peaks = [serving_mb(r) for r in ok]
        growth = [r["trace_peak_rss_mb"] - r["loaded_rss_mb"] for r in ok if r.get("loaded_rss_mb") is not None]
        ratios = [
            c["trace_s"] / d["trace_s"]
            for c, d in zip(cand_runs, runs["default"], strict=False)
            if "error" not in c and "error" not in d
        ]
        best = sum(min(r["latency_ms"][i] for r in ok) for i in range(calls)) / 1000.0
        gpu = [r["peak_gpu_mb"] for r in ok if r.get("peak_gpu_mb") is not None]
        row.update(
            serving_mb=statistics.median(peaks),
            serving_mb_runs=peaks,
            arena_growth_mb=statistics.median(growth) if growth else None,
            peak_rss_mb=statistics.median(r["peak_rss_mb"] for r in ok),
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
            _spread(peaks) * row["serving_mb"], _spread([serving_mb(r) for r in default_runs]) * default_peak
        )
        row["memory_saving_mb"] = default_peak - row["serving_mb"]
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
                reason=f"serving memory {row['serving_mb']:.1f} MiB does not beat the default's {default_peak:.1f} MiB "
                f"by more than {max(options.min_memory_saving_mb, 2 * mem_noise):.1f} MiB",
            )
        else:
            row.update(eligible=True, reason=f"saves {row['memory_saving_mb']:.1f} MiB, trace x{row['time_ratio']:.3f}")
        rows.append(row)
    winners = sorted(
        (r for r in rows if r["eligible"] and r["name"] != "default"),
        key=lambda r: (r["serving_mb"], r["time_ratio"]),
    )
    chosen = winners[0]["name"] if winners else "default"
    if chosen == "default":
        decision = "kept ORT's defaults: no candidate lowered serving memory without slowing the trace"
    else:
        best = winners[0]
        decision = (
            f"recipe {chosen}: serving memory {best['serving_mb']:.1f} MiB vs {default_peak:.1f} MiB (default), "
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
            "y": "serving_mb",
            "bars": [
                {"name": r["name"], "chosen": r["name"] == chosen, "peak_rss_mb": r["peak_rss_mb"],
                 "serving_mb": r["serving_mb"], "arena_growth_mb": r["arena_growth_mb"],
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
            "serving_mb": default_peak,
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in default_runs),
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
