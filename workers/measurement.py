"""The engine's latency measurement offered to passes (``passes._infra.Measure``) through ``PassContext``.

Passes never import ``workers`` (the floors contract forbids it), yet ``tune_session`` must time sessions.
The engine hands it this: ``workers.benchmark.compare`` on the same two-model interleaving the ledger uses,
with sessions built as ``workers.verify.make_session`` builds them (ORT_ENABLE_ALL, then the recipe through
``core.recipe``'s whitelist: only what ``core.runtime.load`` would give users is measured), returning the
pooled verdict of ``core.verdict``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.inputs import InputSet
from core.verdict import Verdict
from workers.benchmark import BenchmarkParams, compare

WARMUP = 2  # untimed runs of each session per feed before the paired runs


@dataclasses.dataclass(frozen=True)
class BenchmarkMeasure:
    """``passes._infra.Measure`` on ``workers.benchmark``: a fixed number of paired runs, no time budget."""

    target: str = "cpu"
    intra_op_threads: int = 0

    def __call__(
        self,
        model_a: Path,
        model_b: Path,
        feeds: Sequence[Mapping[str, np.ndarray]],
        *,
        runs: int,
        recipe_a: Mapping[str, Any] | None = None,
        recipe_b: Mapping[str, Any] | None = None,
    ) -> Verdict:
        params = BenchmarkParams(
            warmup=WARMUP,
            min_runs=runs,
            max_runs=runs,
            max_seconds=0.0,
            target=self.target,
            intra_op_threads=self.intra_op_threads,
            cuda_graph=False,  # a pass compares sessions as configured; the graph is the final benchmark's choice
        )
        sets = [InputSet(f"feed {i}", dict(feed)) for i, feed in enumerate(feeds)]
        comparison = compare(
            model_a,
            model_b,
            sets,
            params,
            mode="measure",
            recipe_a=dict(recipe_a) if recipe_a is not None else None,
            recipe_b=dict(recipe_b) if recipe_b is not None else None,
        )
        return comparison.pooled
