"""JobStore on SQLite and PostgreSQL: the same tests against both back ends.

PostgreSQL is tests/conftest.py's ``postgres_server`` (the shared one, or a private one it starts); each run
uses its own schema, dropped at the end. A controllable clock makes leases expire without sleeping.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from core import migrations
from core.errors import ConflictError, InvalidConfigError, NotFoundError, UnavailableError
from core.quotas import Quota, QuotaExceededError
from core.store import Intake, Job, JobStore

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


def _create(store: JobStore, tenant: str = "default", queue: str = "cpu") -> Job:
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


def test_create_returns_queued_job_with_server_id(store: JobStore, clock: Clock) -> None:
    job = _create(store)
    assert uuid.UUID(job.id).version == 4
    assert job.state == "queued"
    assert job.attempts == 0
    assert job.created_at == clock.now
    assert job.model_size == 5 << 30
    assert job.config == {"preset": "safe", "target": "cpu"}
    assert not job.cancel_requested
    assert store.get(job.id) == job


def test_create_schema_is_idempotent(store: JobStore) -> None:
    job = _create(store)
    store.create_schema()
    assert store.get(job.id).id == job.id


def test_get_raises_job_not_found_when_id_unknown_or_malformed(store: JobStore) -> None:
    for job_id in (str(uuid.uuid4()), "not-a-uuid", "../../x"):
        with pytest.raises(NotFoundError) as info:
            store.get(job_id)
        assert info.value.code == "JOB_NOT_FOUND"


def test_get_raises_not_found_when_job_belongs_to_another_tenant(store: JobStore) -> None:
    job = _create(store, tenant="alice")
    assert store.get(job.id, "alice").id == job.id
    with pytest.raises(NotFoundError):
        store.get(job.id, "bob")


def test_list_returns_newest_first_with_total_and_pages(store: JobStore, clock: Clock) -> None:
    ids = []
    for _ in range(5):
        ids.append(_create(store).id)
        clock.advance(1)
    page, total = store.list("default", limit=2, offset=0)
    assert total == 5
    assert [j.id for j in page] == ids[::-1][:2]
    page, total = store.list("default", limit=2, offset=4)
    assert [j.id for j in page] == [ids[0]]
    assert total == 5


def test_list_filters_by_tenant_and_state(store: JobStore) -> None:
    mine = _create(store, tenant="alice")
    _create(store, tenant="bob")
    canceled = store.request_cancel(_create(store, tenant="alice").id, "alice")
    jobs, total = store.list("alice", limit=10, offset=0)
    assert {j.id for j in jobs} == {mine.id, canceled.id}
    assert total == 2
    jobs, total = store.list("alice", limit=10, offset=0, state="canceled")
    assert [j.id for j in jobs] == [canceled.id]
    assert total == 1
    assert store.list(None, limit=10, offset=0)[1] == 3


def test_delete_removes_job(store: JobStore) -> None:
    job = _create(store)
    store.delete(job.id)
    with pytest.raises(NotFoundError):
        store.get(job.id)


def test_claim_starts_attempt_when_queued(store: JobStore, clock: Clock) -> None:
    job = _create(store)
    claimed = store.claim(job.id, "w1", LEASE, max_attempts=3)
    assert claimed is not None
    assert claimed.state == "running"
    assert claimed.attempts == 1
    assert claimed.worker == "w1"
    assert claimed.started_at == clock.now
    assert claimed.lease_expires_at == clock.now + timedelta(seconds=LEASE)


def test_claim_returns_none_when_leased_by_another_worker(store: JobStore, clock: Clock) -> None:
    job = _create(store)
    assert store.claim(job.id, "w1", LEASE, max_attempts=3) is not None
    clock.advance(LEASE - 1)
    assert store.claim(job.id, "w2", LEASE, max_attempts=3) is None
    assert store.get(job.id).worker == "w1"


def test_claim_takes_over_and_increments_attempts_when_lease_expired(store: JobStore, clock: Clock) -> None:
    job = _create(store)
    assert store.claim(job.id, "w1", LEASE, max_attempts=3) is not None
    clock.advance(LEASE + 1)
    second = store.claim(job.id, "w2", LEASE, max_attempts=3)
    assert second is not None
    assert second.attempts == 2
    assert second.worker == "w2"


def test_claim_fails_job_worker_lost_when_max_attempts_reached(store: JobStore, clock: Clock) -> None:
    job = _create(store)
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
    job = _create(store)
    store.request_cancel(job.id, "default")
    assert store.claim(job.id, "w", LEASE, max_attempts=3) is None
    assert store.get(job.id).state == "canceled"


def test_claim_cancels_when_cancel_requested_and_lease_expired(store: JobStore, clock: Clock) -> None:
    job = _create(store)
    store.claim(job.id, "w1", LEASE, max_attempts=3)
    store.request_cancel(job.id, "default")
    clock.advance(LEASE + 1)
    assert store.claim(job.id, "w2", LEASE, max_attempts=3) is None
    assert store.get(job.id).state == "canceled"


def test_heartbeat_extends_lease_and_reports_cancel_when_attempt_current(store: JobStore, clock: Clock) -> None:
    job = _create(store)
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
    job = _create(store)
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
    job = _create(store)
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
    job = _create(store)
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
    queued = _create(store)
    assert store.fail(queued.id, None, code="MODEL_INVALID", message="bad")
    assert store.get(queued.id).state == "failed"
    assert not store.fail(queued.id, None, code="AGAIN", message="already terminal")
    assert store.get(queued.id).error_code == "MODEL_INVALID"


def test_mark_canceled_when_attempt_current(store: JobStore) -> None:
    job = _create(store)
    store.claim(job.id, "w", LEASE, max_attempts=3)
    store.request_cancel(job.id, "default")
    assert store.mark_canceled(job.id, 1)
    assert store.get(job.id).state == "canceled"


def test_request_cancel_cancels_queued_job_at_once(store: JobStore, clock: Clock) -> None:
    job = _create(store)
    canceled = store.request_cancel(job.id, "default")
    assert canceled.state == "canceled"
    assert canceled.finished_at == clock.now


def test_request_cancel_flags_running_job(store: JobStore) -> None:
    job = _create(store)
    store.claim(job.id, "w", LEASE, max_attempts=3)
    flagged = store.request_cancel(job.id, "default")
    assert (flagged.state, flagged.cancel_requested) == ("running", True)
    assert store.request_cancel(job.id, "default").cancel_requested  # idempotent


def test_request_cancel_raises_conflict_when_job_finished(store: JobStore) -> None:
    job = _create(store)
    store.request_cancel(job.id, "default")
    with pytest.raises(ConflictError) as info:
        store.request_cancel(job.id, "default")
    assert info.value.code == "JOB_FINISHED"


def test_request_cancel_raises_not_found_when_other_tenant(store: JobStore) -> None:
    job = _create(store, tenant="alice")
    with pytest.raises(NotFoundError):
        store.request_cancel(job.id, "bob")
    assert store.get(job.id).state == "queued"


def test_stale_lists_expired_leases_and_old_queued_jobs(store: JobStore, clock: Clock) -> None:
    old_queued = _create(store)
    running = _create(store)
    store.claim(running.id, "w", LEASE, max_attempts=3)
    clock.advance(LEASE + 1)
    fresh_queued = _create(store)
    leased = _create(store)
    store.claim(leased.id, "w", LEASE, max_attempts=3)
    stale = store.stale(clock.now, queued_older_than_seconds=30)
    assert {j.id for j in stale} == {old_queued.id, running.id}
    assert fresh_queued.id not in {j.id for j in stale}


def test_touch_queued_defers_staleness(store: JobStore, clock: Clock) -> None:
    job = _create(store)
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
    job = _create(store)
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


# ---------------------------------------------------------------------------------- result cache, webhooks


def _run_to_success(store: JobStore, key: str, hardware: str, tenant: str = "default") -> Job:
    job = store.create(
        tenant=tenant,
        model_sha256=SHA,
        model_filename="model.onnx",
        model_format="onnx",
        model_size=10,
        samples_sha256=None,
        config={"preset": "safe"},
        queue="cpu",
        cache_key=key,
    )
    claimed = store.claim(job.id, "w", LEASE, max_attempts=3)
    assert claimed is not None
    assert store.succeed(
        job.id,
        claimed.attempts,
        artifact_sha256=SHA,
        artifact_format="onnx",
        report_sha256=SHA,
        report_html_sha256=SHA,
        summary={"speedup": 1.5},
        timings={},
        hardware_class=hardware,
    )
    return store.get(job.id)


def test_find_cached_returns_job_only_when_tenant_age_and_live_hardware_match(store: JobStore, clock: Clock) -> None:
    key = "k" * 64
    earlier = _run_to_success(store, key, "cpu:A:1")
    found = store.find_cached(key, tenant="default", queue="cpu", max_age_seconds=3600, hardware_sample_jobs=5)
    assert found is not None and found.id == earlier.id
    assert store.find_cached(key, tenant="other", queue="cpu", max_age_seconds=3600, hardware_sample_jobs=5) is None
    assert store.find_cached(key, tenant=None, queue="cpu", max_age_seconds=3600, hardware_sample_jobs=5) is not None
    assert store.find_cached("x" * 64, tenant="default", queue="cpu", max_age_seconds=0, hardware_sample_jobs=5) is None

    hit = store.create_cached(earlier, tenant="default", model_filename="again.onnx", config={"preset": "safe"})
    assert (hit.state, hit.cached_from, hit.summary) == ("succeeded", earlier.id, {"speedup": 1.5, "cached": True})
    assert (hit.artifact_sha256, hit.hardware_class, hit.attempts) == (SHA, "cpu:A:1", 0)

    clock.advance(7200)
    assert store.find_cached(key, tenant="default", queue="cpu", max_age_seconds=3600, hardware_sample_jobs=5) is None
    assert store.find_cached(key, tenant="default", queue="cpu", max_age_seconds=0, hardware_sample_jobs=5) is not None

    # The queue is now served by other hardware: once the last N runs are all class B, A's result is stale.
    for _ in range(2):
        clock.advance(1)
        _run_to_success(store, "other" + "k" * 59, "cpu:B:2")
    assert store.find_cached(key, tenant="default", queue="cpu", max_age_seconds=0, hardware_sample_jobs=3) is not None
    assert store.find_cached(key, tenant="default", queue="cpu", max_age_seconds=0, hardware_sample_jobs=2) is None


def test_claim_webhook_lets_one_attempt_win_and_retry_waits_when_finished_with_delay(
    store: JobStore, clock: Clock
) -> None:
    job = store.create(
        tenant="default",
        model_sha256=SHA,
        model_filename="model.onnx",
        model_format="onnx",
        model_size=10,
        samples_sha256=None,
        config={"callback_url": "https://hooks.example.com/x"},
        queue="cpu",
        webhook=True,
    )
    assert job.webhook_state == "pending"
    assert store.due_webhooks(clock(), 10) == []  # not terminal yet
    store.request_cancel(job.id, None)
    assert [j.id for j in store.due_webhooks(clock(), 10)] == [job.id]

    first = store.claim_webhook(job.id, 0, lease_seconds=30)
    assert first is not None and first.webhook_attempts == 1
    assert store.claim_webhook(job.id, 0, lease_seconds=30) is None  # another worker lost the race
    assert store.due_webhooks(clock(), 10) == []  # claimed: not due while the attempt runs

    store.finish_webhook(job.id, 1, delivered=False, error="the receiver answered 500", retry_in_seconds=10)
    assert store.due_webhooks(clock(), 10) == []
    clock.advance(11)
    assert store.claim_webhook(job.id, 1, lease_seconds=30) is not None
    store.finish_webhook(job.id, 2, delivered=True, error=None, retry_in_seconds=None)
    done = store.get(job.id)
    assert (done.webhook_state, done.webhook_attempts, done.webhook_error) == ("delivered", 2, None)
    assert store.due_webhooks(clock() + timedelta(days=1), 10) == []


def test_create_schema_adopts_table_when_made_before_migrations(tmp_path: Path) -> None:
    """A database from before Alembic: the table (without the columns later versions added), no
    alembic_version. The baseline revision adds what is missing instead of creating the table again."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    added = ("cache_key", "cached_from", "hardware_class", "webhook_state", "webhook_attempts", "webhook_next_at")
    engine = create_engine(url)
    old = JobStore(url)
    old.create_schema()
    kept = _create(old)
    old.close()
    with engine.begin() as conn:  # back to the table as version 0.1 created it, before migrations
        conn.execute(text("DROP TABLE alembic_version"))
        for index in ("ix_jobs_cache_key", "ix_jobs_webhook", "ux_jobs_tenant_idempotency", "ix_jobs_tenant_state"):
            conn.execute(text(f"DROP INDEX {index}"))
        for name in (*added, *_REVISION_0002_COLUMNS):
            conn.execute(text(f'ALTER TABLE jobs DROP COLUMN "{name}"'))
    assert not set(added) & {c["name"] for c in inspect(engine).get_columns("jobs")}

    store = JobStore(url)
    store.create_schema()

    assert store.schema_revision() == migrations.head()
    assert _schema_differences(store) == []
    assert store.get(kept.id).model_size == 5 << 30
    assert _create(store).cache_key is None
    store.close()
    engine.dispose()


