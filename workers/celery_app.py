"""The workers' Celery app: the broker configuration of core/broker.py plus the registered task.

``create_celery(settings)`` is the constructor the worker uses; callers pass the returned app explicitly
(no ``current_app``). For ``celery -A workers.celery_app worker`` the module also exposes ``app``, built
lazily from ``get_settings()`` on first access (PEP 562), so importing this module never reads the
environment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core import broker
from core.settings import get_settings
from workers.tasks import register_tasks

if TYPE_CHECKING:
    from celery import Celery

    from core.settings import Settings


def create_celery(settings: Settings) -> Celery:
    """The Celery app for ``settings`` with the optimize task registered."""
    app = broker.create_celery(settings)
    register_tasks(app, settings)
    if settings.tracing.enabled:
        _trace_pool_children(settings)
    return app


def _trace_pool_children(settings: Settings) -> None:
    """Tasks run in prefork pool children: each sets up its own exporter (its thread does not survive the
    fork) and flushes it on exit (core/tracing.py)."""
    from celery import signals

    from core.tracing import configure_tracing, shutdown_tracing

    signals.worker_process_init.connect(lambda **_: configure_tracing(settings, process="worker"), weak=False)
    signals.worker_process_shutdown.connect(lambda **_: shutdown_tracing(), weak=False)


def __getattr__(name: str) -> Any:
    # ``celery -A workers.celery_app`` looks up ``app`` (or ``celery``); build it on first access only.
    if name in {"app", "celery"}:
        built = create_celery(get_settings())
        globals()["app"] = globals()["celery"] = built
        return built
    raise AttributeError(name)
