"""Baseline: the job table as onnxforge 0.1 created it, or adopted from a database made before migrations.

Before Alembic, every process ran ``create_all`` and then ``ALTER TABLE ADD COLUMN`` for the nullable
columns that later versions added (cache and webhooks). Such a database has the table but no
``alembic_version``: this revision adds whichever of those columns and indexes it lacks instead of
creating the table again.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import context, op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


class _UTCDateTime(sa.TypeDecorator[datetime]):
    """The store's naive-UTC column type, frozen here (core/jobtable.py may change; this may not)."""

    impl = sa.DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else value.astimezone(UTC).replace(tzinfo=None)


def _columns() -> list[sa.Column[Any]]:
    return [
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("stage", sa.String(64)),
        sa.Column("progress", sa.Float, nullable=False),
        sa.Column("created_at", _UTCDateTime, nullable=False),
        sa.Column("started_at", _UTCDateTime),
        sa.Column("finished_at", _UTCDateTime),
        sa.Column("updated_at", _UTCDateTime, nullable=False),
        sa.Column("model_sha256", sa.String(64), nullable=False),
        sa.Column("model_filename", sa.String(255), nullable=False),
        sa.Column("model_format", sa.String(8), nullable=False),
        sa.Column("model_size", sa.BigInteger, nullable=False),
        sa.Column("samples_sha256", sa.String(64)),
        sa.Column("config", sa.Text, nullable=False),
        sa.Column("queue", sa.String(8), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("lease_expires_at", _UTCDateTime),
        sa.Column("worker", sa.String(255)),
        sa.Column("cancel_requested", sa.Boolean, nullable=False),
        sa.Column("error_code", sa.String(64)),
        sa.Column("error_message", sa.Text),
        sa.Column("error_pass", sa.String(128)),
        sa.Column("artifact_sha256", sa.String(64)),
        sa.Column("artifact_format", sa.String(8)),
        sa.Column("report_sha256", sa.String(64)),
        sa.Column("report_html_sha256", sa.String(64)),
        sa.Column("summary", sa.Text),
        sa.Column("timings", sa.Text),
        sa.Column("cache_key", sa.String(64)),
        sa.Column("cached_from", sa.String(36)),
        sa.Column("hardware_class", sa.String(255)),
        sa.Column("webhook_state", sa.String(16)),
        sa.Column("webhook_attempts", sa.Integer),
        sa.Column("webhook_next_at", _UTCDateTime),
        sa.Column("webhook_error", sa.Text),
    ]


_INDEXES = {
    "ix_jobs_tenant_created": ["tenant", "created_at"],
    "ix_jobs_state_lease": ["state", "lease_expires_at"],
    "ix_jobs_state_updated": ["state", "updated_at"],
    "ix_jobs_cache_key": ["cache_key"],
    "ix_jobs_webhook": ["webhook_state", "webhook_next_at"],
}


def upgrade() -> None:
    schema = context.config.attributes.get("schema")
    if schema:
        op.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    inspector = sa.inspect(op.get_bind())
    if not inspector.has_table("jobs", schema=schema):
        op.create_table("jobs", *_columns(), schema=schema)
        present_indexes: set[str] = set()
    else:
        present = {c["name"] for c in inspector.get_columns("jobs", schema=schema)}
        for column in _columns():
            if column.name not in present:
                assert column.nullable, f"a pre-migration table cannot lack the required column {column.name}"
                op.add_column("jobs", column, schema=schema)
        present_indexes = {i["name"] for i in inspector.get_indexes("jobs", schema=schema)}
    for name, columns in _INDEXES.items():
        if name not in present_indexes:
            op.create_index(name, "jobs", columns, schema=schema)


def downgrade() -> None:
    op.drop_table("jobs", schema=context.config.attributes.get("schema"))
