"""Retention (core/retention.py) on a real job table (SQLite) and blob store: what purge removes, and what it keeps.

A controllable clock ages the jobs; blobs are real files, deleted or kept on disk.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from core.errors import NotFoundError
from core.retention import purge
from core.settings import RetentionSettings
from core.storage import BlobStore
from core.store import Job, JobStore


class Clock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[JobStore]:
    job_store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}", clock=clock)
    job_store.create_schema()
    yield job_store
    job_store.close()


@pytest.fixture
def blobs(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")


def _finished_job(store: JobStore, blobs: BlobStore, tenant: str = "team-a", model: bytes | None = None) -> Job:
    """A succeeded job with its own model, artifact and reports on disk."""
    tag = os.urandom(8)
    model_sha = blobs.put_bytes(model if model is not None else b"model" + tag)
    job = store.create(
        tenant=tenant,
        model_sha256=model_sha,
        model_filename="m.onnx",
        model_format="onnx",
        model_size=10,
        samples_sha256=blobs.put_bytes(b"samples" + tag),
        config={},
        queue="cpu",
        cache_key="k" * 64,
    )
    claimed = store.claim(job.id, "w", 60, max_attempts=3)
    assert claimed is not None
    assert store.succeed(
        job.id,
        claimed.attempts,
        artifact_sha256=blobs.put_bytes(b"artifact" + tag),
        artifact_format="onnx",
        report_sha256=blobs.put_bytes(b"report" + tag),
        report_html_sha256=blobs.put_bytes(b"html" + tag),
        summary={},
        timings={},
        hardware_class="cpu-test",
    )
    return store.get(job.id)


def _on_disk(blobs: BlobStore, *shas: str | None) -> list[bool]:
    return [sha is not None and blobs.exists(sha) for sha in shas]


def test_purge_deletes_each_kind_when_its_time_to_live_has_passed(store: JobStore, blobs: BlobStore, clock: Clock):
    job = _finished_job(store, blobs)
    settings = RetentionSettings(uploads_days=1, artifacts_days=7, reports_days=30, blob_grace_seconds=0)

    clock.now += timedelta(days=2)
    first = purge(store, blobs, settings, now=clock.now)
    assert first.files_expired == {"uploads": 1, "artifacts": 0, "reports": 0}
    assert _on_disk(blobs, job.model_sha256, job.samples_sha256, job.artifact_sha256) == [False, False, True]
    assert store.get(job.id).uploads_expired_at is not None

    clock.now += timedelta(days=6)
    purge(store, blobs, settings, now=clock.now)
    expired = store.get(job.id)
    assert expired.artifact_expired_at is not None and expired.reports_expired_at is None
    assert _on_disk(blobs, job.artifact_sha256, job.report_sha256, job.report_html_sha256) == [False, True, True]
    # The result cache no longer reuses a job whose optimized model is gone.
    assert store.find_cached("k" * 64, tenant=None, queue="cpu", max_age_seconds=0, hardware_sample_jobs=5) is None

    again = purge(store, blobs, settings, now=clock.now)
    assert again.files_expired == {"uploads": 0, "artifacts": 0, "reports": 0}
    assert again.blobs_deleted == 0


def test_purge_deletes_job_row_and_all_its_files_when_jobs_ttl_passed(store: JobStore, blobs: BlobStore, clock: Clock):
    job = _finished_job(store, blobs)
    settings = RetentionSettings(jobs_days=10, blob_grace_seconds=0)

    clock.now += timedelta(days=9)
    assert purge(store, blobs, settings, now=clock.now).jobs_deleted == 0
    clock.now += timedelta(days=2)
    stats = purge(store, blobs, settings, now=clock.now)

    assert stats.jobs_deleted == 1 and stats.blobs_deleted == 5
    with pytest.raises(NotFoundError):
        store.get(job.id)
    shas = (job.model_sha256, job.samples_sha256, job.artifact_sha256, job.report_sha256, job.report_html_sha256)
    assert _on_disk(blobs, *shas) == [False] * 5


def test_purge_keeps_file_when_another_job_still_needs_it(store: JobStore, blobs: BlobStore, clock: Clock):
    old = _finished_job(store, blobs, model=b"the same model")
    clock.now += timedelta(days=5)
    young = _finished_job(store, blobs, model=b"the same model")
    settings = RetentionSettings(jobs_days=3, blob_grace_seconds=0)

    stats = purge(store, blobs, settings, now=clock.now)

    assert stats.jobs_deleted == 1
    assert old.model_sha256 == young.model_sha256
    assert _on_disk(blobs, young.model_sha256, old.artifact_sha256) == [True, False]


def test_purge_applies_a_teams_own_retention_when_set(store: JobStore, blobs: BlobStore, clock: Clock):
    a = _finished_job(store, blobs, tenant="team-a")
    b = _finished_job(store, blobs, tenant="team-b")
    settings = RetentionSettings(jobs_days=30, teams={"team-b": {"jobs_days": 1}}, blob_grace_seconds=0)

    clock.now += timedelta(days=2)
    purge(store, blobs, settings, now=clock.now)

    assert store.get(a.id).state == "succeeded"
    with pytest.raises(NotFoundError):
        store.get(b.id)


def test_purge_leaves_fresh_files_for_the_next_run_when_within_grace(store: JobStore, blobs: BlobStore, clock: Clock):
    job = _finished_job(store, blobs)
    settings = RetentionSettings(jobs_days=1, blob_grace_seconds=3600)

    clock.now += timedelta(days=2)
    stats = purge(store, blobs, settings, now=clock.now)

    assert (stats.jobs_deleted, stats.blobs_deleted, stats.blobs_kept_in_grace) == (1, 0, 5)
    old = time.time() - 7200
    os.utime(blobs.path(job.model_sha256), (old, old))
    swept = purge(store, blobs, settings, now=clock.now, sweep=True)
    assert swept.blobs_deleted == 1  # the sweep collects the orphan once its grace is over
    assert not blobs.exists(job.model_sha256)


def test_purge_removes_job_when_delete_was_requested_while_it_ran(store: JobStore, blobs: BlobStore):
    job = _finished_job(store, blobs)
    running = store.create(
        tenant="team-a",
        model_sha256=job.model_sha256,
        model_filename="m.onnx",
        model_format="onnx",
        model_size=10,
        samples_sha256=None,
        config={},
        queue="cpu",
    )
    claimed = store.claim(running.id, "w", 60, max_attempts=3)
    assert claimed is not None
    _, deleted = store.remove(running.id, "team-a")
    assert not deleted
    # The worker finished before it saw the cancel: the row stays until purge.
    assert store.succeed(
        running.id,
        claimed.attempts,
        artifact_sha256=blobs.put_bytes(b"late artifact"),
        artifact_format="onnx",
        report_sha256=job.report_sha256 or "",
        report_html_sha256=job.report_html_sha256 or "",
        summary={},
        timings={},
    )

    stats = purge(store, blobs, RetentionSettings(blob_grace_seconds=0))

    assert stats.jobs_deleted == 1
    with pytest.raises(NotFoundError):
        store.get(running.id)
    assert _on_disk(blobs, job.model_sha256, job.report_sha256) == [True, True]  # the first job still has them
