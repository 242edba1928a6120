"""``make bench`` runs ``python -m bench.run``: every benchmark it names must exist in the checkout."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from bench import run

REPO = Path(__file__).resolve().parent.parent


def test_bench_run_names_only_modules_that_exist_when_listing():
    missing = [m for m, _ in {**run.BENCHMARKS, **run.ON_DEMAND}.values() if importlib.util.find_spec(m) is None]
    assert missing == []
    assert set(run.DEFAULT) <= set(run.BENCHMARKS)


def test_bench_run_lists_every_benchmark_when_called_with_list():
    out = subprocess.run(
        [sys.executable, "-m", "bench.run", "--list"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    for name in {**run.BENCHMARKS, **run.ON_DEMAND}:
        assert name in out
    assert "module missing" not in out


def test_bench_run_refuses_an_unknown_benchmark_when_asked_for_one():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--only", "nope"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_makefile_bench_target_calls_the_runner_when_read():
    makefile = (REPO / "Makefile").read_text()
    assert "-m bench.run" in makefile
