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

Rolling upgrades: during a rollout the first new process migrates, and old API replicas and workers go on
(and restart) against a schema newer than their own. A revision whose change old code survives (nullable
columns, new tables, non-unique indexes: old code names its columns, so it neither reads nor writes the new
ones) sets ``oldest_compatible`` to the oldest revision whose code still runs on it (usually its
``down_revision``); without it, only its own code does. After every upgrade or downgrade that floor is
written to the ``onnxforge_schema`` table (revision 0003 creates it), because old code cannot read a
revision module it does not have: a version that finds an unknown, newer revision runs on it when its own
head is at or above that floor, and refuses to start (``SCHEMA_NEWER``) otherwise.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, inspect, select, update
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
    _record_floor(connection, schema)


def downgrade(connection: Connection, schema: str | None, revision: str) -> None:
    command.downgrade(_config(connection, schema), revision)
    _record_floor(connection, schema)


def is_known(revision: str) -> bool:
    """Whether this version ships ``revision`` (False: a newer version's)."""
    try:
        return ScriptDirectory.from_config(_config()).get_revision(revision) is not None
    except CommandError:
        return False


def oldest_compatible(revision: str) -> str:
    """The oldest revision whose code runs on a database at ``revision`` (a revision this version ships)."""
    script = ScriptDirectory.from_config(_config()).get_revision(revision)
    assert script is not None, f"unknown revision {revision}"
    return str(getattr(script.module, "oldest_compatible", revision))


def runs_on(floor: str) -> bool:
    """Whether this version's code runs on a schema whose compatibility floor is ``floor``: its head is
    ``floor`` or a descendant of it."""
    if not is_known(floor):
        return False
    script = ScriptDirectory.from_config(_config())
    return any(r.revision == floor for r in script.iterate_revisions(head(), "base"))


def floor(connection: Connection, schema: str | None = None) -> str | None:
    """The compatibility floor the database records (None: no ``onnxforge_schema`` table, before 0003)."""
    table = _floor_table(schema)
    if not inspect(connection).has_table(FLOOR_TABLE, schema=schema):
        return None
    return connection.execute(select(table.c.oldest_compatible).where(table.c.id == 1)).scalar_one_or_none()


FLOOR_TABLE = "onnxforge_schema"


def _floor_table(schema: str | None) -> Table:
    return Table(
        FLOOR_TABLE,
        MetaData(schema=schema),
        Column("id", Integer, primary_key=True),
        Column("revision", String(32), nullable=False),
        Column("oldest_compatible", String(32), nullable=False),
    )


def _record_floor(connection: Connection, schema: str | None) -> None:
    revision = current(connection, schema)
    if revision is None or not inspect(connection).has_table(FLOOR_TABLE, schema=schema):
        return
    table = _floor_table(schema)
    values = {"revision": revision, "oldest_compatible": oldest_compatible(revision)}
    if connection.execute(update(table).where(table.c.id == 1).values(**values)).rowcount == 0:
        connection.execute(insert(table).values(id=1, **values))