_REVISION_0002_COLUMNS = (
    "idempotency_key",
    "request_sha256",
    "upload_bytes",
    "delete_requested",
    "uploads_expired_at",
    "artifact_expired_at",
    "reports_expired_at",
)


def _schema_differences(store: JobStore) -> list[object]:
    """What Alembic's autogenerate finds between the migrated database and core/jobtable.py."""
    with store._engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"include_schemas": bool(store.schema), "version_table_schema": store.schema}
        )
        diffs = compare_metadata(context, store.table.metadata)
    return [d for d in diffs if not (isinstance(d, tuple) and d[0] == "remove_table")]


def test_migrations_build_the_table_core_jobtable_defines_when_upgraded_to_head(store: JobStore) -> None:
    assert store.schema_revision() == migrations.head()
    assert _schema_differences(store) == []


def test_check_schema_refuses_database_when_behind_head_and_create_schema_upgrades_it(store: JobStore) -> None:
    with store._engine.begin() as conn:
        migrations.downgrade(conn, store.schema, "0001")
    assert store.schema_revision() == "0001"

    with pytest.raises(InvalidConfigError, match="onnxforge migrate") as caught:
        store.check_schema()
    assert caught.value.code == "SCHEMA_OUT_OF_DATE"

    store.create_schema()
    store.check_schema()
    assert _create(store).idempotency_key is None


