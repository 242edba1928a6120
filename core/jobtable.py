"""The job table's definition and its read-only row view, shared by the store and its migrations.

The live definition is what ``JobStore`` queries; core/migrations/versions/ hold frozen copies of each
revision, so changing a column here also needs a new revision there (tests/test_store.py compares them).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import UTC, datetime
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
)

STATES = ("queued", "running", "succeeded", "failed", "canceled")
TERMINAL_STATES = frozenset({"succeeded", "failed", "canceled"})


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


def jobs_table(metadata: MetaData) -> Table:
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
        # Added with the result cache and webhooks (nullable: the baseline migration adds them to a table
        # made before migrations existed).
        Column("cache_key", String(64)),
        Column("cached_from", String(36)),
        Column("hardware_class", String(255)),
        Column("webhook_state", String(16)),
        Column("webhook_attempts", Integer),
        Column("webhook_next_at", _UTCDateTime),
        Column("webhook_error", Text),
        # Revision 0002 (core/migrations): idempotent submission, the bytes/day quota, retention and DELETE.
        Column("idempotency_key", String(255)),
        Column("request_sha256", String(64)),
        Column("upload_bytes", BigInteger),
        Column("delete_requested", Boolean),
        Column("uploads_expired_at", _UTCDateTime),
        Column("artifact_expired_at", _UTCDateTime),
        Column("reports_expired_at", _UTCDateTime),
        Index("ix_jobs_tenant_created", "tenant", "created_at"),
        Index("ix_jobs_state_lease", "state", "lease_expires_at"),
        Index("ix_jobs_state_updated", "state", "updated_at"),
        Index("ix_jobs_cache_key", "cache_key"),
        Index("ix_jobs_webhook", "webhook_state", "webhook_next_at"),
        Index("ux_jobs_tenant_idempotency", "tenant", "idempotency_key", unique=True),
        Index("ix_jobs_tenant_state", "tenant", "state"),
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
    idempotency_key: str | None = None
    request_sha256: str | None = None
    upload_bytes: int | None = None
    delete_requested: bool | None = None
    uploads_expired_at: datetime | None = None
    artifact_expired_at: datetime | None = None
    reports_expired_at: datetime | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @classmethod
    def from_row(cls, row: Any) -> Job:
        data = dict(row._mapping)
        for key in ("config", "summary", "timings"):
            data[key] = json.loads(data[key]) if data[key] is not None else None
        data["cancel_requested"] = bool(data["cancel_requested"])
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class Intake:
    """What a submission records beside the job: its size (bytes-per-day quota), and the client's
    Idempotency-Key with a fingerprint of the request it named (a reused key must name the same request)."""

    upload_bytes: int
    idempotency_key: str | None = None
    request_sha256: str | None = None

    def values(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def to_json(value: dict[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))


def valid_id(job_id: str) -> bool:
    try:
        return str(uuid.UUID(job_id)) == job_id
    except (ValueError, TypeError, AttributeError):
        return False
