"""Preset ``auto``: try each candidate's passes within a time budget and keep the fastest within tolerance.

::

    for each candidate (safe, fast, ...) while the budget lasts (the first one always runs):
        a fresh ledger over the upload ─> its artifact, verified (bisected if needed)
          ─ out of tolerance ─> rejected
          ─ else ─> benchmarked against the upload, interleaved, with its share of the budget left ─> measured
    the fastest measured one is chosen; nothing verified: the first ledger's records, no pass kept (the gate
    then returns the upload)

Every candidate goes to the report's ``candidates``; the chosen one's ledger becomes its ``passes``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from core.recipe import read_recipe
from passes._infra import Pass
from workers.benchmark import BenchmarkParams, compare
from workers.ledger import Ledger, Outcome, Setup

DEFAULT_BUDGET_S = 600.0


@dataclasses.dataclass
class Search:
    ledger: Ledger  # the chosen candidate's (or, when none verified, the first one's with no pass kept)
    outcome: Outcome
    candidates: list[dict[str, Any]]  # the report's ``candidates``


def search(
    setup: Setup,
    variants: list[tuple[str, list[Pass]]],
    work: Path,
    *,
    budget_s: float | None,
    full: BenchmarkParams,
) -> Search:
    budget = budget_s or DEFAULT_BUDGET_S
    started = time.perf_counter()
    candidates: list[dict[str, Any]] = []
    measured: list[tuple[dict[str, Any], Ledger, Outcome]] = []
    first: tuple[Ledger, Outcome] | None = None
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
        candidates.append(entry)
        elapsed = time.perf_counter() - started
        if i > 0 and elapsed >= budget:
            entry["reason"] = f"time budget spent ({elapsed:.1f} s of {budget:g} s)"
            continue
        setup.progress("passes", i / max(len(variants), 1))
        ledger = Ledger(setup)
        vwork = work / f"candidate-{i}"
        vwork.mkdir()
        outcome = ledger.finalize(vwork, ledger.run(passes, vwork))
        first = first or (ledger, outcome)
        entry["passes"] = [p.name for p in ledger.kept_passes]
        entry["verification"] = outcome.verification.worst()
        if not outcome.verification.ok:
            entry.update(status="rejected", reason=f"out of tolerance: {outcome.verification.reason}")
            continue
        left = max(budget - (time.perf_counter() - started), 0.0)
        share = left / max(len(variants) - i, 1) / max(2 * len(setup.input_sets), 1)
        params = dataclasses.replace(full, max_seconds=max(0.05, min(full.max_seconds, share)))
        recipe = read_recipe(outcome.artifact)
        comparison = compare(
            setup.source, outcome.artifact, setup.input_sets, params, mode="auto", recipe_b=recipe, pool=setup.pool
        )
        setup.pool.retain([setup.source])  # the next candidate's ledger starts from the upload again
        entry.update(
            status="measured",
            p50_ms=comparison.p50_b_ms,
            speedup=comparison.speedup,
            reason=f"{len(ledger.kept)} pass(es) kept; p50 {comparison.p50_a_ms:.4g} -> {comparison.p50_b_ms:.4g} ms "
            f"against the original, interleaved",
        )
        measured.append((entry, ledger, outcome))
    setup.progress("passes", 1.0)
    if measured:
        best_entry, ledger, outcome = max(measured, key=lambda item: item[0]["speedup"])
        best_entry["status"] = "chosen"
        best_entry["reason"] = "fastest within tolerance; " + best_entry["reason"]
        return Search(ledger, outcome, candidates)
    # Nothing verified: hand the gate no kept pass (so it returns the upload), with the first ledger's records.
    ledger, bisection = (first[0], first[1].bisection) if first else (Ledger(setup), None)
    ledger.kept, ledger.valid_positions = [], {}
    ledger.dynamic_axes = {k: set(v) for k, v in setup.dynamic_axes.items()}
    return Search(ledger, Outcome(setup.source, setup.verifier.check(setup.source), bisection), candidates)
