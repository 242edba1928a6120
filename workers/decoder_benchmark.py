"""Prefill and decode figures of a decoder with a KV cache: the original and the returned model side by side.

::

    weights  bytes of every initializer, external data included (nothing read: sizes from dtype and shape)
    memory   one child process per model, both at once, before anything is timed (workers/decoder_memory.py):
             VmRSS before its session, VmHWM once built (the load), then VmHWM reset and read after the
             longest prefill and the decode (the runs): neither the other model nor the load passes for a
             session's run peak
    prefill  a prompt of each length (config.decoder_benchmark.prompt_lengths, clipped to the position table)
             on an empty past: workers.benchmark.compare, interleaved A/B blocks alternating the order, medians
    decode   a prefill of the decode prompt, then new_tokens steps of one token each: every step's present.*
             is the next step's past and the mask spans past + new; both models step in lockstep (the order
             alternates per step and per block), blocks repeat until the time budget; medians per position

The budget (``time_budget_s``) is shared out in that order (memory until 40%, prefill until 70%, decode until
100%); a timed phase whose share is spent still does one block, and says so in ``notes``. Inputs come from
``core.inputs`` (the roles the graph gives them, the sizes bound here); the token ids are random, not fed
back, which changes no latency. Sessions come from a ``SessionPool`` (ORT_ENABLE_ALL, each model's session
recipe) with host feeds: a generate loop copies the cache in and out. Every skip or early stop is a sentence
in the section (``reason``, ``notes``); an error never fails the job.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from core.config import DecoderBenchmark, JobConfig
from core.inputs import InputSet, InputSynthesis, cache_pairs
from core.recipe import read_recipe
from workers.benchmark import BenchmarkParams, SessionPool, compare
from workers.decoder_memory import measure_memory

if TYPE_CHECKING:
    from core.settings import PipelineSettings

PREFILL_MIN_BLOCKS = 5
PREFILL_MAX_BLOCKS = 200
DECODE_MIN_BLOCKS = 3
DECODE_MAX_BLOCKS = 15
# Shares of the budget: the memory children until 40%, sessions and prefill until 70%, decode blocks start
# until it is spent. Each timed phase does its minimum (one block) even when its share is gone.
MEMORY_SHARE = 0.4
PREFILL_UNTIL = 0.7


# ------------------------------------------------------------------------------------------- the plan


@dataclasses.dataclass
class Plan:
    """How to feed one decoder: the dims to bind and which present output becomes which past input."""

    synthesis: InputSynthesis
    batch_dim: str | None
    sequence_dim: str
    past_dim: str
    mask_dims: list[str]
    cache: dict[str, str]  # past input -> present output
    max_positions: int | None
    # A seq2seq decoder's dims over the encoder's sequence (encoder states, the cross-attention cache and
    # mask): one source length for the whole run, never growing with the decoder's tokens.
    encoder_dims: list[str] = dataclasses.field(default_factory=list)
    encoder_length: int = 128

    def feeds(self, new: int, past: int, seed: int) -> dict[str, np.ndarray]:
        """Every input for ``new`` tokens after a past of ``past`` (the past random, for a prefill)."""
        sizes = {self.sequence_dim: new, self.past_dim: past, **dict.fromkeys(self.mask_dims, past + new)}
        sizes.update(dict.fromkeys(self.encoder_dims, self.encoder_length))
        if self.batch_dim is not None:
            sizes[self.batch_dim] = 1
        return self.synthesis.feeds_for_sizes(sizes, np.random.default_rng(seed))

    def step_inputs(self, prompt: int, tokens: int, seed: int) -> list[dict[str, np.ndarray]]:
        """The inputs of each decode step other than the cache: one token after ``prompt + i``."""
        steps = []
        for i in range(tokens):
            feed = self.feeds(1, prompt + i, seed + i)
            steps.append({k: v for k, v in feed.items() if k not in self.cache})
        return steps


def make_plan(model: ir.Model, seed: int = 0) -> Plan | str:
    """The plan for ``model``, or why it is not a decoder this benchmark can drive."""
    synthesis = InputSynthesis(model, seed=seed)
    roles = synthesis.facts.roles
    pasts = [n for n, r in roles.items() if r.role == "past_key_values"]
    if not pasts:
        return "the model has no past key/value inputs: not a decoder with a KV cache"
    specs = {s.name: s for s in synthesis.specs}
    ids = next((n for n, r in roles.items() if r.role == "token_ids"), None)
    if ids is None or specs[ids].rank != 2 or not isinstance(specs[ids].dims[1], str):
        return "no token-id input [batch, sequence] with a symbolic sequence length"
    past_dims = {specs[p].dims[roles[p].past_axis or 0] for p in pasts}
    if len(past_dims) != 1 or not isinstance(next(iter(past_dims)), str):
        return f"the past inputs do not share one symbolic past length (dims {sorted(map(str, past_dims))})"
    free = synthesis.free_dims()
    batch = next((d for d, plan in free.items() if plan["role"] == "batch"), None)
    masks = [
        str(specs[n].dims[-1])
        for n, r in roles.items()
        if r.role == "attention_mask" and not r.cross and specs[n].dims and isinstance(specs[n].dims[-1], str)
    ]
    encoder = {
        str(specs[n].dims[axis]) for n, axis in synthesis.encoder_axes().items() if isinstance(specs[n].dims[axis], str)
    }
    outputs = [v.name or "" for v in model.graph.outputs]
    cache = cache_pairs(pasts, outputs)
    if isinstance(cache, str):
        return cache
    return Plan(
        synthesis,
        batch,
        str(specs[ids].dims[1]),
        str(next(iter(past_dims))),
        [d for d in masks if d not in (specs[ids].dims[1], *past_dims, *encoder)],
        cache,
        synthesis.facts.max_positions,
        sorted(encoder - {specs[ids].dims[1], *past_dims}),
    )


def weight_bytes(model: ir.Model) -> dict[str, int]:
    """Bytes of every initializer of every graph (external data included, computed from dtype and shape)."""
    total = external = count = 0
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if tensor is None:
                continue
            count += 1
            total += int(tensor.nbytes)
            if isinstance(tensor, ir.ExternalTensor):
                external += int(tensor.nbytes)
    return {"bytes": total, "external_bytes": external, "initializers": count}


def _lengths(options: DecoderBenchmark, cap: int | None, notes: list[str]) -> tuple[list[int], int, int]:
    """(prefill lengths, decode prompt, decode tokens) within the position table: the same margin as
    core.inputs keeps (tables that start two rows in, RoBERTa and OPT)."""
    tokens = options.new_tokens
    if cap is None:
        lengths = sorted(options.prompt_lengths)
        return lengths, lengths[0], tokens
    limit = cap - 2 if cap > 4 else cap
    lengths = sorted({min(n, limit) for n in options.prompt_lengths})
    if lengths != sorted(options.prompt_lengths):
        notes.append(f"prompt lengths {options.prompt_lengths} clipped to {lengths}: the position table has {cap} rows")
    tokens = min(tokens, limit - 1)
    prompt = max(1, min(lengths[0], limit - tokens))
    if tokens != options.new_tokens:
        notes.append(f"new_tokens {options.new_tokens} clipped to {tokens} by the {cap}-row position table")
    return lengths, prompt, tokens


# ----------------------------------------------------------------------------------------- measuring


class _Stepper:
    """One model's decode: feeds a step's inputs with its cache, times the run, keeps the next cache."""

    def __init__(self, session: Any, plan: Plan, start: dict[str, np.ndarray]) -> None:
        self.session, self.cache_map = session, plan.cache
        self.names = [o.name for o in session.get_outputs()]
        first = next(iter(plan.cache))
        self.axis = plan.synthesis.facts.roles[first].past_axis or 0
        self.first = first
        self.start = self._cache(session.run(None, start))

    def _cache(self, outputs: list[np.ndarray]) -> dict[str, np.ndarray]:
        by_name = dict(zip(self.names, outputs, strict=True))
        return {past: by_name[present] for past, present in self.cache_map.items()}

    def past_length(self, cache: Mapping[str, np.ndarray]) -> int:
        """Read from the array fed, not computed: the report shows the cache really grows."""
        return int(cache[self.first].shape[self.axis])

    def step(self, inputs: dict[str, np.ndarray], cache: dict[str, np.ndarray]) -> tuple[float, dict, int]:
        feed = {**inputs, **cache}
        begin = time.perf_counter_ns()
        outputs = self.session.run(None, feed)
        ms = (time.perf_counter_ns() - begin) / 1e6
        return ms, self._cache(outputs), self.past_length(cache)


def _decode_blocks(
    sessions: tuple[Any, Any], plan: Plan, start: dict[str, np.ndarray], steps: list[dict], deadline: float
) -> tuple[list[np.ndarray], list[list[int]], str]:
    """Both models decode ``steps`` in lockstep from their own prefill cache, block after block; per model a
    [blocks, steps] array of step times and the past lengths fed, and what stopped the blocks."""
    steppers = [_Stepper(session, plan, start) for session in sessions]
    for stepper in steppers:  # one untimed pass: the arena grows to the longest cache before timing
        cache = stepper.start
        for inputs in steps:
            _, cache, _ = stepper.step(inputs, cache)
    times: list[list[list[float]]] = [[], []]
    pasts: list[list[int]] = [[], []]
    stopped = "max blocks"
    for block in range(DECODE_MAX_BLOCKS):
        if block >= 1 and time.perf_counter() >= deadline:
            stopped = "time budget"
            break
        caches = [s.start for s in steppers]
        rows: list[list[float]] = [[], []]
        for i, inputs in enumerate(steps):
            for m in (0, 1) if (block + i) % 2 == 0 else (1, 0):
                ms, caches[m], past = steppers[m].step(inputs, caches[m])
                rows[m].append(ms)
                if block == 0:
                    pasts[m].append(past)
        for m in (0, 1):
            times[m].append(rows[m])
    return [np.asarray(t) for t in times], pasts, stopped


def _decode_entry(times: np.ndarray, pasts: list[int]) -> dict[str, Any]:
    # Medians per position first: a block's mean takes every step the scheduler preempted on a shared host
    # (on a loaded 2-core machine most blocks hold one), and one such step outweighs thirty fast ones.
    per_position = np.median(times, axis=0)
    ms = float(per_position.mean())
    return {
        "ms_per_token": ms,
        "tokens_per_s": 1000.0 / ms if ms > 0 else None,
        "per_position_ms": [float(v) for v in per_position],
        "past_lengths": pasts,
    }


def _decode_section(
    sessions: tuple[Any, Any],
    *,
    plan: Plan,
    start: dict[str, np.ndarray],
    steps: list[dict[str, np.ndarray]],
    prompt: int,
    past: int,
    deadline: float,
    notes: list[str],
) -> dict[str, Any] | None:
    """The ``decode`` figures, or None with the reason in ``notes``."""
    try:
        times, pasts, stopped = _decode_blocks(sessions, plan, start, steps, deadline)
    except Exception as exc:  # e.g. a sliding-window cache that stops growing: prefill figures still stand
        notes.append(f"decode not measured: {type(exc).__name__}: {str(exc)[:300]}")
        return None
    grown = pasts[0][0] if pasts[0] else None
    if grown != prompt + past:
        notes.append(
            f"decode: the cache after a prefill of {prompt} tokens holds {grown} positions, not {prompt + past}"
        )
    blocks = int(times[0].shape[0])
    if stopped == "time budget" and blocks < DECODE_MIN_BLOCKS:
        notes.append(f"decode stopped after {blocks} block(s): the time budget was spent")
    a, b = (_decode_entry(t, p) for t, p in zip(times, pasts, strict=True))
    return {
        "prompt_length": prompt,
        "new_tokens": len(steps),
        "blocks": blocks,
        "stopped_by": stopped,
        "original": a,
        "optimized": b,
        "speedup": a["ms_per_token"] / b["ms_per_token"] if b["ms_per_token"] else None,
        "paired_ratio": float(np.median(times[1] / times[0])),  # per step: the two runs were adjacent in time
    }


# --------------------------------------------------------------------------------------- the section


def _prefill(
    paths: tuple[Path, Path],
    recipes: tuple[Any, Any],
    plan: Plan,
    lengths: list[int],
    *,
    params: BenchmarkParams,
    pool: SessionPool,
    seed: int,
    until: float,
    notes: list[str],
) -> tuple[list[dict[str, Any]], list[dict[str, np.ndarray]], int]:
    """Prefill entries at each prompt length on an empty past (a past of 1 where the graph refuses one),
    timed by ``workers.benchmark.compare`` on the pool's sessions; as many blocks as fit before ``until``
    (one run of each estimated first), at least one. Returns the entries, the feeds and the past length."""
    past = 0
    sets = [InputSet(f"prompt {n}", plan.feeds(n, past, seed + n)) for n in lengths]
    try:
        pool.runs(paths[0], [s.feeds for s in sets], params, recipes[0])
    except Exception as exc:  # a graph that cannot take an empty past (a zero-size dim): one token of past
        past = 1
        notes.append(f"an empty past was refused ({type(exc).__name__}), so prefill runs on a past of 1")
        sets = [InputSet(f"prompt {n}", plan.feeds(n, past, seed + n)) for n in lengths]
    feeds = [s.feeds for s in sets]
    runs = [pool.runs(path, feeds, params, recipe)[0] for path, recipe in zip(paths, recipes, strict=True)]
    one_block = 0.0
    for index in range(len(sets)):
        for run in runs:
            begin = time.perf_counter()
            run.select(index)()
            one_block += time.perf_counter() - begin
    left = until - time.perf_counter()
    blocks = max(1, min(PREFILL_MIN_BLOCKS, int(left / one_block) if one_block > 0 else PREFILL_MIN_BLOCKS))
    if blocks < PREFILL_MIN_BLOCKS:
        notes.append(
            f"prefill: {blocks} block(s) per prompt length, not {PREFILL_MIN_BLOCKS}: one block of every length "
            f"takes {one_block:.2f} s and the budget left {max(left, 0.0):.2f} s"
        )
    params = dataclasses.replace(params, min_runs=blocks, max_seconds=max(left, 0.0) / len(sets))
    comparison = compare(*paths, sets, params, recipe_a=recipes[0], recipe_b=recipes[1], pool=pool)
    entries = [
        {
            "prompt_length": n,
            "past_length": past,
            "original": s.a.to_dict(),
            "optimized": s.b.to_dict(),
            "speedup": s.verdict.speedup,
            "paired_ratio": s.verdict.paired_ratio,
            "ci95": list(s.verdict.ci95),
            "stopped_by": s.stopped_by,
        }
        for n, s in zip(lengths, comparison.shapes, strict=True)
    ]
    return entries, feeds, past


FIGURES = ("prompt_lengths", "prefill", "decode", "weights", "memory")


def skipped(reason: str, status: str = "skipped") -> dict[str, Any]:
    """A section without figures: ``skipped`` (not a decoder, or not asked for) or ``failed`` (an error)."""
    return {"status": status, "reason": reason, "notes": [], **dict.fromkeys(FIGURES)}


def decoder_section(
    source: Path,
    returned: Path,
    config: JobConfig,
    settings: PipelineSettings,
    *,
    failed: bool,
    input_sets: Sequence[InputSet] = (),
    same_model: bool = False,
) -> dict[str, Any]:
    """The pipeline's stage: the section for the upload and the model the job hands back. ``input_sets``: the
    job's, whose recorded roles tell an encoder apart without parsing a large model again; ``same_model``: the
    job hands the upload back, so both columns time the same bytes."""
    options = config.decoder_benchmark
    roles = [s.provenance.get("inputs") for s in input_sets]
    reason = (
        "config.decoder_benchmark.enabled is false"
        if not options.enabled
        else "config.benchmark is false"
        if not config.benchmark
        else "the job failed: no model is handed back"
        if failed
        else None
    )
    past = any(entry.get("role") == "past_key_values" for inputs in roles if inputs for entry in inputs.values())
    if reason is None and roles and all(roles) and not past:
        reason = "the uploaded model has no past key/value inputs: not a decoder with a KV cache"
    if reason is not None:
        return {**skipped(reason), "time_budget_s": options.time_budget_s, "duration_s": 0.0}
    section = run_decoder_benchmark(
        source, returned, options, target=config.target, intra_op_threads=settings.intra_op_threads, seed=config.seed
    )
    if same_model and section["status"] == "measured":
        section["notes"].insert(
            0, "the job hands the upload back: both columns time the same model (their ratio is noise)"
        )
    return section


def run_decoder_benchmark(
    original: Path,
    optimized: Path,
    options: DecoderBenchmark,
    *,
    target: str = "cpu",
    intra_op_threads: int = 0,
    seed: int = 0,
) -> dict[str, Any]:
    """The report's ``decoder`` section (docs/report.md): measured, skipped or failed, never raising."""
    started = time.perf_counter()
    try:
        section = _measure(
            original, optimized, options, target=target, threads=intra_op_threads, seed=seed, started=started
        )
    except Exception as exc:  # the figures inform; a model ORT cannot drive this way must not fail the job
        section = skipped(f"{type(exc).__name__}: {str(exc)[:500]}", "failed")
    section["time_budget_s"] = options.time_budget_s
    section["duration_s"] = time.perf_counter() - started
    return section


