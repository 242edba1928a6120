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

SQLite (the embedded default) runs in WAL mode with a busy timeout so the API and worker processes share
it; write transactions start with ``BEGIN IMMEDIATE`` so two writers queue instead of failing on a lock
upgrade. Timestamps are stored as naive UTC and returned timezone-aware.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    and_,
    create_engine,
    delete,
    event,
    func,
    inspect,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from core.errors import ConflictError, NotFoundError, UnavailableError

STATES = ("queued", "running", "succeeded", "failed", "canceled")
TERMINAL_STATES = frozenset({"succeeded", "failed", "canceled"})
_MAX_MESSAGE_CHARS = 4000
_SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
# pg_advisory_xact_lock key serialising concurrent create_schema() calls (API and workers start together).
_SCHEMA_LOCK_KEY = 0x6F6E6E78


class _UTCDateTime(TypeDecorator[datetime]):
    """Naive UTC in the database (SQLite has no time zones), aware UTC in Python."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the job store; use an aware UTC datetime")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


def _jobs_table(metadata: MetaData) -> Table:
    return Table(
        "jobs",
        metadata,
        Column("id", String(36), primary_key=True),
        Column("tenant", String(128), nullable=False, default="default"),
        Column("state", String(16), nullable=False),
        Column("stage", String(64)),
        Column("progress", Float, nullable=False, default=0.0),
        Column("created_at", _UTCDateTime, nullable=False),
        Column("started_at", _UTCDateTime),
        Column("finished_at", _UTCDateTime),
        Column("updated_at", _UTCDateTime, nullable=False),
        Column("model_sha256", String(64), nullable=False),
        Column("model_filename", String(255), nullable=False),
        Column("model_format", String(8), nullable=False),
        Column("model_size", BigInteger, nullable=False),
        Column("samples_sha256", String(64)),
        Column("config", Text, nullable=False),
        Column("queue", String(8), nullable=False),
        Column("attempts", Integer, nullable=False, default=0),
        Column("lease_expires_at", _UTCDateTime),
        Column("worker", String(255)),
        Column("cancel_requested", Boolean, nullable=False, default=False),
        Column("error_code", String(64)),
        Column("error_message", Text),
        Column("error_pass", String(128)),
        Column("artifact_sha256", String(64)),
        Column("artifact_format", String(8)),
        Column("report_sha256", String(64)),
        Column("report_html_sha256", String(64)),
        Column("summary", Text),
        Column("timings", Text),
        # Added with the result cache and webhooks. All nullable, so ``create_schema`` can add them to a
        # table made by an earlier version (``_add_missing_columns``) until there are real migrations.
        Column("cache_key", String(64)),
        Column("cached_from", String(36)),
        Column("hardware_class", String(255)),
        Column("webhook_state", String(16)),
        Column("webhook_attempts", Integer),
        Column("webhook_next_at", _UTCDateTime),
        Column("webhook_error", Text),
        Index("ix_jobs_tenant_created", "tenant", "created_at"),
        Index("ix_jobs_state_lease", "state", "lease_expires_at"),
        Index("ix_jobs_state_updated", "state", "updated_at"),
        Index("ix_jobs_cache_key", "cache_key"),
        Index("ix_jobs_webhook", "webhook_state", "webhook_next_at"),
    )


@dataclasses.dataclass(frozen=True)
class Job:
    """A read-only view of one row. JSON columns are decoded."""

    id: str
    tenant: str
    state: str
    stage: str | None
    progress: float
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime
    model_sha256: str
    model_filename: str
    model_format: str
    model_size: int
    samples_sha256: str | None
    config: dict[str, Any]
    queue: str
    attempts: int
    lease_expires_at: datetime | None
    worker: str | None
    cancel_requested: bool
    error_code: str | None
    error_message: str | None
    error_pass: str | None
    artifact_sha256: str | None
    artifact_format: str | None
    report_sha256: str | None
    report_html_sha256: str | None
    summary: dict[str, Any] | None
    timings: dict[str, Any] | None
    cache_key: str | None = None
    cached_from: str | None = None
    hardware_class: str | None = None
    webhook_state: str | None = None  # None (no callback_url), pending, delivered or failed
    webhook_attempts: int | None = None
    webhook_next_at: datetime | None = None
    webhook_error: str | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @classmethod
    def _from_row(cls, row: Any) -> Job:
        data = dict(row._mapping)
        for key in ("config", "summary", "timings"):
            data[key] = json.loads(data[key]) if data[key] is not None else None
        data["cancel_requested"] = bool(data["cancel_requested"])
        return cls(**data)


def _json(value: dict[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))


def _valid_id(job_id: str) -> bool:
    try:
        return str(uuid.UUID(job_id)) == job_id
    except (ValueError, TypeError, AttributeError):
        return False


class JobStore:
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
        self.table = _jobs_table(self._metadata)
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
        """Create the schema (PostgreSQL, when named) and the table if missing. Safe to run concurrently."""
        with self._tx() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
                if self.schema:
                    conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"'))
            self._metadata.create_all(conn, checkfirst=True)
            self._add_missing_columns(conn)

    def _add_missing_columns(self, conn: Connection) -> None:
        """Add nullable columns (and their indexes) that a table created by an earlier version lacks.

        There are no migrations yet (an Alembic follow-up); until then this covers additive changes.

        Only ever adds nullable columns without defaults: cheap on SQLite and PostgreSQL, and safe to run
        concurrently because create_schema holds the schema lock (PostgreSQL) or a write transaction (SQLite).
        """
        present = {col["name"] for col in inspect(conn).get_columns(self.table.name, schema=self.schema)}
        table = f'"{self.schema}"."{self.table.name}"' if self.schema else f'"{self.table.name}"'
        for column in self.table.columns:
            if column.name in present:
                continue
            assert column.nullable, f"column {column.name} needs a migration, not an ALTER TABLE"
            kind = column.type.compile(dialect=conn.dialect)
            conn.execute(text(f'ALTER TABLE {table} ADD COLUMN "{column.name}" {kind}'))
        for index in self.table.indexes:
            index.create(conn, checkfirst=True)

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
    ) -> Job:
        """A queued job. ``webhook``: the job has a callback_url; a worker delivers it once the job ends."""
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
            "config": _json(config),
            "queue": queue,
            "attempts": 0,
            "cancel_requested": False,
            "cache_key": cache_key,
            "webhook_state": "pending" if webhook else None,
            "webhook_attempts": 0 if webhook else None,
        }
        with self._tx() as conn:
            row = conn.execute(self.table.insert().values(values).returning(*self.table.c)).one()
        return Job._from_row(row)

    # ------------------------------------------------------------------------------------------ result cache

    def find_cached(
        self,
        cache_key: str,
        *,
        tenant: str | None,
        queue: str,
        max_age_seconds: int,
        hardware_sample_jobs: int,
    ) -> Job | None:
        """The newest succeeded, non-cached job with ``cache_key`` whose result may be reused, or None.

        Reusable: of ``tenant`` (None: any tenant), finished within ``max_age_seconds`` (0: any age), and run
        on a hardware class that is among those of the last ``hardware_sample_jobs`` jobs that ran on
        ``queue``, i.e. a class of worker that still serves the queue (see app/services/cache.py).
        """
        c = self.table.c
        now = self._clock()
        where = [c.cache_key == cache_key, c.state == "succeeded", c.cached_from.is_(None)]
        if tenant is not None:
            where.append(c.tenant == tenant)
        if max_age_seconds:
            where.append(c.finished_at >= now - timedelta(seconds=max_age_seconds))
        recent = (
            select(c.hardware_class)
            .where(c.state == "succeeded", c.queue == queue, c.cached_from.is_(None), c.hardware_class.is_not(None))
            .order_by(c.updated_at.desc())
            .limit(hardware_sample_jobs)
        )
        with self._tx(write=False) as conn:
            live = {row[0] for row in conn.execute(recent).all()}
            if not live:
                return None
            where.append(c.hardware_class.in_(sorted(live)))
            row = conn.execute(select(self.table).where(*where).order_by(c.finished_at.desc()).limit(1)).one_or_none()
        return None if row is None else Job._from_row(row)

    def create_cached(
        self,
        earlier: Job,
        *,
        tenant: str,
        model_filename: str,
        config: dict[str, Any],
        webhook: bool = False,
    ) -> Job:
        """A new job, succeeded at once, sharing ``earlier``'s artifact and reports (``cached_from``)."""
        now = self._clock()
        summary = {**(earlier.summary or {}), "cached": True}
        values = {
            "id": str(uuid.uuid4()),
            "tenant": tenant,
            "state": "succeeded",
            "stage": None,
            "progress": 1.0,
            "created_at": now,
            "started_at": now,
            "finished_at": now,
            "updated_at": now,
            "model_sha256": earlier.model_sha256,
            "model_filename": model_filename,
            "model_format": earlier.model_format,
            "model_size": earlier.model_size,
            "samples_sha256": earlier.samples_sha256,
            "config": _json(config),
            "queue": earlier.queue,
            "attempts": 0,
            "cancel_requested": False,
            "artifact_sha256": earlier.artifact_sha256,
            "artifact_format": earlier.artifact_format,
            "report_sha256": earlier.report_sha256,
            "report_html_sha256": earlier.report_html_sha256,
            "summary": _json(summary),
            "timings": _json({}),
            "cache_key": earlier.cache_key,
            "cached_from": earlier.id,
            "hardware_class": earlier.hardware_class,
            "webhook_state": "pending" if webhook else None,
            "webhook_attempts": 0 if webhook else None,
        }
        with self._tx() as conn:
            row = conn.execute(self.table.insert().values(values).returning(*self.table.c)).one()
        return Job._from_row(row)

    # ------------------------------------------------------------------------------------------------ metrics

    def count_by_state(self) -> dict[tuple[str, str], int]:
        """{(queue, state): jobs}; one grouped count."""
        c = self.table.c
        with self._tx(write=False) as conn:
            rows = conn.execute(select(c.queue, c.state, func.count()).group_by(c.queue, c.state)).all()
        return {(str(q), str(s)): int(n) for q, s, n in rows}

    def recently_finished(self, since: datetime, limit: int) -> list[Job]:
        """Terminal jobs updated since ``since`` (for terminal jobs, when they finished), newest first."""
        c = self.table.c
        query = (
            select(self.table)
            .where(c.state.in_(sorted(TERMINAL_STATES)), c.updated_at >= since)
            .order_by(c.updated_at.desc())
            .limit(limit)
        )
        with self._tx(write=False) as conn:
            return [Job._from_row(r) for r in conn.execute(query).all()]

    # ---------------------------------------------------------------------------------------------- webhooks

    def due_webhooks(self, now: datetime, limit: int) -> list[Job]:
        """Finished jobs whose webhook is pending and due (never tried, or its retry time has come)."""
        c = self.table.c
        query = (
            select(self.table)
            .where(
                c.webhook_state == "pending",
                c.state.in_(sorted(TERMINAL_STATES)),
                or_(c.webhook_next_at.is_(None), c.webhook_next_at <= now),
            )
            .order_by(c.updated_at)
            .limit(limit)
        )
        with self._tx(write=False) as conn:
            return [Job._from_row(r) for r in conn.execute(query).all()]

    def claim_webhook(self, job_id: str, attempts: int, lease_seconds: float) -> Job | None:
        """Take one delivery attempt (compare-and-set on ``webhook_attempts``); None when another worker did.

        The claim pushes ``webhook_next_at`` past the delivery's time budget, so a worker that dies while
        delivering leaves the webhook due again afterwards, for another worker to retry.
        """
        now = self._clock()
        c = self.table.c
        with self._tx() as conn:
            row = conn.execute(
                update(self.table)
                .where(
                    c.id == job_id,
                    c.webhook_state == "pending",
                    func.coalesce(c.webhook_attempts, 0) == attempts,
                    or_(c.webhook_next_at.is_(None), c.webhook_next_at <= now),
                )
                .values(webhook_attempts=attempts + 1, webhook_next_at=now + timedelta(seconds=lease_seconds))
                .returning(*c)
            ).one_or_none()
        return None if row is None else Job._from_row(row)

    def finish_webhook(
        self, job_id: str, attempt: int, *, delivered: bool, error: str | None, retry_in_seconds: float | None
    ) -> None:
        """Record one attempt: delivered, retried after ``retry_in_seconds``, or given up (None)."""
        c = self.table.c
        if delivered:
            values: dict[str, Any] = {"webhook_state": "delivered", "webhook_next_at": None, "webhook_error": None}
        elif retry_in_seconds is None:
            values = {"webhook_state": "failed", "webhook_next_at": None, "webhook_error": (error or "")[:1000]}
        else:
            values = {
                "webhook_next_at": self._clock() + timedelta(seconds=retry_in_seconds),
                "webhook_error": (error or "")[:1000],
            }
        with self._tx() as conn:
            conn.execute(
                update(self.table)
                .where(c.id == job_id, c.webhook_state == "pending", c.webhook_attempts == attempt)
                .values(values)
            )

    def get(self, job_id: str, tenant: str | None = None) -> Job:
        """One job; another tenant's job is reported exactly like a missing one (security.md T13)."""
        if _valid_id(job_id):
            query = select(self.table).where(self.table.c.id == job_id)
            if tenant is not None:
                query = query.where(self.table.c.tenant == tenant)
            with self._tx(write=False) as conn:
                row = conn.execute(query).one_or_none()
            if row is not None:
                return Job._from_row(row)
        raise NotFoundError(f"no job {job_id!r}", code="JOB_NOT_FOUND")

    def list(self, tenant: str | None, *, limit: int, offset: int, state: str | None = None) -> tuple[list[Job], int]:
        """A page of jobs, newest first, and the total matching (tenant None: every tenant)."""
        where = []
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
        return [Job._from_row(r) for r in rows], int(total)

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
            return Job._from_row(row)
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
            return [Job._from_row(r) for r in conn.execute(query).all()]

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
                return Job._from_row(row)
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
            "summary": _json(summary),
            "timings": _json(timings),
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
            values["timings"] = _json(timings)
        return self._cas(job_id, attempt, values) is not None

    def mark_canceled(self, job_id: str, attempt: int) -> bool:
        now = self._clock()
        values = {"state": "canceled", "finished_at": now, "updated_at": now, "lease_expires_at": None}
        return self._cas(job_id, attempt, values) is not None

    def _cas(self, job_id: str, attempt: int | None, values: dict[str, Any]) -> Job | None:
        c = self.table.c
        if attempt is None:
            where = [c.id == job_id, c.state.in_(("queued", "running"))]
        else:
            where = [c.id == job_id, c.state == "running", c.attempts == attempt]
        with self._tx() as conn:
            row = conn.execute(update(self.table).where(*where).values(values).returning(*c)).one_or_none()
        return None if row is None else Job._from_row(row)
