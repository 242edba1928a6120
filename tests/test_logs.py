"""core/logs.py: one handler for every logger, readable in development, JSON in production, with context."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from core.logs import bind, configure_logging, log_context
from core.settings import Settings

PRODUCTION = {"environment": "production", "broker": {"url": "redis://h:6379/0"}, "database": {"url": "sqlite://"}}


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_configure_logging_writes_readable_lines_with_context_when_development(restore_root: None) -> None:
    out = io.StringIO()
    # What an in-process uvicorn.Config(log_level="warning") or a dictConfig leaves behind must not matter.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").disabled = True
    configure_logging(Settings(), process="api", stream=out)

    with log_context(request_id="r-1"):
        bind(team="team-a")
        logging.getLogger("uvicorn.access").info("GET /v1/jobs 200")
    logging.getLogger("onnxforge.api").warning("outside any request")

    first, second = out.getvalue().splitlines()
    assert first.endswith("INFO uvicorn.access [req=r-1 job=- team=team-a] GET /v1/jobs 200")
    assert second.endswith("WARNING onnxforge.api [req=- job=- team=-] outside any request")


def test_configure_logging_writes_json_with_context_when_production(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging(Settings(**PRODUCTION), process="worker", stream=out)

    with log_context(job_id="j-1"):
        bind(team="team-b")
        logging.getLogger("celery.app.trace").info("Task %s succeeded", "x")
    logging.getLogger("workers.reconciler").info("idle")

    inside, outside = (json.loads(line) for line in out.getvalue().splitlines())
    assert inside["message"] == "Task x succeeded"
    assert (inside["job_id"], inside["team"], inside["level"], inside["logger"]) == (
        "j-1",
        "team-b",
        "INFO",
        "celery.app.trace",
    )
    assert inside["process_kind"] == "worker" and "time" in inside
    assert "job_id" not in outside and "request_id" not in outside


def test_configure_logging_keeps_one_handler_when_called_again(restore_root: None) -> None:
    configure_logging(Settings(), process="worker", stream=io.StringIO())
    configure_logging(Settings(), process="worker", stream=io.StringIO())

    assert [h.get_name() for h in logging.getLogger().handlers].count("onnxforge") == 1