def _measure(
    original: Path,
    optimized: Path,
    options: DecoderBenchmark,
    *,
    target: str,
    threads: int,
    seed: int,
    started: float,
) -> dict[str, Any]:
    budget = options.time_budget_s
    returned = ir.load(optimized)  # external data stays on disk: only dtypes and shapes are read
    plan = make_plan(returned, seed)
    if isinstance(plan, str):
        return skipped(f"the optimized model: {plan}")
    models = {"original": ir.load(original), "optimized": returned}
    del returned
    signature = {
        label: {s.name: (str(s.dtype), s.dims) for s in InputSynthesis(m).specs} for label, m in models.items()
    }
    if signature["original"] != signature["optimized"]:
        return skipped("the optimized model takes other inputs than the original: nothing to compare side by side")
    weights = {label: weight_bytes(m) for label, m in models.items()}
    del models
    notes: list[str] = []
    lengths, prompt, tokens = _lengths(options, plan.max_positions, notes)
    if plan.encoder_dims:
        plan.encoder_length = lengths[0]
        notes.append(
            f"seq2seq decoder: the encoder's sequence ({', '.join(plan.encoder_dims)}: encoder states, the "
            f"cross-attention cache and mask) is {plan.encoder_length} throughout, the shortest prompt length"
        )
    params = BenchmarkParams(
        warmup=0,  # _prefill's estimate runs are the warm-up
        min_runs=PREFILL_MIN_BLOCKS,
        max_runs=PREFILL_MAX_BLOCKS,
        max_seconds=0.0,
        target=target,
        intra_op_threads=threads,
        io_binding=False,  # host feeds, as a generate loop that reads the logits and the cache
        cuda_graph=False,
    )
    recipes = (read_recipe(original), read_recipe(optimized))
    # Memory first, while nothing is timed: its children then cannot slow a timed run, and a budget that a
    # slow prefill would spend still leaves them their share.
    start_feed = plan.feeds(prompt, 0, seed + 104729)
    steps = plan.step_inputs(prompt, tokens, seed + 7919)
    memory = measure_memory(
        (original, optimized),
        recipes,
        plan.cache,
        [plan.feeds(lengths[-1], 0, seed + lengths[-1]), start_feed, *steps],
        target=target,
        threads=threads,
        deadline=started + budget * MEMORY_SHARE,
        notes=notes,
    )
    pool = SessionPool()
    try:
        prefill, feeds, past = _prefill(
            (original, optimized),
            recipes,
            plan,
            lengths,
            params=params,
            pool=pool,
            seed=seed,
            until=started + budget * PREFILL_UNTIL,
            notes=notes,
        )
        sessions = (
            pool.runs(original, feeds, params, recipes[0])[0].session,
            pool.runs(optimized, feeds, params, recipes[1])[0].session,
        )
        if past:
            start_feed = plan.feeds(prompt, past, seed + 104729)
            steps = plan.step_inputs(prompt + past, tokens, seed + 7919)
        decode = _decode_section(
            sessions,
            plan=plan,
            start=start_feed,
            steps=steps,
            prompt=prompt,
            past=past,
            deadline=started + budget,
            notes=notes,
        )
    finally:
        pool.close()
    return {
        "status": "measured",
        "reason": None,
        "notes": notes,
        "prompt_lengths": lengths,
        "prefill": prefill,
        "decode": decode,
        "weights": {**weights, "ratio": weights["optimized"]["bytes"] / max(weights["original"]["bytes"], 1)},
        "memory": memory,
    }
