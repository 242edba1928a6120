"""Schema migrations of the job table, run by Alembic without an ``alembic.ini``.

``upgrade(connection, schema)`` brings a database to the newest revision inside the caller's transaction
(JobStore.create_schema holds the PostgreSQL advisory lock or SQLite's write lock around it, so API and
workers starting together migrate once). ``onnxforge migrate`` calls the same function; with
``database.auto_migrate=false`` the services only check the revision (``current`` against ``head``)
and refuse to start on an old schema.

A new revision is a hand-written module in ``versions/`` named ``NNNN_<what>.py`` with ``revision``,
``down_revision``, ``upgrade()`` and ``downgrade()``. It reads the target schema from
``schema_name()``, never from the live table in core/jobtable.py, so an old revision keeps meaning what
it meant when it shipped.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

_HERE = Path(__file__).resolve().parent
VERSION_TABLE = "alembic_version"


def _config(connection: Connection | None = None, schema: str | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(_HERE))
    # Alembic's own fileConfig() is never called: logging is configured once, by core/logs.py.
    config.attributes["connection"] = connection
    config.attributes["schema"] = schema
    return config


def head() -> str:
    """The newest revision shipped with this version of onnxforge."""
    revision = ScriptDirectory.from_config(_config()).get_current_head()
    assert revision is not None, "core/migrations/versions holds no revision"
    return revision


def current(connection: Connection, schema: str | None = None) -> str | None:
    """The revision the database is at; None when it was never migrated."""
    context = MigrationContext.configure(connection, opts={"version_table_schema": schema})
    return context.get_current_revision()


def upgrade(connection: Connection, schema: str | None = None, revision: str = "head") -> None:
    """Run every revision up to ``revision`` on ``connection``, in its transaction."""
    command.upgrade(_config(connection, schema), revision)


def downgrade(connection: Connection, schema: str | None, revision: str) -> None:
    command.downgrade(_config(connection, schema), revision)
