"""Logging, configured once per process: JSON lines in production, readable lines in development.

Every line carries ``request_id``, ``job_id`` and ``team`` when they are known, whichever logger wrote it
(ours, uvicorn's access and error logs, Celery's, Alembic's): a filter on the one root handler copies them
from a context variable onto each record. The API's middleware opens a context per request
(``log_context(request_id=...)``) and authentication adds the team to it (``bind(team=...)``); the worker's
task opens one per job (``log_context(job_id=...)``) and the runner adds the team once it has claimed the
job.

The context holds one dict per request or job, and ``bind`` updates that dict in place: a FastAPI
dependency that runs in a worker thread sees a copy of the context variables, but the same dict, so the
team it binds reaches the access line written later by the event loop.

Formats (``log_format``): ``json`` (python-json-logger; ``time``, ``level``, ``logger``, ``message``,
the context fields, ``exc_info`` when there is one), ``text`` (``2026-01-01 12:00:00,000 INFO
onnxforge.api [req=... job=... team=...] message``), or ``auto``: json when ``environment=production``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from pythonjsonlogger.json import JsonFormatter

if TYPE_CHECKING:
    from core.settings import Settings

FIELDS = ("request_id", "job_id", "team")
_context: ContextVar[dict[str, str] | None] = ContextVar("onnxforge_log_context", default=None)
_HANDLER_NAME = "onnxforge"
# Loggers that install handlers of their own; they must hand their records to the root handler instead.
_FOREIGN = ("uvicorn", "uvicorn.error", "uvicorn.access", "celery", "celery.task", "celery.worker", "alembic")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [req=%(request_id)s job=%(job_id)s team=%(team)s] %(message)s"


@contextlib.contextmanager
def log_context(**fields: str | None) -> Iterator[dict[str, str]]:
    """A fresh context for one request or job; lines logged inside carry ``fields``."""
    values = {k: v for k, v in fields.items() if v is not None}
    token = _context.set(values)
    try:
        yield values
    finally:
        _context.reset(token)


def bind(**fields: str | None) -> None:
    """Add fields to the current request's or job's context (no-op outside one)."""
    values = _context.get()
    if values is not None:
        values.update({k: v for k, v in fields.items() if v is not None})


def current() -> dict[str, str]:
    return dict(_context.get() or {})


class ContextFilter(logging.Filter):
    """Puts the context's fields on every record (``-`` when unknown, so text lines keep their shape)."""

    def filter(self, record: logging.LogRecord) -> bool:
        values = _context.get() or {}
        for name in FIELDS:
            if not hasattr(record, name) or getattr(record, name) in (None, "-"):
                setattr(record, name, values.get(name, "-"))
        return True


class _JsonFormatter(JsonFormatter):
    def process_log_record(self, log_record: dict[str, Any]) -> dict[str, Any]:
        # Unknown context is absent in JSON, not "-": log pipelines then index only real values.
        for name in FIELDS:
            if log_record.get(name) == "-":
                del log_record[name]
        log_record.pop("color_message", None)  # uvicorn's ANSI-coloured copy of the message
        return log_record


def formatter(kind: str, process: str) -> logging.Formatter:
    if kind == "json":
        return _JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            static_fields={"process_kind": process},
            timestamp=False,
        )
    return logging.Formatter(TEXT_FORMAT)


def resolve_format(settings: Settings) -> str:
    if settings.log_format != "auto":
        return settings.log_format
    return "json" if settings.environment == "production" else "text"


def configure_logging(settings: Settings, *, process: str, stream: Any = None) -> None:
    """Route every logger of this process through one handler on the root logger. Idempotent."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter(resolve_format(settings), process))
    handler.addFilter(ContextFilter())
    root.addHandler(handler)
    root.setLevel(settings.log_level)
    for name in _FOREIGN:
        # uvicorn's and Celery's own set-up gives their loggers handlers, levels, and may disable them
        # (dictConfig); here they follow the root's one handler and level whatever ran before.
        foreign = logging.getLogger(name)
        foreign.handlers.clear()
        foreign.propagate = True
        foreign.disabled = False
        foreign.setLevel(logging.NOTSET)
    logging.captureWarnings(True)  # warnings.warn() becomes a log line too, with the context
