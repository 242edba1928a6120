"""Alembic's entry point: runs the revisions on the connection core/migrations/__init__.py hands over."""

from __future__ import annotations

from alembic import context

_config = context.config
_connection = _config.attributes.get("connection")
if _connection is None:
    raise RuntimeError("run migrations through core.migrations.upgrade() or `onnxforge migrate`, not `alembic`")

context.configure(
    connection=_connection,
    version_table_schema=_config.attributes.get("schema"),
    # SQLite cannot ALTER most things in place; batch mode copies the table where a revision needs it.
    render_as_batch=_connection.dialect.name == "sqlite",
    transaction_per_migration=False,
)
with context.begin_transaction():
    context.run_migrations()
