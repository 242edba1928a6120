"""JobStore on SQLite and PostgreSQL: the same tests against both back ends.

PostgreSQL is tests/conftest.py's ``postgres_server`` (the shared one, or a private one it starts); each run
uses its own schema, dropped at the end. A controllable clock makes leases expire without sleeping.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest

from core.errors import ConflictError, NotFoundError, UnavailableError
from core.store import Job, JobStore
from tests._store_fixtures import LEASE, SHA, Clock, clock, create_job, store  # noqa: F401  (fixtures)


def test_create_returns_queued_job_with_server_id(store: JobStore, clock: Clock) -> None:
    job = create_job(store)
    assert uuid.UUID(job.id).version == 4
    assert job.state == "queued"
    assert job.attempts == 0
    assert job.created_at == clock.now
    assert job.model_size == 5 << 30
    assert job.config == {"preset": "safe", "target": "cpu"}
    assert not job.cancel_requested
    assert store.get(job.id) == job


def test_create_schema_is_idempotent(store: JobStore) -> None:
    job = create_job(store)
    store.create_schema()
    assert store.get(job.id).id == job.id


def test_get_raises_job_not_found_when_id_unknown_or_malformed(store: JobStore) -> None:
    for job_id in (str(uuid.uuid4()), "not-a-uuid", "../../x"):
        with pytest.raises(NotFoundError) as info:
            store.get(job_id)
        assert info.value.code == "JOB_NOT_FOUND"


def test_get_raises_not_found_when_job_belongs_to_another_tenant(store: JobStore) -> None:
    job = create_job(store, tenant="alice")
    assert store.get(job.id, "alice").id == job.id
    with pytest.raises(NotFoundError):
        store.get(job.id, "bob")


def test_list_returns_newest_first_with_total_and_pages(store: JobStore, clock: Clock) -> None:
    ids = []
    for _ in range(5):
        ids.append(create_job(store).id)
        clock.advance(1)
    page, total = store.list("default", limit=2, offset=0)
    assert total == 5
    assert [j.id for j in page] == ids[::-1][:2]
    page, total = store.list("default", limit=2, offset=4)
    assert [j.id for j in page] == [ids[0]]
    assert total == 5


def test_list_filters_by_tenant_and_state(store: JobStore) -> None:
    mine = create_job(store, tenant="alice")
    create_job(store, tenant="bob")
    canceled = store.request_cancel(create_job(store, tenant="alice").id, "alice")
    jobs, total = store.list("alice", limit=10, offset=0)
    assert {j.id for j in jobs} == {mine.id, canceled.id}
    assert total == 2
    jobs, total = store.list("alice", limit=10, offset=0, state="canceled")
    assert [j.id for j in jobs] == [canceled.id]
    assert total == 1
    assert store.list(None, limit=10, offset=0)[1] == 3


def test_delete_removes_job(store: JobStore) -> None:
    job = create_job(store)
    store.delete(job.id)
    with pytest.raises(NotFoundError):
        store.get(job.id)


def test_claim_starts_attempt_when_queued(store: JobStore, clock: Clock) -> None:
    job = create_job(store)
    claimed = store.claim(job.id, "w1", LEASE, max_attempts=3)
    assert claimed is not None
    assert claimed.state == "running"
    assert claimed.attempts == 1
    assert claimed.worker == "w1"
    assert claimed.started_at == clock.now
    assert claimed.lease_expires_at == clock.now + timedelta(seconds=LEASE)


def test_claim_returns_none_when_leased_by_another_worker(store: JobStore, clock: Clock) -> None:
    job = create_job(store)
    assert store.claim(job.id, "w1", LEASE, max_attempts=3) is not None
    clock.advance(LEASE - 1)
    assert store.claim(job.id, "w2", LEASE, max_attempts=3) is None
    assert store.get(job.id).worker == "w1"


def test_claim_takes_over_and_increments_attempts_when_lease_expired(store: JobStore, clock: Clock) -> None:
    job = create_job(store)
    assert store.claim(job.id, "w1", LEASE, max_attempts=3) is not None
    clock.advance(LEASE + 1)
    second = store.claim(job.id, "w2", LEASE, max_attempts=3)
    assert second is not None
    assert second.attempts == 2
    assert second.worker == "w2"


def test_claim_fails_job_worker_lost_when_max_attempts_reached(store: JobStore, clock: Clock) -> None:
    job = create_job(store)
    for _ in range(2):
        assert store.claim(job.id, "w", LEASE, max_attempts=2) is not None
        clock.advance(LEASE + 1)
    assert store.claim(job.id, "w", LEASE, max_attempts=2) is None
    failed = store.get(job.id)
    assert failed.state == "failed"
    assert failed.error_code == "WORKER_LOST"
    assert failed.error_message == "job was delivered 2 times without finishing"
    assert failed.finished_at == clock.now
    assert failed.attempts == 2


def test_claim_returns_none_when_job_terminal(store: JobStore) -> None:
    job = create_job(store)
    store.request_cancel(job.id, "default")
    assert store.claim(job.id, "w", LEASE, max_attempts=3) is None
    assert store.get(job.id).state == "canceled"


def test_claim_cancels_when_cancel_requested_and_lease_expired(store: JobStore, clock: Clock) -> None:
    job = create_job(store)
    store.claim(job.id, "w1", LEASE, max_attempts=3)
    store.request_cancel(job.id, "default")
    clock.advance(LEASE + 1)
    assert store.claim(job.id, "w2", LEASE, max_attempts=3) is None
    assert store.get(job.id).state == "canceled"


def test_heartbeat_extends_lease_and_reports_cancel_when_attempt_current(store: JobStore, clock: Clock) -> None:
    job = create_job(store)
    store.claim(job.id, "w", LEASE, max_attempts=3)
    clock.advance(30)
    beat = store.heartbeat(job.id, 1, stage="passes", progress=0.25, lease_seconds=LEASE)
    assert beat is not None
    assert (beat.stage, beat.progress) == ("passes", 0.25)
    assert beat.lease_expires_at == clock.now + timedelta(seconds=LEASE)
    assert not beat.cancel_requested
    store.request_cancel(job.id, "default")
    beat = store.heartbeat(job.id, 1, lease_seconds=LEASE)
    assert beat is not None
    assert beat.cancel_requested
    assert beat.stage == "passes"


def test_stale_attempt_cannot_heartbeat_succeed_fail_or_cancel(store: JobStore, clock: Clock) -> None:
    job = create_job(store)
    store.claim(job.id, "w1", LEASE, max_attempts=3)
    clock.advance(LEASE + 1)
    store.claim(job.id, "w2", LEASE, max_attempts=3)  # attempt 2 now owns the job
    assert store.heartbeat(job.id, 1, lease_seconds=LEASE) is None
    assert not store.succeed(
        job.id,
        1,
        artifact_sha256=SHA,
        artifact_format="onnx",
        report_sha256=SHA,
        report_html_sha256=SHA,
        summary={},
        timings={},
    )
    assert not store.fail(job.id, 1, code="X", message="stale")
    assert not store.mark_canceled(job.id, 1)
    current = store.get(job.id)
    assert (current.state, current.attempts, current.worker) == ("running", 2, "w2")


def test_succeed_records_results_when_attempt_current(store: JobStore, clock: Clock) -> None:
    job = create_job(store)
    store.claim(job.id, "w", LEASE, max_attempts=3)
    clock.advance(5)
    assert store.succeed(
        job.id,
        1,
        artifact_sha256="b" * 64,
        artifact_format="onnx",
        report_sha256="c" * 64,
        report_html_sha256="d" * 64,
        summary={"speedup": 1.5},
        timings={"passes": 1.25},
    )
    done = store.get(job.id)
    assert done.state == "succeeded"
    assert done.progress == 1.0
    assert done.finished_at == clock.now
    assert done.lease_expires_at is None
    assert (done.artifact_sha256, done.report_sha256, done.report_html_sha256) == (
        "b" * 64,
        "c" * 64,
        "d" * 64,
    )
    assert done.summary == {"speedup": 1.5}
    assert done.timings == {"passes": 1.25}
    # A duplicate delivery of the same attempt cannot finish it twice.
    assert not store.fail(job.id, 1, code="X", message="late")


def test_fail_records_error_when_attempt_current(store: JobStore) -> None:
    job = create_job(store)
    store.claim(job.id, "w", LEASE, max_attempts=3)
    assert store.fail(job.id, 1, code="PASS_FAILED", message="boom" * 2000, pass_name="constant_folding")
    failed = store.get(job.id)
    assert (failed.state, failed.error_code, failed.error_pass) == (
        "failed",
        "PASS_FAILED",
        "constant_folding",
    )
    assert failed.error_message is not None
    assert len(failed.error_message) <= 4000


def test_fail_without_attempt_fails_any_non_terminal_job(store: JobStore) -> None:
    queued = create_job(store)
    assert store.fail(queued.id, None, code="MODEL_INVALID", message="bad")
    assert store.get(queued.id).state == "failed"
    assert not store.fail(queued.id, None, code="AGAIN", message="already terminal")
    assert store.get(queued.id).error_code == "MODEL_INVALID"


def test_mark_canceled_when_attempt_current(store: JobStore) -> None:
    job = create_job(store)
    store.claim(job.id, "w", LEASE, max_attempts=3)
    store.request_cancel(job.id, "default")
    assert store.mark_canceled(job.id, 1)
    assert store.get(job.id).state == "canceled"


def test_request_cancel_cancels_queued_job_at_once(store: JobStore, clock: Clock) -> None:
    job = create_job(store)
    canceled = store.request_cancel(job.id, "default")
    assert canceled.state == "canceled"
    assert canceled.finished_at == clock.now


def test_request_cancel_flags_running_job(store: JobStore) -> None:
    job = create_job(store)
    store.claim(job.id, "w", LEASE, max_attempts=3)
    flagged = store.request_cancel(job.id, "default")
    assert (flagged.state, flagged.cancel_requested) == ("running", True)
    assert store.request_cancel(job.id, "default").cancel_requested  # idempotent


def test_request_cancel_raises_conflict_when_job_finished(store: JobStore) -> None:
    job = create_job(store)
    store.request_cancel(job.id, "default")
    with pytest.raises(ConflictError) as info:
        store.request_cancel(job.id, "default")
    assert info.value.code == "JOB_FINISHED"


def test_request_cancel_raises_not_found_when_other_tenant(store: JobStore) -> None:
    job = create_job(store, tenant="alice")
    with pytest.raises(NotFoundError):
        store.request_cancel(job.id, "bob")
    assert store.get(job.id).state == "queued"


def test_stale_lists_expired_leases_and_old_queued_jobs(store: JobStore, clock: Clock) -> None:
    old_queued = create_job(store)
    running = create_job(store)
    store.claim(running.id, "w", LEASE, max_attempts=3)
    clock.advance(LEASE + 1)
    fresh_queued = create_job(store)
    leased = create_job(store)
    store.claim(leased.id, "w", LEASE, max_attempts=3)
    stale = store.stale(clock.now, queued_older_than_seconds=30)
    assert {j.id for j in stale} == {old_queued.id, running.id}
    assert fresh_queued.id not in {j.id for j in stale}


def test_touch_queued_defers_staleness(store: JobStore, clock: Clock) -> None:
    job = create_job(store)
    clock.advance(100)
    assert [j.id for j in store.stale(clock.now, queued_older_than_seconds=30)] == [job.id]
    store.touch_queued(job.id)
    assert store.stale(clock.now, queued_older_than_seconds=30) == []


def test_ping_raises_database_unavailable_when_server_down(tmp_path: Path) -> None:
    dead = JobStore("postgresql+psycopg://postgres@127.0.0.1:1/none")
    with pytest.raises(UnavailableError) as info:
        dead.ping()
    assert info.value.code == "DATABASE_UNAVAILABLE"


def test_ping_passes_when_database_answers(store: JobStore) -> None:
    store.ping()


def test_claim_has_exactly_one_winner_when_workers_race(store: JobStore) -> None:
    job = create_job(store)
    barrier = threading.Barrier(8)

    def claim(n: int) -> Job | None:
        barrier.wait()
        return store.claim(job.id, f"w{n}", LEASE, max_attempts=3)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(claim, range(8)))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    assert store.get(job.id).attempts == 1


@pytest.mark.parametrize("schema", ['x"; DROP TABLE jobs; --', "1abc", "a" * 64])
def test_store_refuses_schema_name_when_not_an_identifier(schema: str) -> None:
    with pytest.raises(ValueError, match="schema_name"):
        JobStore("postgresql+psycopg://postgres@127.0.0.1/test", schema=schema)


def test_store_refuses_schema_name_when_sqlite(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="PostgreSQL only"):
        JobStore(f"sqlite:///{tmp_path / 'jobs.db'}", schema="onnxforge")
