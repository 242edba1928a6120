"""Latency measurement and the "slower beyond noise" rule.

Fairness: the original (A) and the candidate (B) are timed **interleaved in one process**. Runs go in
blocks of one A run and one B run; the order inside a block alternates (AB, BA, AB, ...), so drift in
clock speed, cache state or a noisy neighbour hits both models alike, and each block gives one *paired*
ratio b/a. Sessions are built with ORT's default optimizations (ORT_ENABLE_ALL), i.e. what a user who
deploys the artifact gets; verification, by contrast, turns them off.

Execution: on GPU targets (``cuda``, ``tensorrt``) every timed run uses I/O binding: each input set is copied
to the device once, outputs stay on the device, and a run is ``run_with_iobinding`` + ``synchronize_outputs``,
so the figures measure the model rather than host<->device copies. The same ``BoundRun`` (core/runtime.py)
works with the CPU EP; there plain ``run`` stays the default (``BenchmarkParams.io_binding=None``: by target)
because binding gains nothing measurable when the "device" is host memory. On ``cuda`` a full benchmark also
tries the candidate as a CUDA graph (``try_cuda_graph``: static input shapes; capture on the first bound runs,
outputs checked against the run without the graph, then an interleaved A/B) and keeps it only when it is
faster beyond noise; the choice and its reason go into ``Comparison.execution`` (the report's benchmark
section) and ``Comparison.recipe_b`` (the session recipe that gives users the graph).

Warm-up, per input set: untimed runs of each model until one shows its session settled, at most ``warmup`` runs
of the set in all (``Runs.warming``): a run is settled when it is no faster than the run before it by more than
``WARMUP_SETTLE`` (10%, ``warmed``): warming up only makes runs faster, and a run slower than the one before it
is the host's noise. The run that shows it is settled itself, so it is timed, not spent (``_first_block``):
while both models warm up each step is a block of one run of each, and the block whose two runs both settle is
the set's first timed block; once one model has settled only the other runs, its settling run paired with a
run of the settled one made right after it. A settling run also shows that the run before it was as fast
already (within 10%): so the first block after the build, when faster than the build's runs (the cold ones),
is held and timed too once the next block's runs both show it settled. A session runs every set once when it
is built (its arena grows to the largest set, its thread pool starts), and that first run, timed, is the first
one compared; a pooled session that has settled on a set, or run it ``warmup`` times, is not warmed up on it
again. Measured (``python -m bench.warmup_settle``) on ViT and Whisper's encoder at bench size (batch 1, 2 and
4), the first run of a set can be 1.5x the later ones and the second is already among them: such a set now
costs no untimed run after the build's (the rule before spent two per model and set, and on a loaded host,
whose runs differ by 10-30% from one to the next, went on to the cap of 5 on runs of 0.4-2 s; ``python -m
bench.gate_pooled_sim --warmup`` compares them).

Stopping, per input set: at least ``min_runs`` timed blocks, or, when the first ``MIN_SETTLE_PAIRS`` (5) blocks
and more have taken ``min_seconds`` (``benchmark_min_seconds``), as many as that took, whichever comes first
(``floor_reached``: ten blocks of runs of seconds would cost minutes, while the stopping rule needs five pairs
and a floor in time still spans the host's drift; an answer still open when the budget is spent gets
``min_runs`` blocks all the same); then more
only while the answer is still open: the run stops as soon as the 95% bootstrap interval of the median paired
ratio (core/verdict.py) is narrower than the decision needs (``settled``: wholly below 1 - 3%, clearly
faster; wholly above 1 + 3%, clearly slower; wholly inside 1 +- 3%, within noise; wholly below 1 + 3%, not
slower, which is all a rollback or the gate asks), or as soon as the runs the budget still allows could turn
the decision only by a long chance (``futile``: below 5%, judged on 10 pairs or more, on a noisy host whose
interval will not clear the floor in time), else when the time budget ``max_seconds`` is spent or at
``max_runs``. No early stop is taken on fewer than ``MIN_SETTLE_PAIRS`` pairs: the bootstrap interval of one
pair has no width. Each set records what stopped it (``stopped_by``).

A tie, for the gate of a latency-only preset (``BenchmarkParams.tie_stop``, workers/gate.py): every set is
first timed to its floor, then the rules above look at each; when one is still open, the pooled estimate gains
less than the 3% floor, its interval rules out a 10% gain and no set is faster beyond its margin (``tie``), the
comparison stops there
(``stopped_by``: ``TIE_STOP``) and the gate hands back the upload, which cannot be slower than itself. An
artifact within noise of the upload needs the interval's upper end under 1.03 to be handed back, which took
38-47 blocks on ViT's batch 1 at bench size; on synthetic runs (log-normal, 5-15% spread; 100 seeds), three
sets of a true tie took 54-79 blocks in all within a 10 s budget each, 31-48 with this stop (a tie in 54-84% of
the jobs), and a true 10% gain ended as a tie in at most 1% (5% gain: 1-15%).

A decided comparison, for the gate (``BenchmarkParams.pooled_stop``, workers/gate.py): what the gate decides on
is ``Comparison.slower``, the pooled verdict over every set's pairs (the 3% floor) or one set clearly slower
(the 10% step), not each set's own answer. So every set is first timed to its floor, then the sets still open
go on in turns, each to its next check, and all stop (``stopped_by``: ``POOLED_STOP`` and the pooled answer)
once the pooled interval is settled or its turning futile, as the per-set rules above judge one set, while no
open set can still turn clearly slower (``cannot_turn_clearly_slower``: its interval under 1.10, or from 10
pairs a projection above the step below 5%). With ``tie_stop`` too, the tie is judged again at each turn, not
only at the floor: a set that hovers near 1.03 (DeiT's batch 1 ran 47 blocks at 1.047, 0.968..1.079, pooled
1.008) is the long case the tie stop is for. On synthetic runs of three sets (``python -m
bench.gate_pooled_sim``: log-normal, 5 and 15% spread, 100 seeds) the 90th percentile of the gate's time fell
by 17-28% where sets ran past their floor (15% spread), the share of artifacts handed back when truly 5 or 8%
slower, or 15 or 25% slower on one set, stayed within the seeds' noise or fell (9 -> 8%, 5 -> 6%, 19 -> 14%,
14 -> 13%), and a true 4% gain was handed back in 76% of the jobs instead of 79% (the later ties; at 10% in
all of them): the tie's trade, a gain under 10% for the upload, which is never slower.

Sessions: a ``SessionPool`` keeps each model's warm benchmark session for the job, so the original is built
once (baseline, every A/B against it, the gate) and the model a pass was accepted as is the next pass's A
without being rebuilt; the owner says which models to keep (``retain``) and closes it at the end.

The "slower beyond noise" rule and the latency statistics live in core/verdict.py.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

from core.inputs import InputSet
from core.runtime import BoundRun
from core.verdict import MIN_MARGIN, LatencyStats, Verdict, pooled_verdict, slower_beyond_noise
from workers.gpu import cuda_graph_eligibility, device_for, is_gpu_target, with_cuda_graph
from workers.sessions import make_session, providers_for

CLEAR_SLOWDOWN = 0.10  # one input set alone makes a model slower beyond this
# After min_runs, the interval is looked at again every quarter more blocks (at least this many): a bootstrap
# per block would cost more than the runs of a small model.
SETTLE_CHECK_BLOCKS = 5
QUICK_MIN_BLOCKS = 5  # the per-pass ledger's floor (BenchmarkParams.from_settings)
# The fewest paired ratios an early stop rests on: five pairs that all agree are a sign test at 1/32 (a bootstrap
# interval over fewer is narrow by construction: over one pair it has no width at all).
MIN_SETTLE_PAIRS = 5
# An early stop for futility: the runs left in the budget would turn the decision with at most this chance,
# judged on at least this many pairs (the full benchmark's floor, ``benchmark_min_runs``' default: the spread a
# projection rests on is unsure over fewer). On a host so loaded that ten pairs span 0.35..1.58, the decision at
# the end of the budget would be "not slower" too (its margin is the interval's half-width): the stop saves
# the budget, not the verdict.
FUTILITY_RISK = 0.05
FUTILITY_MIN_PAIRS = 10
# What stopped the sets still open when the gate stopped on a tie (``tie``).
TIE_STOP = "tie: the pooled estimate gains under the 3% floor (under 10% at 95%), no set faster"
# What stopped the sets still open when the decision was taken over all of them (``decided``).
POOLED_STOP = "pooled: every set's pairs decide; none can turn clearly slower"
_Z95 = 1.959964
# Warm-up stops once a run is no faster than the run before it by more than this fraction (module docstring):
# ORT's arena and thread pool settle in the first run or two, and a gain below the run-to-run noise of a loaded
# host (10-30% on the 2 shared CPUs this was measured on) is no sign of a session still warming up.
WARMUP_SETTLE = 0.10


@dataclasses.dataclass
class BenchmarkParams:
    warmup: int = 5
    min_runs: int = 30
    max_seconds: float = 10.0
    max_runs: int = 1000
    target: str = "cpu"
    intra_op_threads: int = 0
    io_binding: bool | None = None  # None: by target (GPU targets bind, CPU runs plain ``run``)
    cuda_graph: bool = True  # on target cuda with I/O binding: try the candidate as a CUDA graph
    # The floor in time: min_runs blocks, or MIN_SETTLE_PAIRS blocks and more once they took this long,
    # whichever comes first (``floor_reached``); 0 keeps the floor in blocks alone.
    min_seconds: float = 0.0
    # The gate's stop on a tie (``tie``): every input set is timed to its floor first, and an answer still open
    # there whose pooled estimate gains less than the 3% floor, no set faster beyond noise, ends the comparison
    # (the gate then hands back the upload). Off for the ledger's A/Bs, which decide a rollback only.
    tie_stop: bool = False
    # The gate's stop on a decided comparison (``decided``): every input set is timed to its floor first, then
    # the open sets go on in turns, and all stop once what ``Comparison.slower`` reads (the pooled verdict, and
    # each set's "clearly slower") is settled, though a set's own interval may still straddle 1 +- 3%.
    pooled_stop: bool = False

    @property
    def uses_io_binding(self) -> bool:
        return is_gpu_target(self.target) if self.io_binding is None else self.io_binding

    @classmethod
    def from_settings(cls, settings: Any, *, target: str, quick: bool = False) -> BenchmarkParams:
        """Full mode from the benchmark_* settings; quick mode (the per-pass ledger) does ledger_runs."""
        if quick:
            # ledger_runs blocks at most; fewer once the answer is settled (or the budget spent), never below
            # QUICK_MIN_BLOCKS: five paired ratios settle only when every one of them agrees (a sign test at 1/32).
            runs = settings.ledger_runs
            return cls(
                warmup=min(2, settings.benchmark_warmup),
                min_runs=min(runs, QUICK_MIN_BLOCKS),
                max_seconds=settings.benchmark_max_seconds,
                max_runs=runs,
                target=target,
                intra_op_threads=settings.intra_op_threads,
                cuda_graph=False,  # the per-pass ledger compares passes; the graph is decided once, at the end
            )
        return cls(
            warmup=settings.benchmark_warmup,
            min_runs=settings.benchmark_min_runs,
            max_seconds=settings.benchmark_max_seconds,
            max_runs=max(settings.benchmark_min_runs, 10 * settings.benchmark_min_runs),
            target=target,
            intra_op_threads=settings.intra_op_threads,
            min_seconds=settings.benchmark_min_seconds,
        )


def floor_reached(blocks: int, elapsed_s: float, params: BenchmarkParams) -> bool:
    """Whether ``blocks`` timed blocks, taken in ``elapsed_s``, meet the floor the stopping rules apply from:
    ``min_runs`` blocks, or at least ``MIN_SETTLE_PAIRS`` that took ``min_seconds`` or more.

    The floor in blocks guards against deciding on a short stretch of the host's drift; for runs of seconds
    the same stretch is covered by fewer blocks, and ``settled`` never decides on fewer than five pairs
    anyway (nor ``futile`` on fewer than ``FUTILITY_MIN_PAIRS``), so the floor in time loosens nothing
    those rules require."""
    if blocks >= params.min_runs:
        return True
    return params.min_seconds > 0 and blocks >= MIN_SETTLE_PAIRS and elapsed_s >= params.min_seconds


def settled(verdict: Verdict, *, pairs: int) -> str | None:
    """What the paired ratio's 95% interval already decides, or None while more runs could change the answer
    (always None on fewer than ``MIN_SETTLE_PAIRS`` pairs: ``pairs`` is how many the verdict was computed on).

    The floor of the "slower beyond noise" rule (3%) is the resolution the decision needs: an interval wholly
    on one side of 1 +- 3%, or wholly inside it, cannot be turned by further runs other than by chance. Every
    decision taken on a comparison (roll a pass back, refuse an artifact) asks "slower beyond noise?" only, so
    an interval wholly below 1 + 3% settles it too ("not slower": faster, or within noise, either way kept)."""
    if pairs < MIN_SETTLE_PAIRS:
        return None
    lo, hi = verdict.ci95
    if lo > 1.0 + MIN_MARGIN:
        return "clearly slower"
    if hi < 1.0 - MIN_MARGIN:
        return "clearly faster"
    if lo >= 1.0 - MIN_MARGIN and hi <= 1.0 + MIN_MARGIN:
        return "within noise"
    if hi <= 1.0 + MIN_MARGIN:
        return "not slower"
    return None


def _final_above(verdict: Verdict, *, pairs: int, remaining: int, floor: float, widen: float) -> float | None:
    """The chance that the estimate after ``remaining`` more pairs lies above ``1 + max(floor, widen x its
    half-width then)``; None when the interval says nothing about the spread (identical pairs).

    The spread of one paired ratio is read off the interval (its half-width is 1.96 standard errors of the
    median, which shrink as 1/sqrt(pairs)). After ``remaining`` more pairs the estimate moves from today's by a
    normal amount of standard deviation ``sigma * sqrt(1/n - 1/N)`` (the predictive spread, which counts the
    uncertainty of today's estimate too)."""
    lo, hi = verdict.ci95
    sigma = (hi - lo) / (2 * _Z95) * math.sqrt(pairs)
    if not sigma > 0:
        return None
    total = pairs + remaining
    threshold = 1.0 + max(floor, widen * _Z95 * sigma / math.sqrt(total))
    z = (threshold - verdict.ratio) / (sigma * math.sqrt(1.0 / pairs - 1.0 / total))
    return 1.0 - 0.5 * math.erfc(-z / math.sqrt(2))


def futile(verdict: Verdict, *, pairs: int, remaining: int) -> bool:
    """True when the ``remaining`` blocks the budget still allows would change the decision taken now (slower
    beyond noise or not, ``verdict.slower``) with a probability below ``FUTILITY_RISK``.

    The decision after them compares the estimate then (``_final_above``) with ``1 + max(3%, half-width at
    N)``. A noisy host whose interval straddles the floor with the estimate far from it stops here instead of
    spending the budget; an estimate near the threshold keeps running."""
    if pairs < FUTILITY_MIN_PAIRS or remaining <= 0:
        return False
    above = _final_above(verdict, pairs=pairs, remaining=remaining, floor=MIN_MARGIN, widen=1.0)
    if above is None:  # identical pairs: the interval says nothing about the spread; let settled() decide
        return False
    return (above if not verdict.slower else 1.0 - above) < FUTILITY_RISK


def cannot_turn_clearly_slower(verdict: Verdict, *, pairs: int, remaining: int) -> bool:
    """Whether one input set's runs, however many the budget still allows, would leave it short of "clearly
    slower" (``ShapeComparison.clearly_slower``: ratio above 1 + max(10%, 2 x margin)) but by a chance below
    ``FUTILITY_RISK``: its 95% interval lies wholly below 1 + 10% (from ``MIN_SETTLE_PAIRS`` pairs), or, from
    ``FUTILITY_MIN_PAIRS``, the projection of ``futile`` puts its final estimate above that threshold with a
    chance below 5%. A set already past it is never done here: its own rules decide it."""
    if pairs < MIN_SETTLE_PAIRS or verdict.ratio > 1.0 + max(CLEAR_SLOWDOWN, 2 * verdict.margin):
        return False
    if verdict.ci95[1] < 1.0 + CLEAR_SLOWDOWN:
        return True
    if pairs < FUTILITY_MIN_PAIRS:
        return False
    if remaining <= 0:
        return True
    above = _final_above(verdict, pairs=pairs, remaining=remaining, floor=CLEAR_SLOWDOWN, widen=2.0)
    return above is not None and above < FUTILITY_RISK


def tie(verdicts: Sequence[Verdict], pooled: Verdict, answers: Sequence[str | None]) -> bool:
    """Whether the floor's blocks of every input set (their ``verdicts``, the ``pooled`` one over all their
    pairs, and what the stopping rules say of each: ``answers``, None while open) already show a tie that the
    rest of the budget would only confirm at length.

    True when some set is still open, the pooled estimate (median paired ratio) gains less than the 3% floor of
    the "slower beyond noise" rule (the resolution below which nobody acts on a difference), the pooled 95%
    interval rules out a gain of ``CLEAR_SLOWDOWN`` (10%, the "clearly slower" step the other way), and no set
    is faster beyond its own margin (a gain on one shape is worth the budget, whatever the others show).
    Proving such an artifact "not slower" takes as many blocks as the noise needs to bring the interval's upper
    end under 1.03 (38-47 on ViT's batch 1 at bench size); handing back the upload instead is never slower, and
    gives up a gain under 10% at most (with 95% confidence). On a host so loaded that the interval cannot rule
    out 10% there is no tie: the rules above decide, as before."""
    if all(answer is not None for answer in answers):
        return False
    bounded = pooled.ci95[0] >= 1.0 - CLEAR_SLOWDOWN
    return bounded and pooled.paired_ratio >= 1.0 - MIN_MARGIN and not any(v.faster for v in verdicts)


def decided(states: Sequence[_Blocks], answers: Sequence[str | None], params: BenchmarkParams) -> str | None:
    """What stops every input set still open (``answers[i]`` None) at once: the decision the comparison feeds
    (``Comparison.slower``: the pooled verdict slower beyond noise, or one set clearly slower) is already
    taken, though some set's own interval still straddles 1 +- 3%. None while more runs could turn it.

    Taken when the pooled verdict over every set's pairs is settled (``settled``) or its turning is futile
    (``futile``, the blocks left to the open sets counted together), and no open set can still turn clearly
    slower (``cannot_turn_clearly_slower``). A set's own "within 3%" answer is not part of the decision: the
    pooled verdict carries the 3% floor, a single set only the 10% step, and the pooled interval, over the
    pairs of every set, narrows sooner than any one of them."""
    pairs = [min(len(st.a_ms), len(st.b_ms)) for st in states]
    open_sets = [i for i, answer in enumerate(answers) if answer is None]
    if not open_sets or min(pairs) < MIN_SETTLE_PAIRS:
        return None
    pooled = pooled_verdict(
        [np.asarray(st.b_ms[:n]) / np.asarray(st.a_ms[:n]) for st, n in zip(states, pairs, strict=True)]
    )
    remaining = {i: _remaining(states[i], params) for i in open_sets}
    answer = settled(pooled, pairs=sum(pairs))
    if answer is not None:
        answer = f"settled: {answer}"
    elif futile(pooled, pairs=sum(pairs), remaining=sum(remaining.values())):
        answer = f"futile: {'slower' if pooled.slower else 'not slower'} whatever the budget left"
    if answer is None:
        return None
    for i in open_sets:
        verdict = slower_beyond_noise(states[i].a_ms, states[i].b_ms, seed=i)
        if not cannot_turn_clearly_slower(verdict, pairs=pairs[i], remaining=remaining[i]):
            return None
    return f"{POOLED_STOP}: {answer}"


def stop_reason(a_ms: Sequence[float], b_ms: Sequence[float], *, remaining: int, seed: int = 0) -> str | None:
    """Why the interleaved runs of one input set can stop now (``settled``, ``futile``), or None."""
    verdict = slower_beyond_noise(a_ms, b_ms, seed=seed)
    pairs = min(len(a_ms), len(b_ms))
    answer = settled(verdict, pairs=pairs)
    if answer is not None:
        return f"settled: {answer}"
    if futile(verdict, pairs=pairs, remaining=remaining):
        return f"futile: {'slower' if verdict.slower else 'not slower'} whatever the budget left"
    return None


@dataclasses.dataclass
class ShapeComparison:
    input_set: str
    a: LatencyStats
    b: LatencyStats
    verdict: Verdict
    pairs: np.ndarray = dataclasses.field(default_factory=lambda: np.ones(1), repr=False)  # b_i / a_i
    # "settled: clearly faster|clearly slower|within noise|not slower", "futile: ...", "time budget", "max_runs"
    stopped_by: str | None = None

    @property
    def clearly_slower(self) -> bool:
        return self.verdict.ratio > 1.0 + max(CLEAR_SLOWDOWN, 2 * self.verdict.margin)

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_set": self.input_set,
            "original": self.a.to_dict(),
            "optimized": self.b.to_dict(),
            **self.verdict.to_dict(),
            "clearly_slower": self.clearly_slower,
            "stopped_by": self.stopped_by,
        }


