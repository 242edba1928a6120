"""The JobStore fixtures the store tests share: a controllable clock and a store on SQLite and PostgreSQL.

PostgreSQL is tests/conftest.py's ``postgres_server`` (the shared one, or a private one it starts); each test
uses its own schema, dropped at the end.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from core.store import Job, JobStore

LEASE = 60
SHA = "a" * 64


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def store(request: pytest.FixtureRequest, tmp_path: Path, clock: Clock) -> Iterator[JobStore]:
    if request.param == "sqlite":
        job_store = JobStore(f"sqlite:///{tmp_path / 'db' / 'jobs.db'}", clock=clock)
        job_store.create_schema()
        yield job_store
        job_store.close()
        return
    schema = f"onnxforge_test_{uuid.uuid4().hex[:12]}"
    pg_url = request.getfixturevalue("postgres_server")
    admin = create_engine(pg_url, connect_args={"connect_timeout": 5})
    job_store = JobStore(pg_url, schema=schema, clock=clock)
    try:
        job_store.create_schema()
        yield job_store
    finally:
        job_store.close()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def create_job(store: JobStore, tenant: str = "default", queue: str = "cpu") -> Job:
    return store.create(
        tenant=tenant,
        model_sha256=SHA,
        model_filename="model.onnx",
        model_format="onnx",
        model_size=5 << 30,  # above 2**32: the column must be 64-bit
        samples_sha256=None,
        config={"preset": "safe", "target": "cpu"},
        queue=queue,
    )
