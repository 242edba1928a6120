"""Hostile-corpus fixtures: a runner set-up like tests/workers/test_runner.py (real child, SQLite job store,
temp blob store) and a CANARY: a file outside every job directory holding a random secret that must never
show up in an artifact, report, error message or log.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from core.settings import Settings
from core.storage import BlobStore
from core.store import JobStore
from workers.runner import run_job

FAST = {"benchmark_warmup": 1, "benchmark_min_runs": 3, "benchmark_max_seconds": 0.3, "ledger_runs": 2}


@dataclass
class Canary:
    path: Path
    secret: bytes


@dataclass
class Runner:
    settings: Settings
    store: JobStore
    blobs: BlobStore
    canary: Canary
    caplog: pytest.LogCaptureFixture
    tmp: Path

    def submit(self, path: Path, fmt: str = "onnx", **config: Any) -> str:
        job = self.store.create(
            tenant="t",
            model_sha256=self.blobs.put_file(path),
            model_filename=path.name,
            model_format=fmt,
            model_size=path.stat().st_size,
            samples_sha256=None,
            config={"rollback_slower": False, **config},
            queue="cpu",
        )
        return str(job.id)

    def run(self, path: Path, fmt: str = "onnx", **config: Any) -> Any:
        """Submit ``path`` and run one delivery to its end in this process (the child is real)."""
        job_id = self.submit(path, fmt, **config)
        run_job(job_id, self.settings, self.store, self.blobs)
        job = self.store.get(job_id)
        assert job.state in {"succeeded", "failed"}, job
        assert not (self.settings.storage.work_dir / job_id).exists(), "attempt directory left behind"
        self.assert_no_leak(job)
        return job

    def assert_no_leak(self, job: Any = None) -> None:
        secret = self.canary.secret
        text = secret.decode()
        if job is not None:
            assert text not in str(job.error_message or "")
            assert text not in repr(job.summary or {})
        assert text not in self.caplog.text
        for blob in self.blobs.root.glob("??/*"):
            assert secret not in blob.read_bytes(), f"canary secret leaked into blob {blob.name}"


@pytest.fixture
def canary(tmp_path: Path) -> Canary:
    secret = f"CANARY-{secrets.token_hex(16)}".encode()
    path = tmp_path / "canary.txt"
    path.write_bytes(secret * 64)  # 2.5 KB: big enough to satisfy any small tensor's length
    return Canary(path, secret)


@pytest.fixture
def runner(tmp_path: Path, canary: Canary, caplog: pytest.LogCaptureFixture) -> Iterator[Runner]:
    caplog.set_level(logging.DEBUG)
    settings = Settings(
        storage={"data_dir": tmp_path / "data"},
        worker={"lease_seconds": 30, "child_memory_mb": 2048},
        pipeline=FAST,
    )
    store = JobStore(settings.database_url)
    store.create_schema()
    blobs = BlobStore(settings.storage.blobs_dir)
    work = tmp_path / "fixtures"
    work.mkdir()
    yield Runner(settings, store, blobs, canary, caplog, work)
    store.close()


# The live API server of tests/api (uvicorn on a loopback port, small upload caps), for T12/T14.
from tests.api.conftest import api, live  # noqa: E402, F401