@dataclasses.dataclass
class CudaGraphChoice:
    """Whether the candidate runs as a CUDA graph, and why (never a failure: a refusal is a reason)."""

    tried: bool = False
    captured: bool = False  # ORT built the session, captured and replayed it with matching outputs
    used: bool = False  # captured and faster beyond noise than the same session without the graph
    reason: str | None = None
    speedup: float | None = None  # median(without graph) / median(with graph), when timed

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Comparison:
    shapes: list[ShapeComparison]
    mode: str  # "quick" (ledger) or "full"
    params: BenchmarkParams
    cuda_graph: CudaGraphChoice = dataclasses.field(default_factory=CudaGraphChoice)
    recipe_b: dict[str, Any] | None = None  # the candidate's session recipe as measured (with the graph if used)
    tie: bool = False  # stopped at the floor on a tie (``tie``): the gate hands back the upload

    @property
    def execution(self) -> dict[str, Any]:
        """How the sessions were run: for the report, so figures from different set-ups are not compared."""
        device, device_id = device_for(self.params.target)
        return {
            "io_binding": self.params.uses_io_binding,
            "device": f"{device}:{device_id}" if self.params.uses_io_binding else "host feeds",
            "cuda_graph": self.cuda_graph.to_dict(),
        }

    @property
    def pooled(self) -> Verdict:
        return pooled_verdict([s.pairs for s in self.shapes])

    @property
    def slower(self) -> bool:
        """Pooled verdict slower, or one input set clearly slower (module docstring)."""
        return self.pooled.slower or any(s.clearly_slower for s in self.shapes)

    @property
    def speedup(self) -> float:
        """Geometric mean over input sets of median(A) / median(B)."""
        return float(np.exp(np.mean([np.log(s.verdict.speedup) for s in self.shapes])))

    @property
    def p50_a_ms(self) -> float:
        return float(np.mean([s.a.p50_ms for s in self.shapes]))

    @property
    def p50_b_ms(self) -> float:
        return float(np.mean([s.b.p50_ms for s in self.shapes]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "slower": self.slower,
            "pooled": self.pooled.to_dict(),
            "speedup": self.speedup,
            "p50_ms_original": self.p50_a_ms,
            "p50_ms_optimized": self.p50_b_ms,
            "params": dataclasses.asdict(self.params),
            "execution": self.execution,
            "tie": self.tie,
            "shapes": [s.to_dict() for s in self.shapes],
        }


class Runs:
    """How one session runs each input set: plain ``run`` on host feeds, a ``BoundRun`` per input set, or
    (CUDA graph) one ``BoundRun`` whose fixed buffers get each set's values copied in when the set changes.
    ``select(i)`` returns the call to time for input set ``i``; copies happen there, outside the timer."""

    def __init__(
        self,
        session: Any,
        feeds: Sequence[dict[str, np.ndarray]],
        params: BenchmarkParams,
        *,
        output_shapes: Mapping[str, tuple[Sequence[int], Any]] | None = None,
    ) -> None:
        self.session = session
        self.feeds = list(feeds)
        self.bound = params.uses_io_binding
        self.device, self.device_id = device_for(params.target)
        self.graph = output_shapes is not None
        self._output_shapes = output_shapes
        self._runs: dict[int, BoundRun] = {}
        self._current: int | None = None
        # Runs made so far per input set: a pooled session already warm on a set is not warmed up again.
        self.ran: dict[int, int] = {}
        # The last untimed run of each input set, ms (the session's first run, then each warm-up run).
        self.last_ms: dict[int, float] = {}
        # Input sets on which a run has shown the session settled (``warmed``): never warmed up again.
        self.settled: set[int] = set()
        # Host feeds only: each set's outputs from the session's first run (``_prepared``), so that reading them
        # once more (the upload's drift at ORT's default level) costs no run: a run of Whisper's encoder's three
        # sets is ~0.7-1 s of its job.
        self.first_outputs: dict[int, list[np.ndarray]] = {}

    def warming(self, index: int, warmup: int) -> bool:
        """Whether the next run of input set ``index`` must still show that the session has settled: no run of
        the set has, and fewer than ``warmup`` runs of it were made (the one at build counts)."""
        return index not in self.settled and self.ran.get(index, 0) < warmup

    def settles(self, index: int, ms: float, warmup: int) -> bool:
        """Whether a run of ``ms`` of input set ``index``, made while ``warming``, can be timed: it is not faster
        than the run before it beyond ``WARMUP_SETTLE`` (``warmed``), or the cap of ``warmup`` runs is reached.
        Recorded: the set is then settled. The caller records an untimed run with ``untimed``."""
        if self.warming(index, warmup) and not warmed(self.last_ms.get(index), ms):
            return False
        self.settle(index)
        return True

    def settle(self, index: int) -> None:
        """Input set ``index`` has shown the session settled: it is never warmed up again."""
        self.settled.add(index)

    def untimed(self, index: int, ms: float) -> None:
        """A run of input set ``index`` that is not timed (a warm-up run): counted, and the next one compared to it."""
        self.last_ms[index] = ms
        self.count(index, 1)

    def count(self, index: int, runs: int) -> None:
        self.ran[index] = self.ran.get(index, 0) + runs

    def select(self, index: int) -> Callable[[], Any]:
        if not self.bound:
            feed = self.feeds[index]
            return lambda: self.session.run(None, feed)
        if self.graph:
            if not self._runs:
                self._runs[0] = BoundRun(
                    self.session, self.feeds[index], self.device, self.device_id, self._output_shapes
                )
            elif self._current != index:
                self._runs[0].update(self.feeds[index])
            self._current = index
            return self._runs[0].run
        if index not in self._runs:
            self._runs[index] = BoundRun(self.session, self.feeds[index], self.device, self.device_id)
        return self._runs[index].run

    def outputs(self, index: int) -> list[np.ndarray]:
        """The outputs of input set ``index`` (runs it once)."""
        if not self.bound:
            return list(self.session.run(None, self.feeds[index]))
        self.select(index)()
        return self._runs[0 if self.graph else index].outputs()

    def first_run_outputs(self, index: int) -> list[np.ndarray]:
        """The outputs of input set ``index`` from the session's first run when they were kept, else ``outputs``.
        A session's outputs do not depend on how often it ran: a stateless graph, the same feeds."""
        kept = self.first_outputs.get(index)
        return list(kept) if kept is not None else self.outputs(index)


def warmed(previous_ms: float | None, ms: float) -> bool:
    """A run of ``ms`` after one of ``previous_ms`` (None: no run timed before it) shows a settled session: it is
    not faster than that run by more than ``WARMUP_SETTLE``. Warming up (the arena, ORT's memory pattern for the
    shapes, the thread pool, caches) only makes runs faster; a run slower than the one before it is the host's
    noise, which more untimed runs do not remove."""
    return previous_ms is not None and ms >= (1.0 - WARMUP_SETTLE) * previous_ms


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _prepared(
    path: Path,
    feeds: Sequence[dict[str, np.ndarray]],
    params: BenchmarkParams,
    recipe: Mapping[str, Any] | None = None,
    *,
    keep_outputs: bool = False,
) -> tuple[Runs, float]:
    """Create a session and run each feed once; the RSS growth meanwhile (sampled after each step), in MiB.

    One run per feed makes every allocation the shapes need (the arena grows to the largest); the ``warmup``
    runs come right before each set is timed (``compare``, ``measure``), where they warm what timing sees.
    Approximate by nature (allocator caches, the other session alive beside it), but it tells a model that
    needs 10x the memory of the original from one that does not.
    """
    gc.collect()
    base = peak = _rss()
    # Two sessions take turns here, each with its own thread pool: with ORT's default spinning, the idle one's
    # workers spin on the cores the running one needs. On 2 vCPUs at 2 threads that made the paired ratios of
    # T5 alternate 0.57 / 1.75 with the block order and inflated both medians 1.6x (bench/README.md); without
    # spinning the pairs agree within a few percent. Users' one session per process spins as ORT defaults.
    session = make_session(
        path,
        target=params.target,
        intra_op_threads=params.intra_op_threads,
        optimize=True,
        recipe=recipe,
        spinning=False,
    )
    runs = Runs(session, feeds, params)
    peak = max(peak, _rss())
    for index in range(len(feeds)):
        run, results = runs.select(index), []
        keep = keep_outputs and not runs.bound
        # the cold run: what the first warm-up is compared to
        runs.last_ms[index] = _time_one((lambda run=run, results=results: results.append(run())) if keep else run)
        if keep and results:
            runs.first_outputs[index] = list(results[0])
        runs.count(index, 1)
        peak = max(peak, _rss())
    return runs, (peak - base) / (1 << 20)


def _feeds_digest(feeds: Sequence[Mapping[str, np.ndarray]]) -> str:
    """The feeds' names, dtypes, shapes and values: a warm session is bound to them (I/O binding copies them)."""
    digest = hashlib.sha256()
    for feed in feeds:
        for name, value in feed.items():
            array = np.ascontiguousarray(value)
            digest.update(f"{name}|{array.dtype}|{array.shape}|".encode())
            digest.update(array.data)
    return digest.hexdigest()


class SessionPool:
    """Warm benchmark sessions of one job, by model file (path and identity on disk), recipe, execution
    settings and feeds. Building an ORT_ENABLE_ALL session of a large model costs seconds and its warm-up
    more: the ledger asks for the same original and the same accepted stage pass after pass.

    ``retain(paths)`` drops the sessions of every other model (a rolled-back candidate, a replaced stage), so
    at most the original, the accepted stage and one candidate are alive; ``close()`` drops them all."""

    def __init__(self) -> None:
        self._entries: dict[tuple[Any, ...], tuple[Runs, float]] = {}
        self.built = 0
        self.reused = 0

    @staticmethod
    def _key(
        path: Path, feeds: Sequence[Mapping[str, np.ndarray]], params: BenchmarkParams, recipe: Mapping[str, Any] | None
    ) -> tuple[Any, ...]:
        st = os.stat(path)  # a rewritten file is another model
        return (
            str(Path(path).resolve()),
            st.st_ino,
            st.st_size,
            st.st_mtime_ns,
            json.dumps(recipe, sort_keys=True, default=str) if recipe else None,
            params.target,
            params.intra_op_threads,
            params.uses_io_binding,
            _feeds_digest(feeds),
        )

    def runs(
        self,
        path: Path,
        feeds: Sequence[dict[str, np.ndarray]],
        params: BenchmarkParams,
        recipe: Mapping[str, Any] | None = None,
        *,
        keep_outputs: bool = False,
    ) -> tuple[Runs, float]:
        """A warm ``Runs`` of ``path`` and the RSS growth measured when its session was built. ``keep_outputs``:
        a session built now keeps its first run's outputs (``Runs.first_run_outputs``; the caller clears
        ``Runs.first_outputs`` once read, as a language model's logits are large)."""
        key = self._key(path, feeds, params, recipe)
        entry = self._entries.get(key)
        if entry is not None:
            self.reused += 1
            return entry
        entry = _prepared(path, feeds, params, recipe, keep_outputs=keep_outputs)
        self.built += 1
        self._entries[key] = entry
        return entry

    def retain(self, paths: Sequence[Path]) -> None:
        keep = {str(Path(p).resolve()) for p in paths}
        dropped = [k for k in self._entries if k[0] not in keep]
        for key in dropped:
            del self._entries[key]
        if dropped:
            gc.collect()  # a large model's session holds its weights until collected

    def close(self) -> None:
        self.retain([])

    def counts(self) -> dict[str, int]:
        return {"built": self.built, "reused": self.reused}


def _time_one(run: Callable[[], Any]) -> float:
    start = time.perf_counter_ns()
    run()
    return (time.perf_counter_ns() - start) / 1e6


GRAPH_RTOL, GRAPH_ATOL = 1e-3, 1e-4  # same kernels replayed: anything beyond float noise is a broken replay


def try_cuda_graph(
    path: Path,
    runs_plain: Runs,
    params: BenchmarkParams,
    recipe: Mapping[str, Any] | None = None,
) -> tuple[CudaGraphChoice, Runs | None]:
    """Try ``path`` as a CUDA graph against ``runs_plain`` (the same model and recipe, I/O-bound, no graph).

    Eligible when the target is cuda and every input dim is static. The try: create the session with
    ``enable_cuda_graph=1`` (ORT refuses nodes outside the CUDA EP), run each input set through one set of
    fixed buffers (the capture happens on the first runs), compare the outputs with the run without the
    graph, then time both interleaved on the first input set. Used only when faster beyond noise; every
    refusal or failure is a reason, never an error. Returns (choice, the graph runs when used)."""
    dims = {i.name: list(i.shape) for i in runs_plain.session.get_inputs()}
    reason = cuda_graph_eligibility(dims, params.target)
    if reason is None and not runs_plain.bound:
        reason = "CUDA graphs need I/O binding, which this benchmark was told not to use"
    if reason is not None:
        return CudaGraphChoice(reason=reason), None
    choice = CudaGraphChoice(tried=True)
    try:
        reference = [runs_plain.outputs(i) for i in range(len(runs_plain.feeds))]
        names = [o.name for o in runs_plain.session.get_outputs()]
        shapes = {n: (r.shape, r.dtype) for n, r in zip(names, reference[0], strict=True)}
        session = make_session(
            path,
            target=params.target,
            intra_op_threads=params.intra_op_threads,
            optimize=True,
            recipe=with_cuda_graph(recipe),
        )
        graph = Runs(session, runs_plain.feeds, params, output_shapes=shapes)
        for _ in range(max(2, params.warmup)):  # ORT captures after its own few regular runs
            graph.select(0)()
        for index, expected in enumerate(reference):
            got = graph.outputs(index)
            for name, want, have in zip(names, expected, got, strict=True):
                if want.shape != have.shape or not np.allclose(
                    have, want, rtol=GRAPH_RTOL, atol=GRAPH_ATOL, equal_nan=True
                ):
                    choice.reason = f"the graph replay gives other values for {name!r} on input set {index}"
                    return choice, None
    except Exception as exc:  # ORT's refusal (CPU nodes, control flow) or a capture failure: a reason
        choice.reason = f"{type(exc).__name__}: {str(exc)[:300]}"
        return choice, None
    choice.captured = True
    plain, replay = runs_plain.select(0), graph.select(0)
    for _ in range(params.warmup):
        plain()
        replay()
    a_ms, b_ms = [], []
    for block in range(max(params.min_runs, 10)):
        if block % 2 == 0:
            a_ms.append(_time_one(plain))
            b_ms.append(_time_one(replay))
        else:
            b_ms.append(_time_one(replay))
            a_ms.append(_time_one(plain))
    verdict = slower_beyond_noise(a_ms, b_ms)
    choice.speedup = verdict.speedup
    if not verdict.faster:
        choice.reason = f"not faster beyond noise (speedup {verdict.speedup:.3f}, margin {verdict.margin:.3f})"
        return choice, None
    choice.used = True
    return choice, graph


@dataclasses.dataclass
class _Blocks:
    """One input set's interleaved blocks so far: the gate's timing pauses at the floor and may go on later."""

    a_ms: list[float] = dataclasses.field(default_factory=list)
    b_ms: list[float] = dataclasses.field(default_factory=list)
    elapsed_s: float = 0.0
    check_at: int | None = None  # the block the stopping rules look next at, from the floor on


def _remaining(state: _Blocks, params: BenchmarkParams) -> int:
    """The blocks the budget still allows one input set at its pace so far (a block times one A and one B)."""
    block, elapsed = len(state.a_ms), state.elapsed_s
    by_time = (params.max_seconds - elapsed) / (elapsed / block) if elapsed > 0 and block else params.max_runs
    return max(0, int(min(params.max_runs - block, by_time)))


def _stop_after_block(state: _Blocks, params: BenchmarkParams, index: int) -> str | None:
    """What stops the blocks of ``state`` now (module docstring), or None to run another block."""
    block = len(state.a_ms)
    if block >= params.max_runs:
        return "max_runs"
    elapsed = state.elapsed_s
    if state.check_at is None:
        if not floor_reached(block, elapsed, params):
            return None
        state.check_at = block
    if block >= state.check_at:
        answer = stop_reason(state.a_ms, state.b_ms, remaining=_remaining(state, params), seed=index)
        if answer is not None:
            return answer
        state.check_at = block + max(SETTLE_CHECK_BLOCKS, block // 4)
    # The floor in time opens only the early stops of a settled (or, from 10 pairs, futile) answer: an answer
    # still open when the budget is spent gets min_runs blocks, as before.
    if elapsed >= params.max_seconds and block >= params.min_runs:
        return "time budget"
    return None


def _block(run_a: Callable[[], Any], run_b: Callable[[], Any], *, a_first: bool) -> tuple[float, float]:
    """One interleaved block: a run of A and one of B, in the order given (the callers alternate it: module
    docstring, "Fairness"); (A ms, B ms)."""
    if a_first:
        a = _time_one(run_a)
        return a, _time_one(run_b)
    b = _time_one(run_b)
    return _time_one(run_a), b


def _first_block(runs_a: Runs, runs_b: Runs, index: int, warmup: int) -> tuple[list[tuple[float, float]], float]:
    """The warm-up of input set ``index``: runs of the models still ``warming`` on it, the runs that show a
    session settled (``Runs.settles``) timed rather than spent. While both warm up, each step is a block (one
    run of A and one of B, in the order of the set's first block); once one has settled, only the other runs,
    and its settling run is paired with a run of the settled one made right after it. Returns the set's first
    timed blocks (A ms, B ms) and their seconds; every run before them is untimed. None timed: neither model
    needed a warm-up run, or the cap of ``warmup`` runs was reached first.

    The run that shows a session settled is no faster than the one before it, so that one was as fast already
    (within 10%): when the first block after the build is faster than the build's runs beyond 10% (the cold
    run), it is held, and timed as well when the next block's runs both show it settled; otherwise it is
    untimed and the rule goes on from the next block. A set whose first run after the build is already settled
    (ViT, Whisper's encoder) costs no untimed run; and a warm model is not run beside the other's warm-up."""
    run_a, run_b = runs_a.select(index), runs_b.select(index)
    held: tuple[float, float, float] | None = None  # the first block (A ms, B ms, seconds), not counted yet
    first = True
    while True:
        warming_a, warming_b = runs_a.warming(index, warmup), runs_b.warming(index, warmup)
        if held is None and not (warming_a or warming_b):
            return [], 0.0
        start = time.perf_counter()
        if held is not None or (warming_a and warming_b):
            a, b = _block(run_a, run_b, a_first=index % 2 == 0)
            seconds = time.perf_counter() - start
            if held is not None:
                if warmed(held[0], a) and warmed(held[1], b):
                    runs_a.settle(index)
                    runs_b.settle(index)
                    return [(held[0], held[1]), (a, b)], held[2] + seconds
                runs_a.untimed(index, held[0])
                runs_b.untimed(index, held[1])
                held = None
            done_a, done_b = runs_a.settles(index, a, warmup), runs_b.settles(index, b, warmup)
            if done_a and done_b:
                return [(a, b)], seconds
            if first:
                held, first = (a, b, seconds), False
                continue
            runs_a.untimed(index, a)
            runs_b.untimed(index, b)
            continue
        first = False
        warm, run_warm, run_other = (runs_a, run_a, run_b) if warming_a else (runs_b, run_b, run_a)
        took = _time_one(run_warm)
        if not warm.settles(index, took, warmup):
            warm.untimed(index, took)
            continue
        paired = _time_one(run_other)
        a, b = (took, paired) if warming_a else (paired, took)
        return [(a, b)], time.perf_counter() - start


def _timed_blocks(
    run_a: Callable[[], Any],
    run_b: Callable[[], Any],
    params: BenchmarkParams,
    index: int,
    state: _Blocks | None = None,
    *,
    until_floor: bool = False,
    pause_at: int | None = None,
    first: tuple[list[tuple[float, float]], float] | None = None,
) -> tuple[list[float], list[float], str | None]:
    """Interleaved blocks of one input set until the answer is settled, the budget spent or max_runs reached
    (module docstring); returns the A and B times and what stopped them. ``until_floor``: pause at the floor
    (or max_runs) before any stopping rule is applied (what stopped them: None); ``pause_at``: pause (None)
    once the set has this many blocks, its own rules applied up to there; ``state``: go on from such a pause
    (whose rules the caller applied), its budget counting only the time spent in these blocks; ``first``: the
    first blocks, timed already by the warm-up (``_first_block``: (A ms, B ms) each, their seconds)."""
    state = _Blocks() if state is None else state
    pending = list(first[0]) if first is not None else []
    if first is not None:
        state.elapsed_s += first[1]
    started = time.perf_counter() - state.elapsed_s
    while True:
        a, b = pending.pop(0) if pending else _block(run_a, run_b, a_first=(len(state.a_ms) + index) % 2 == 0)
        state.a_ms.append(a)
        state.b_ms.append(b)
        state.elapsed_s = time.perf_counter() - started
        block = len(state.a_ms)
        if until_floor and (block >= params.max_runs or floor_reached(block, state.elapsed_s, params)):
            return state.a_ms, state.b_ms, None
        answer = _stop_after_block(state, params, index)
        if answer is not None:
            return state.a_ms, state.b_ms, answer
        if pause_at is not None and block >= pause_at:
            return state.a_ms, state.b_ms, None


def _time_sets(
    runs_a: Runs, runs_b: Runs, count: int, params: BenchmarkParams
) -> tuple[list[_Blocks], list[str | None], bool]:
    """The interleaved blocks of ``count`` input sets of A and B (each set warmed up before its first block),
    what stopped each, and whether the comparison stopped on a tie (``params.tie_stop``, ``tie``).

    Without ``tie_stop`` or ``pooled_stop`` each set is timed to its end in turn. With either, every set is
    first timed to its floor (a pause, no rule applied there), so that what is judged over all of them is
    judged before any set spends its budget; the rules then look at each set's floor as they would have, and
    only the sets still open go on: to their own end (``tie_stop`` alone), or in turns, each to its next
    check, until ``decided`` stops them all (``pooled_stop``)."""
    states = [_Blocks() for _ in range(count)]
    stops: list[str | None] = []
    floor_first = params.tie_stop or params.pooled_stop
    for index in range(count):
        first = _first_block(runs_a, runs_b, index, params.warmup)
        run_a, run_b = runs_a.select(index), runs_b.select(index)
        stops.append(_timed_blocks(run_a, run_b, params, index, states[index], until_floor=floor_first, first=first)[2])
    if not floor_first:
        return states, stops, False
    stops = [stop or _stop_after_block(states[i], params, i) for i, stop in enumerate(stops)]
    while any(stop is None for stop in stops):
        if params.tie_stop:
            verdicts = [slower_beyond_noise(s.a_ms, s.b_ms, seed=i) for i, s in enumerate(states)]
            pooled = pooled_verdict([np.asarray(s.b_ms) / np.asarray(s.a_ms) for s in states])
            if tie(verdicts, pooled, stops):
                return states, [stop or TIE_STOP for stop in stops], True
        answer = decided(states, stops, params) if params.pooled_stop else None
        if answer is not None:
            return states, [stop or answer for stop in stops], False
        for index in (i for i, stop in enumerate(stops) if stop is None):  # warmed up already
            run_a, run_b = runs_a.select(index), runs_b.select(index)
            state = states[index]
            pause = state.check_at if params.pooled_stop else None
            stops[index] = _timed_blocks(run_a, run_b, params, index, state, pause_at=pause)[2]
    return states, stops, False


# What an ORT session raises when a model it loaded fails to run (a kernel refusing its inputs, say).
ORT_RUN_ERRORS: tuple[type[Exception], ...] = tuple(
    getattr(ort_errors, name)
    for name in ("Fail", "InvalidArgument", "RuntimeException", "InvalidGraph", "NotImplemented", "EPFail")
    if hasattr(ort_errors, name)
)


def run_failure(exc: Exception) -> str:
    """Why a verified model is refused when the timing cannot run it. Verification runs it with ORT's
    optimizations off; the timing runs it as users do, at ORT's default level, whose rewrites trust the graph's
    shapes (ORT's ReshapeFusion, given a symbolic batch, writes a Reshape that fails on an empty batch: a
    detector's zero boxes)."""
    return (
        "verified with ORT's optimizations off but failed to run as users run it (ORT's default level, in the "
        f"benchmark): {type(exc).__name__}: {str(exc)[:200]}"
    )


def compare(
    path_a: Path,
    path_b: Path,
    input_sets: Sequence[InputSet],
    params: BenchmarkParams,
    *,
    mode: str = "full",
    recipe_a: dict[str, Any] | None = None,
    recipe_b: dict[str, Any] | None = None,
    pool: SessionPool | None = None,
) -> Comparison:
    """Benchmark A (original) against B (candidate), interleaved, per input set. A recipe (tune_session's
    ``onnxforge.session``) sets that model's session options and EP options. ``pool``: take the warm sessions
    from it (and leave them there); without one, both are built here and dropped at the end."""
    feeds = [s.feeds for s in input_sets]
    own = pool is None
    sessions = SessionPool() if pool is None else pool
    runs_a, mem_a = sessions.runs(path_a, feeds, params, recipe_a)
    runs_b, mem_b = sessions.runs(path_b, feeds, params, recipe_b)
    graph_choice = CudaGraphChoice(reason="only tried on target cuda in a full benchmark")
    measured_recipe = recipe_b
    if params.target == "cuda" and params.cuda_graph:
        graph_choice, graph_runs = try_cuda_graph(path_b, runs_b, params, recipe_b)
        if graph_runs is not None:
            runs_b, measured_recipe = graph_runs, with_cuda_graph(recipe_b)
    states, stops, tied = _time_sets(runs_a, runs_b, len(input_sets), params)
    results = []
    for index, input_set in enumerate(input_sets):
        a_ms, b_ms = states[index].a_ms, states[index].b_ms
        runs_a.count(index, len(a_ms))
        runs_b.count(index, len(b_ms))
        results.append(
            ShapeComparison(
                input_set.name,
                LatencyStats.from_samples(a_ms, mem_a),
                LatencyStats.from_samples(b_ms, mem_b),
                slower_beyond_noise(a_ms, b_ms, seed=index),
                np.asarray(b_ms) / np.asarray(a_ms),
                stops[index],
            )
        )
    del runs_a, runs_b
    if own:
        sessions.close()
    return Comparison(results, mode, params, graph_choice, measured_recipe, tie=tied)


def measure(
    path: Path, input_sets: Sequence[InputSet], params: BenchmarkParams, *, pool: SessionPool | None = None
) -> list[LatencyStats]:
    """One model alone (the ledger's baseline): stats per input set. ``pool`` as in ``compare``."""
    feeds = [s.feeds for s in input_sets]
    own = pool is None
    sessions = SessionPool() if pool is None else pool
    runs, mem = sessions.runs(path, feeds, params)
    out = []
    for index in range(len(feeds)):
        run = runs.select(index)
        samples: list[float] = []
        start = time.perf_counter()
        while runs.warming(index, params.warmup):  # the run that shows the session settled is the first sample
            took = _time_one(run)
            if runs.settles(index, took, params.warmup):
                samples.append(took)
                break
            runs.untimed(index, took)
            start = time.perf_counter()
        while not samples or len(samples) < params.max_runs:
            if len(samples) >= params.min_runs and time.perf_counter() - start >= params.max_seconds:
                break
            samples.append(_time_one(run))
        runs.count(index, len(samples))
        out.append(LatencyStats.from_samples(samples, mem))
    del runs
    if own:
        sessions.close()
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "processor\t: arm")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_info(*, target: str, intra_op_threads: int) -> dict[str, Any]:
    """What a benchmark ran on: enough to tell whether two reports are comparable."""
    import onnx
    import onnxruntime as ort

    try:
        providers = providers_for(target)
    except Exception:
        providers = []
    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "physical_cpus": psutil.cpu_count(logical=False),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_total_mb": psutil.virtual_memory().total // (1 << 20),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "onnx_version": onnx.__version__,
        "onnxruntime_version": ort.__version__,
        "target": target,
        "execution_providers": providers,
        "intra_op_threads": intra_op_threads,
        "intra_op_threads_effective": intra_op_threads or "ort-default",
        "inter_op_threads": 1,
        "benchmark_graph_optimization_level": "ORT_ENABLE_ALL",
        "verification_graph_optimization_level": "ORT_DISABLE_ALL",
    }
