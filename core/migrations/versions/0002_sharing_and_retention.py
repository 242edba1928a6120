"""Idempotent submission, the bytes-per-day quota, retention and DELETE that deletes.

``idempotency_key`` is unique per tenant (NULLs never collide, on SQLite and PostgreSQL alike);
``request_sha256`` fingerprints the submission so a reused key with another body is refused;
``upload_bytes`` counts toward the tenant's bytes per day; ``delete_requested`` marks a running job that
DELETE asked to remove once its worker stops; the ``*_expired_at`` columns record what retention removed.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import context, op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


class _UTCDateTime(sa.TypeDecorator[datetime]):
    impl = sa.DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else value.astimezone(UTC).replace(tzinfo=None)


_COLUMNS = (
    ("idempotency_key", sa.String(255)),
    ("request_sha256", sa.String(64)),
    ("upload_bytes", sa.BigInteger()),
    ("delete_requested", sa.Boolean()),
    ("uploads_expired_at", _UTCDateTime()),
    ("artifact_expired_at", _UTCDateTime()),
    ("reports_expired_at", _UTCDateTime()),
)


def upgrade() -> None:
    schema = context.config.attributes.get("schema")
    for name, kind in _COLUMNS:
        op.add_column("jobs", sa.Column(name, kind, nullable=True), schema=schema)
    op.create_index("ux_jobs_tenant_idempotency", "jobs", ["tenant", "idempotency_key"], unique=True, schema=schema)
    op.create_index("ix_jobs_tenant_state", "jobs", ["tenant", "state"], schema=schema)


def downgrade() -> None:
    schema = context.config.attributes.get("schema")
    op.drop_index("ix_jobs_tenant_state", "jobs", schema=schema)
    op.drop_index("ux_jobs_tenant_idempotency", "jobs", schema=schema)
    with op.batch_alter_table("jobs", schema=schema) as batch:
        for name, _kind in reversed(_COLUMNS):
            batch.drop_column(name)
