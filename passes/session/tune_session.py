"""tune_session: measure ONNX Runtime session configurations on the samples and keep the fastest as a recipe.

The graph is not changed. What ORT's ``perf_test`` tuning and Olive's ``OrtSessionParamsTuning`` explore,
measured interleaved (so a noisy neighbour hits every candidate alike) on the context's samples: intra-op
threads, execution mode, graph optimization level, thread spinning, and on GPU the EP options (CUDA: cuDNN
conv algorithm search, TunableOp; TensorRT: fp16 when allowed, workspace, engine and timing cache). A
coordinate descent starts from ORT's defaults and adopts an alternative only when it is faster beyond noise
(``core.verdict``: median paired ratio below 1 - max(3%, bootstrap half-width)). The timing is the engine's
(``ctx.measure``, ``passes._infra.Measure``): the same interleaved benchmark the ledger uses, on sessions made
as users get them; without it (the pass called outside the pipeline) the pass declines.

The winner is written into the model's ``metadata_props`` under ``onnxforge.session`` as JSON::

    {"session_options": {"intra_op_num_threads": 2, "execution_mode": "ORT_SEQUENTIAL",
                         "graph_optimization_level": "ORT_ENABLE_ALL"},
     "session_config":   {"session.intra_op.allow_spinning": "1"},
     "provider_options": {"CUDAExecutionProvider": {"cudnn_conv_algo_search": "HEURISTIC"}}}

``apply_recipe`` turns it back into ``SessionOptions`` and a provider list (``core.runtime.load``
applies the same key); the pipeline benchmarks the final model with it, so the gate measures what users
run. Default options fastest within noise: no change (no key written), except on TensorRT, whose engine
and timing caches always pay on the next session (ORT PR #14767: 108.6 s -> 9.4 s builds).

::

    model --(graph unchanged)--> model + metadata_props["onnxforge.session"] = recipe JSON
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx_ir as ir
from pydantic import Field

from core.recipe import RECIPE_KEY, default_recipe, recipe_of
from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult


class TuneSessionOptions(PassOptions):
    threads: list[int] | None = Field(
        None, description="intra_op_num_threads candidates (0: ORT default); None: 0, 1, cores/2 and cores."
    )
    execution_modes: bool = Field(True, description="Try ORT_PARALLEL (inter-op threads) besides ORT_SEQUENTIAL.")
    optimization_levels: bool = Field(True, description="Try ORT_ENABLE_EXTENDED and ORT_ENABLE_BASIC.")
    spinning: bool = Field(True, description="Try session.intra_op.allow_spinning=0 (helps on shared CPUs).")
    allow_trt_fp16: bool = Field(
        False, description="TensorRT: try trt_fp16_enable (not exact; the ledger verifies the artifact only)."
    )
    trt_cache_dir: str = Field(
        "trt_cache", description="TensorRT engine and timing cache directory written into the recipe (relative)."
    )
    runs: int = Field(20, ge=3, description="Timed runs per candidate per sample set (interleaved pairs).")
    max_seconds: float = Field(60.0, gt=0, description="Time budget of the whole search; stops adopting after.")
    write_default: bool = Field(
        False, description="Write the recipe even when the starting options win, so the artifact names its session."
    )


def _variants(recipe: dict[str, Any], section: str, key: str, values: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for value in values:
        new = json.loads(json.dumps(recipe))
        if section == "provider_options":
            provider, option = key.split(":", 1)
            new[section].setdefault(provider, {})[option] = value
        else:
            new[section][key] = value
        if new != recipe:
            out.append(new)
    return out


class TuneSession(Pass[TuneSessionOptions]):
    name = "tune_session"
    summary = "Measure ORT session settings (threads, modes, levels, EP options); store the fastest as a recipe."
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        opts = self.options
        if not ctx.samples:
            return PassResult(model, False, {"candidates": 0}, [NonMatch("no samples to measure sessions on")])
        if ctx.measure is None:
            reason = "no latency measurement in the context (the pipeline provides one)"
            return PassResult(model, False, {"candidates": 0}, [NonMatch(reason)])
        target = ctx.target
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = opts.threads if opts.threads is not None else sorted({0, 1, max(1, cores // 2), cores})
        axes: list[tuple[str, str, list[Any]]] = [("session_options", "intra_op_num_threads", threads)]
        if opts.spinning:
            axes.append(("session_config", "session.intra_op.allow_spinning", ["0"]))
        if opts.execution_modes:
            axes.append(("session_options", "execution_mode", ["ORT_PARALLEL"]))
        if opts.optimization_levels:
            axes.append(("session_options", "graph_optimization_level", ["ORT_ENABLE_EXTENDED", "ORT_ENABLE_BASIC"]))
        if target == "cuda":
            axes += [
                ("provider_options", "CUDAExecutionProvider:cudnn_conv_algo_search", ["HEURISTIC", "DEFAULT"]),
                ("provider_options", "CUDAExecutionProvider:tunable_op_enable", ["1"]),
            ]
        # Start from the recipe another pass (shape_profile) may have written; its other keys (warmup) stay.
        existing = recipe_of(model) or {}
        recipe = default_recipe(target)
        for section in ("session_options", "session_config", "provider_options"):
            recipe[section].update(existing.get(section) or {})
        start = json.loads(json.dumps(recipe))
        if target == "tensorrt":
            trt = recipe["provider_options"]["TensorrtExecutionProvider"]
            trt.update(
                trt_engine_cache_enable="1",
                trt_engine_cache_path=opts.trt_cache_dir,
                trt_timing_cache_enable="1",
                trt_timing_cache_path=opts.trt_cache_dir,
                trt_max_workspace_size=str(4 << 30),
            )
            if opts.allow_trt_fp16:
                axes.append(("provider_options", "TensorrtExecutionProvider:trt_fp16_enable", ["1"]))
        feeds = [dict(s) for s in ctx.samples[:3]]
        tried: list[dict[str, Any]] = []
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="onnxforge-tune-") as tmp:
            path = Path(tmp) / "model.onnx"
            ir.save(model, path, external_data="model.onnx.data", size_threshold_bytes=1 << 20)
            for section, key, values in axes:
                for candidate in _variants(recipe, section, key, values):
                    if candidate["session_options"].get("execution_mode") == "ORT_PARALLEL":
                        candidate["session_options"]["inter_op_num_threads"] = max(2, cores)
                    if time.perf_counter() - started > opts.max_seconds:
                        tried.append({"recipe": candidate, "skipped": "time budget spent"})
                        continue
                    try:
                        verdict = ctx.measure(path, path, feeds, runs=opts.runs, recipe_a=recipe, recipe_b=candidate)
                        faster, ratio = verdict.faster, verdict.ratio
                    except Exception as exc:  # a candidate ORT refuses (e.g. an EP option) is just not taken
                        tried.append({"recipe": candidate, "error": f"{type(exc).__name__}: {exc}"[:300]})
                        continue
                    tried.append({"recipe": candidate, "ratio_vs_best": round(ratio, 4), "adopted": faster})
                    if faster:
                        recipe = candidate
        notes = {"recipe": recipe, "candidates": tried, "search_s": round(time.perf_counter() - started, 3)}
        counts = {"candidates": len(tried), "adopted": sum(1 for t in tried if t.get("adopted"))}
        if recipe == start and target != "tensorrt" and not opts.write_default:
            reason = "the starting session options (ORT's defaults or the stored recipe) are the fastest within noise"
            return PassResult(model, False, counts, [NonMatch(reason)], notes)
        model.metadata_props[RECIPE_KEY] = json.dumps({**existing, **recipe}, sort_keys=True, separators=(",", ":"))
        return PassResult(model, True, counts, [], notes)