def test_remove_deletes_queued_job_at_once_and_flags_running_one(store: JobStore) -> None:
    queued = _create(store, tenant="t")
    running = _create(store, tenant="t")
    claimed = store.claim(running.id, "w", LEASE, max_attempts=3)
    assert claimed is not None

    assert store.remove(queued.id, "t")[1] is True
    job, deleted = store.remove(running.id, "t")

    assert not deleted
    assert (job.state, job.cancel_requested, job.delete_requested) == ("running", True, True)
    with pytest.raises(NotFoundError):
        store.get(queued.id)
    with pytest.raises(NotFoundError):
        store.get(running.id, "t")  # gone for its tenant
    assert store.get(running.id).state == "running"  # the worker still sees it
    assert store.list("t", limit=10, offset=0) == ([], 0)
    assert store.mark_canceled(running.id, claimed.attempts)
    with pytest.raises(NotFoundError):
        store.get(running.id)
    with pytest.raises(NotFoundError):
        store.remove(queued.id, "t")


def test_referenced_ignores_columns_whose_files_expired(store: JobStore) -> None:
    job = _create(store)
    assert store.referenced([SHA, "b" * 64]) == {SHA}

    store.expire(job.id, ["uploads"])

    assert store.referenced([SHA]) == set()


def test_create_refuses_job_over_quota_and_duplicate_idempotency_key(store: JobStore) -> None:
    quota = Quota(max_concurrent_jobs=1, retry_after_seconds=9)
    intake = Intake(upload_bytes=10, idempotency_key="k-1", request_sha256="f" * 64)
    first = store.create(
        tenant="t", model_sha256=SHA, model_filename="m.onnx", model_format="onnx", model_size=10,
        samples_sha256=None, config={}, queue="cpu", intake=intake, quota=quota,
    )  # fmt: skip

    with pytest.raises(QuotaExceededError) as over:
        store.create(
            tenant="t", model_sha256=SHA, model_filename="m.onnx", model_format="onnx", model_size=10,
            samples_sha256=None, config={}, queue="cpu", quota=quota,
        )  # fmt: skip
    with pytest.raises(ConflictError) as duplicate:
        store.create(
            tenant="t", model_sha256=SHA, model_filename="m.onnx", model_format="onnx", model_size=10,
            samples_sha256=None, config={}, queue="cpu", intake=intake,
        )  # fmt: skip

    assert (over.value.code, over.value.detail["retry_after"]) == ("QUOTA_CONCURRENT_JOBS", 9)
    assert duplicate.value.code == "IDEMPOTENCY_KEY_IN_USE"
    assert store.find_idempotent("t", "k-1") == first
    assert store.find_idempotent("other", "k-1") is None
