"""Reliability runs (measured in docs/reliability.md): chaos, Redis restart, big upload, load, validator memory.

Every run starts its own processes on loopback and stops them: a private ``redis-server`` (system binary,
``appendonly yes`` in a temp dir, a free port), ``onnxforge serve`` and ``onnxforge worker`` subprocesses
with ``ONNXFORGE_*`` settings, and a temp data dir (SQLite job store) that is deleted afterwards. Nothing
touches the shared Redis or PostgreSQL. All loops are bounded in count and time.

    .venv/bin/python -m bench.reliability chaos --jobs 200
    .venv/bin/python -m bench.reliability redis
    .venv/bin/python -m bench.reliability oom
    .venv/bin/python -m bench.reliability upload --gb 2.2
    .venv/bin/python -m bench.reliability load --uploads 8 --upload-mb 100 --rps 200 --seconds 20
    .venv/bin/python -m bench.reliability validate --mb 300

Each prints a JSON result; ``--out FILE`` also writes it. tests/reliability/ runs the same functions with
small parameters and asserts on the results.
"""

from bench.reliability._stack import Stack, workspace
from bench.reliability.chaos import run_chaos, run_redis_restart
from bench.reliability.load import run_load
from bench.reliability.memory import run_oom, run_upload, run_validate

__all__ = ["Stack", "run_chaos", "run_load", "run_oom", "run_redis_restart", "run_upload", "run_validate", "workspace"]
