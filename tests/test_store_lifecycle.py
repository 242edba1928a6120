"""JobStore on SQLite and PostgreSQL: the result cache, webhooks, migrations, retention and quotas.

PostgreSQL is tests/conftest.py's ``postgres_server`` (the shared one, or a private one it starts); each run
uses its own schema, dropped at the end. A controllable clock makes leases expire without sleeping.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from core import migrations
from core.errors import ConflictError, InvalidConfigError, NotFoundError
from core.quotas import Quota, QuotaExceededError
from core.store import Intake, Job, JobStore
from tests._store_fixtures import LEASE, SHA, Clock, clock, create_job, store  # noqa: F401  (fixtures)

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
    kept = create_job(old)
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
    assert create_job(store).cache_key is None
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
            conn,
            opts={
                "include_schemas": bool(store.schema),
                "version_table_schema": store.schema,
                # only this test's schema: other runs' schemas may share the database
                "include_name": lambda name, kind, _parents: kind != "schema" or name == store.schema,
            },
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
    assert create_job(store).idempotency_key is None


def _pretend_newer_version_migrated(store: JobStore, revision: str, oldest_compatible: str) -> None:
    """Leave the database as a newer onnxforge would: its revision in alembic_version, its floor recorded."""
    with store._engine.begin() as conn:
        table = f'"{store.schema}".' if store.schema else ""
        conn.execute(text(f"UPDATE {table}alembic_version SET version_num = :r"), {"r": revision})
        conn.execute(
            text(f"UPDATE {table}{migrations.FLOOR_TABLE} SET revision = :r, oldest_compatible = :o"),
            {"r": revision, "o": oldest_compatible},
        )


def test_head_records_the_oldest_revision_whose_code_runs_on_it(store: JobStore) -> None:
    with store._engine.connect() as conn:
        assert migrations.floor(conn, store.schema) == migrations.oldest_compatible(migrations.head())
    assert migrations.oldest_compatible("0003") == "0002"  # a new table: code at 0002 runs on it
    assert migrations.oldest_compatible("0002") == "0002"  # no floor declared: only its own code
    assert migrations.runs_on("0002") and migrations.runs_on(migrations.head())
    assert not migrations.runs_on("9999") and not migrations.is_known("9999")


def test_prepare_runs_on_newer_schema_that_allows_this_version_and_leaves_it_as_is(store: JobStore) -> None:
    """A rolling upgrade: the new version migrated first, an old replica restarts (auto_migrate on or off)."""
    _pretend_newer_version_migrated(store, "9999", oldest_compatible=migrations.head())

    store.prepare(auto_migrate=True)
    store.prepare(auto_migrate=False)
    store.check_schema()

    assert store.schema_revision() == "9999"  # never "upgraded" back to this version's head
    job = create_job(store)
    assert store.get(job.id).id == job.id


def test_prepare_refuses_newer_schema_whose_floor_is_above_this_version(store: JobStore) -> None:
    _pretend_newer_version_migrated(store, "9999", oldest_compatible="9998")

    for start in (lambda: store.prepare(auto_migrate=True), lambda: store.prepare(auto_migrate=False)):
        with pytest.raises(InvalidConfigError, match="newer than this version's") as caught:
            start()
        assert caught.value.code == "SCHEMA_NEWER"
        assert "9998" in str(caught.value)
    assert store.schema_revision() == "9999"


def test_downgrade_below_the_floor_table_drops_it_and_upgrade_records_it_again(store: JobStore) -> None:
    with store._engine.begin() as conn:
        migrations.downgrade(conn, store.schema, "0002")
        assert migrations.floor(conn, store.schema) is None
    store.create_schema()
    with store._engine.connect() as conn:
        assert migrations.floor(conn, store.schema) == "0002"


def test_remove_deletes_queued_job_at_once_and_flags_running_one(store: JobStore) -> None:
    queued = create_job(store, tenant="t")
    running = create_job(store, tenant="t")
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
    job = create_job(store)
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
