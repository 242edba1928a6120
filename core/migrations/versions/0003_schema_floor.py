"""The compatibility floor: which older code still runs on this schema, for rolling upgrades.

One row in ``onnxforge_schema``: the revision the database is at and the oldest revision whose code runs on
it (core/migrations/__init__.py writes it after every upgrade and downgrade, from the revision module's
``oldest_compatible``). A version that finds a newer revision than its own reads this row instead of the
revision module it does not have.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None
# A new table that code at 0002 never touches.
oldest_compatible = "0002"

_TABLE = "onnxforge_schema"


def upgrade() -> None:
    schema = context.config.attributes.get("schema")
    if sa.inspect(op.get_bind()).has_table(_TABLE, schema=schema):
        return  # adopted from a database whose alembic_version was lost: the table is already there
    op.create_table(
        _TABLE,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("revision", sa.String(32), nullable=False),
        sa.Column("oldest_compatible", sa.String(32), nullable=False),
        schema=schema,
    )


def downgrade() -> None:
    op.drop_table(_TABLE, schema=context.config.attributes.get("schema"))
