"""The job table: the single source of truth for every job's state (SQLAlchemy 2, SQLite or PostgreSQL).

States and who moves a job between them::

    queued --claim--> running --succeed--> succeeded
      |                 |  \\--fail-------> failed
      |                 |   \\-mark_canceled-> canceled
      +--request_cancel-+--> canceled (queued: at once; running: cancel_requested, the worker stops)

The broker only carries job ids, so a message may arrive twice or never. Every worker-side method is a
compare-and-set on ``(state, attempts)``: ``claim`` bumps ``attempts``, and a later ``heartbeat``,
``succeed``, ``fail`` or ``mark_canceled`` from an older attempt matches no row and changes nothing
(security.md T16, T18). ``stale`` lists what the reconciler re-enqueues.

The table is defined in core/jobtable.py and created or upgraded by Alembic revisions (core/migrations,
``create_schema`` / ``onnxforge migrate``). Queries that serve the result cache, metrics and webhooks live
in core/store_results.py, mixed into ``JobStore``.

SQLite (the embedded default) runs in WAL mode with a busy timeout so the API and worker processes share
it; write transactions start with ``BEGIN IMMEDIATE`` so two writers queue instead of failing on a lock
upgrade. Timestamps are stored as naive UTC and returned timezone-aware.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import MetaData, and_, create_engine, delete, event, func, or_, select, text, update
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError

from core import migrations
from core.errors import ConflictError, InvalidConfigError, NotFoundError, UnavailableError
from core.jobtable import STATES, TERMINAL_STATES, Intake, Job, jobs_table, to_json, valid_id
from core.quotas import WINDOW as QUOTA_WINDOW
from core.quotas import Quota
from core.store_results import ResultQueries
from core.store_retention import RetentionQueries

__all__ = ["STATES", "TERMINAL_STATES", "Intake", "Job", "JobStore"]

_MAX_MESSAGE_CHARS = 4000
_SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
# pg_advisory_xact_lock key serialising concurrent create_schema() calls (API and workers start together).
_SCHEMA_LOCK_KEY = 0x6F6E6E78
# pg_advisory_xact_lock(space, hashtext(tenant)) serialising one tenant's quota check and insert.
_TENANT_LOCK_SPACE = 0x6F6E6E

log = logging.getLogger(__name__)


class JobStore(ResultQueries, RetentionQueries):
    """The job table. Thread-safe: every method takes a pooled connection for one transaction."""

    def __init__(self, url: str, schema: str | None = None, *, clock: Callable[[], datetime] | None = None) -> None:
        self.url = make_url(url)
        self._clock = clock or (lambda: datetime.now(UTC))
        self._sqlite = self.url.get_backend_name() == "sqlite"
        if self._sqlite and schema:
            raise ValueError("database.schema_name applies to PostgreSQL only, not SQLite")
        if schema is not None and not _SCHEMA_NAME.fullmatch(schema):
            raise ValueError(f"database.schema_name must match {_SCHEMA_NAME.pattern}, got {schema!r}")
        self.schema = schema
        self._metadata = MetaData(schema=schema)
        self.table = jobs_table(self._metadata)
        self._engine = self._make_engine()

    def _make_engine(self) -> Engine:
        if not self._sqlite:
            connect_args = {"connect_timeout": 5} if self.url.get_backend_name() == "postgresql" else {}
            return create_engine(self.url, pool_pre_ping=True, connect_args=connect_args)
        if self.url.database and self.url.database != ":memory:":
            Path(self.url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(self.url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            # Let SQLAlchemy emit BEGIN itself (below) instead of pysqlite's implicit, deferred one.
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            write = conn.get_execution_options().get("onnxforge_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

        return engine

    @contextmanager
    def _tx(self, *, write: bool = True) -> Iterator[Connection]:
        try:
            with self._engine.connect() as conn:
                if write:
                    conn.execution_options(onnxforge_write=True)
                with conn.begin():
                    yield conn
        except OperationalError as exc:
            # Server down, connection lost, SQLite locked past busy_timeout: retry later, not a 500.
            raise UnavailableError(
                f"the job database is unavailable: {type(exc.orig).__name__}", code="DATABASE_UNAVAILABLE"
            ) from exc

    def close(self) -> None:
        self._engine.dispose()

    def create_schema(self) -> None:
        """Create or upgrade the table to the newest revision (core/migrations). Safe to run concurrently."""
        with self._tx() as conn:
            self._lock_schema(conn)
            found = migrations.current(conn, self.schema)
            if found is not None and not migrations.is_known(found):
                # A newer version migrated first (a rollout under way): run on its schema if it allows us,
                # never "upgrade" it back to our head.
                self._accept_newer(found, migrations.floor(conn, self.schema))
                return
            migrations.upgrade(conn, self.schema)

    def downgrade(self, revision: str) -> None:
        """Back to an older revision (rolling back a release): columns added since are dropped."""
        with self._tx() as conn:
            self._lock_schema(conn)
            migrations.downgrade(conn, self.schema, revision)

    def prepare(self, *, auto_migrate: bool) -> None:
        """At process start: upgrade the schema (auto_migrate), or refuse an old one; run on a newer one only
        where it records that this version's code runs on it (a rolling upgrade)."""
        if auto_migrate:
            self.create_schema()
        else:
            self.check_schema()

    def schema_revision(self) -> str | None:
        """The revision the database is at (None: never migrated)."""
        with self._tx(write=False) as conn:
            return migrations.current(conn, self.schema)

    def check_schema(self) -> None:
        """Raise InvalidConfigError unless the database is at the revision this version needs."""
        with self._tx(write=False) as conn:
            found, floor = migrations.current(conn, self.schema), migrations.floor(conn, self.schema)
        needed = migrations.head()
        if found is not None and found != needed and not migrations.is_known(found):
            self._accept_newer(found, floor)
        elif found != needed:
            raise InvalidConfigError(
                f"the job database is at schema revision {found or 'none'}, this version needs {needed}: "
                "run `onnxforge migrate` (or set database.auto_migrate=true)",
                code="SCHEMA_OUT_OF_DATE",
            )

    def _accept_newer(self, found: str, floor: str | None) -> None:
        """Return when this version runs on the newer schema ``found`` (its recorded floor is at or below our
        head), else raise SCHEMA_NEWER."""
        needed = migrations.head()
        if floor is not None and migrations.runs_on(floor):
            log.warning(
                "the job database is at schema revision %s, newer than this version's %s; it records that code "
                "from revision %s on runs on it, so this process starts without migrating",
                found,
                needed,
                floor,
            )
            return
        raise InvalidConfigError(
            f"the job database is at schema revision {found}, newer than this version's {needed}, and code older "
            f"than revision {floor or found} does not run on it: finish the rollout to the newer version, or roll "
            f"the schema back with the newer version's `onnxforge migrate --revision {needed}`",
            code="SCHEMA_NEWER",
        )

    def _lock_schema(self, conn: Connection) -> None:
        # SQLite: the write transaction (BEGIN IMMEDIATE) already excludes every other writer.
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
            if self.schema:
                conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"'))

    def ping(self) -> None:
        try:
            with self._engine.connect() as conn:
                conn.execute(select(func.count()).select_from(self.table).where(self.table.c.id == ""))
        except SQLAlchemyError as exc:
            raise UnavailableError(
                f"the job database does not answer: {type(exc).__name__}", code="DATABASE_UNAVAILABLE"
            ) from exc

    # ----------------------------------------------------------------------------------------------- API side

    def create(
        self,
        *,
        tenant: str,
        model_sha256: str,
        model_filename: str,
        model_format: str,
        model_size: int,
        samples_sha256: str | None,
        config: dict[str, Any],
        queue: str,
        cache_key: str | None = None,
        webhook: bool = False,
        intake: Intake | None = None,
        quota: Quota | None = None,
    ) -> Job:
        """A queued job. ``webhook``: the job has a callback_url; a worker delivers it once the job ends.

        ``quota``: checked against the tenant's jobs in flight and bytes of the last 24 hours inside the
        insert's transaction (QuotaExceededError). A second job with the same tenant and
        ``intake.idempotency_key`` raises ConflictError IDEMPOTENCY_KEY_IN_USE (``find_idempotent`` then
        gives the first).
        """
        now = self._clock()
        values = {
            "id": str(uuid.uuid4()),
            "tenant": tenant,
            "state": "queued",
            "stage": None,
            "progress": 0.0,
            "created_at": now,
            "updated_at": now,
            "model_sha256": model_sha256,
            "model_filename": model_filename,
            "model_format": model_format,
            "model_size": model_size,
            "samples_sha256": samples_sha256,
            "config": to_json(config),
            "queue": queue,
            "attempts": 0,
            "cancel_requested": False,
            "cache_key": cache_key,
            "webhook_state": "pending" if webhook else None,
            "webhook_attempts": 0 if webhook else None,
            **(intake.values() if intake is not None else {}),
        }
        try:
            with self._tx() as conn:
                if quota is not None:
                    in_flight, uploads = self._usage(conn, tenant, now)
                    new_bytes = intake.upload_bytes if intake is not None else model_size
                    quota.check(team=tenant, in_flight=in_flight, uploads=uploads, new_bytes=new_bytes, now=now)
                row = conn.execute(self.table.insert().values(values).returning(*self.table.c)).one()
        except IntegrityError as exc:
            raise ConflictError(
                "another request with this Idempotency-Key is being submitted", code="IDEMPOTENCY_KEY_IN_USE"
            ) from exc
        return Job.from_row(row)

    def find_idempotent(self, tenant: str, key: str) -> Job | None:
        """The tenant's job submitted with Idempotency-Key ``key``, if it still exists."""
        c = self.table.c
        with self._tx(write=False) as conn:
            row = conn.execute(select(self.table).where(c.tenant == tenant, c.idempotency_key == key)).one_or_none()
        return None if row is None else Job.from_row(row)

    def check_quota(self, tenant: str, quota: Quota, new_bytes: int = 0) -> int:
        """Raise QuotaExceededError if one more job of ``new_bytes`` breaks ``quota``; else the tenant's jobs
        in flight (queued or running), from which its next job's fair-share priority follows."""
        now = self._clock()
        with self._tx(write=False) as conn:
            in_flight, uploads = self._usage(conn, tenant, now)
        quota.check(team=tenant, in_flight=in_flight, uploads=uploads, new_bytes=new_bytes, now=now)
        return in_flight

    def _usage(self, conn: Connection, tenant: str, now: datetime) -> tuple[int, list[tuple[datetime, int]]]:
        c = self.table.c
        if conn.dialect.name == "postgresql":
            # Serialise one tenant's submissions: the count below and the insert after it act as one step.
            lock = text("SELECT pg_advisory_xact_lock(:space, hashtext(:tenant))")
            conn.execute(lock, {"space": _TENANT_LOCK_SPACE, "tenant": tenant})
        in_flight = conn.execute(
            select(func.count()).where(c.tenant == tenant, c.state.in_(("queued", "running")))
        ).scalar_one()
        rows = conn.execute(
            select(c.created_at, func.coalesce(c.upload_bytes, c.model_size)).where(
                c.tenant == tenant, c.created_at > now - QUOTA_WINDOW
            )
        ).all()
        return int(in_flight), [(created_at, int(size)) for created_at, size in rows]

    def get(self, job_id: str, tenant: str | None = None) -> Job:
        """One job; another tenant's job is reported exactly like a missing one (security.md T13), and so is,
        to its tenant, a running job that DELETE asked to remove."""
        if valid_id(job_id):
            query = select(self.table).where(self.table.c.id == job_id)
            if tenant is not None:
                query = query.where(self.table.c.tenant == tenant, self.table.c.delete_requested.is_not(True))
            with self._tx(write=False) as conn:
                row = conn.execute(query).one_or_none()
            if row is not None:
                return Job.from_row(row)
        raise NotFoundError(f"no job {job_id!r}", code="JOB_NOT_FOUND")

    def list(self, tenant: str | None, *, limit: int, offset: int, state: str | None = None) -> tuple[list[Job], int]:
        """A page of jobs, newest first, and the total matching (tenant None: every tenant)."""
        # A running job that DELETE asked to remove is gone as far as its tenant is concerned.
        where = [self.table.c.delete_requested.is_not(True)]
        if tenant is not None:
            where.append(self.table.c.tenant == tenant)
        if state is not None:
            where.append(self.table.c.state == state)
        query = (
            select(self.table)
            .where(*where)
            .order_by(self.table.c.created_at.desc(), self.table.c.id.desc())
            .limit(limit)
            .offset(offset)
        )
        with self._tx(write=False) as conn:
            rows = conn.execute(query).all()
            total = conn.execute(select(func.count()).select_from(self.table).where(*where)).scalar_one()
        return [Job.from_row(r) for r in rows], int(total)

    def delete(self, job_id: str) -> None:
        """Remove a row outright. Only for rolling back a job whose enqueue failed."""
        with self._tx() as conn:
            conn.execute(delete(self.table).where(self.table.c.id == job_id))

    def request_cancel(self, job_id: str, tenant: str | None) -> Job:
        """Queued: canceled at once. Running: flag it; the worker stops at its next heartbeat."""
        now = self._clock()
        c = self.table.c
        match = [c.id == job_id] + ([c.tenant == tenant] if tenant is not None else [])
        with self._tx() as conn:
            row = conn.execute(
                update(self.table)
                .where(*match, c.state == "queued")
                .values(state="canceled", finished_at=now, updated_at=now, cancel_requested=True)
                .returning(*c)
            ).one_or_none()
            if row is None:
                row = conn.execute(
                    update(self.table)
                    .where(*match, c.state == "running")
                    .values(cancel_requested=True, updated_at=now)
                    .returning(*c)
                ).one_or_none()
        if row is not None:
            return Job.from_row(row)
        job = self.get(job_id, tenant)  # NotFoundError when missing or another tenant's
        raise ConflictError(f"job {job_id} already finished ({job.state})", code="JOB_FINISHED")

    def touch_queued(self, job_id: str) -> None:
        """Record a re-enqueue, so ``stale`` does not pick the job again at once."""
        with self._tx() as conn:
            conn.execute(
                update(self.table)
                .where(self.table.c.id == job_id, self.table.c.state == "queued")
                .values(updated_at=self._clock())
            )

    def stale(self, now: datetime, *, queued_older_than_seconds: int) -> list[Job]:
        """Running jobs whose lease expired, and queued jobs untouched for longer than the threshold."""
        c = self.table.c
        queued_before = now - timedelta(seconds=queued_older_than_seconds)
        query = (
            select(self.table)
            .where(
                or_(
                    and_(c.state == "running", c.lease_expires_at < now),
                    and_(c.state == "queued", c.updated_at < queued_before),
                )
            )
            .order_by(c.created_at)
        )
        with self._tx(write=False) as conn:
            return [Job.from_row(r) for r in conn.execute(query).all()]

    # -------------------------------------------------------------------------------------------- worker side

    def claim(self, job_id: str, worker: str, lease_seconds: int, max_attempts: int) -> Job | None:
        """Take the job for a new attempt, or None when it is not ours to run.

        Claimable: queued, or running with an expired lease (its worker died). A claimable job whose
        cancel was requested becomes canceled; one already delivered ``max_attempts`` times fails with
        WORKER_LOST, so a model that kills its worker every time cannot loop forever (security.md T16).
        """
        now = self._clock()
        c = self.table.c
        claimable = and_(
            c.id == job_id,
            or_(c.state == "queued", and_(c.state == "running", c.lease_expires_at <= now)),
        )
        with self._tx() as conn:
            canceled = conn.execute(
                update(self.table)
                .where(claimable, c.cancel_requested.is_(True))
                .values(state="canceled", finished_at=now, updated_at=now, lease_expires_at=None)
                .returning(c.id)
            ).one_or_none()
            if canceled is not None:
                return None
            row = conn.execute(
                update(self.table)
                .where(claimable, c.attempts < max_attempts)
                .values(
                    state="running",
                    attempts=c.attempts + 1,
                    started_at=now,
                    updated_at=now,
                    lease_expires_at=now + timedelta(seconds=lease_seconds),
                    worker=worker,
                    stage=None,
                    progress=0.0,
                )
                .returning(*c)
            ).one_or_none()
            if row is not None:
                return Job.from_row(row)
            conn.execute(
                update(self.table)
                .where(claimable, c.attempts >= max_attempts)
                .values(
                    state="failed",
                    finished_at=now,
                    updated_at=now,
                    lease_expires_at=None,
                    error_code="WORKER_LOST",
                    error_message=f"job was delivered {max_attempts} times without finishing",
                )
            )
        return None

    def heartbeat(
        self,
        job_id: str,
        attempt: int,
        *,
        stage: str | None = None,
        progress: float | None = None,
        lease_seconds: int,
    ) -> Job | None:
        """Extend the lease of a running attempt; None when the attempt lost the job (stop working)."""
        now = self._clock()
        values: dict[str, Any] = {
            "lease_expires_at": now + timedelta(seconds=lease_seconds),
            "updated_at": now,
        }
        if stage is not None:
            values["stage"] = stage
        if progress is not None:
            values["progress"] = min(max(float(progress), 0.0), 1.0)
        return self._cas(job_id, attempt, values)

    def succeed(
        self,
        job_id: str,
        attempt: int,
        *,
        artifact_sha256: str,
        artifact_format: str,
        report_sha256: str,
        report_html_sha256: str,
        summary: dict[str, Any],
        timings: dict[str, Any],
        hardware_class: str | None = None,
    ) -> bool:
        now = self._clock()
        values = {
            "state": "succeeded",
            "stage": None,
            "progress": 1.0,
            "finished_at": now,
            "updated_at": now,
            "lease_expires_at": None,
            "artifact_sha256": artifact_sha256,
            "artifact_format": artifact_format,
            "report_sha256": report_sha256,
            "report_html_sha256": report_html_sha256,
            "summary": to_json(summary),
            "timings": to_json(timings),
            "hardware_class": hardware_class,
        }
        return self._cas(job_id, attempt, values) is not None

    def fail(
        self,
        job_id: str,
        attempt: int | None,
        *,
        code: str,
        message: str,
        pass_name: str | None = None,
        timings: dict[str, Any] | None = None,
    ) -> bool:
        """Fail a running attempt (attempt given), or the job in any non-terminal state (attempt None)."""
        now = self._clock()
        values: dict[str, Any] = {
            "state": "failed",
            "finished_at": now,
            "updated_at": now,
            "lease_expires_at": None,
            "error_code": code,
            "error_message": message[:_MAX_MESSAGE_CHARS],
            "error_pass": pass_name,
        }
        if timings is not None:
            values["timings"] = to_json(timings)
        return self._cas(job_id, attempt, values) is not None

    def mark_canceled(self, job_id: str, attempt: int) -> bool:
        """The attempt stopped on request. A job that DELETE asked to remove goes now (its files: purge)."""
        now = self._clock()
        values = {"state": "canceled", "finished_at": now, "updated_at": now, "lease_expires_at": None}
        job = self._cas(job_id, attempt, values)
        if job is not None and job.delete_requested:
            self.delete_finished(job_id)
        return job is not None

    def _cas(self, job_id: str, attempt: int | None, values: dict[str, Any]) -> Job | None:
        c = self.table.c
        if attempt is None:
            where = [c.id == job_id, c.state.in_(("queued", "running"))]
        else:
            where = [c.id == job_id, c.state == "running", c.attempts == attempt]
        with self._tx() as conn:
            row = conn.execute(update(self.table).where(*where).values(values).returning(*c)).one_or_none()
        return None if row is None else Job.from_row(row)
