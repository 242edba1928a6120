"""Enqueue job ids on the ``cpu``/``gpu`` queues, failing fast when the broker is down.

The API calls ``Dispatcher.enqueue`` after the job row is committed; a broker outage answers
``UnavailableError(code="BROKER_UNAVAILABLE")`` within about ``broker.connect_timeout`` seconds (the
API maps it to 503, never 500), and the reconciler later enqueues the queued job anyway (T17).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from onnxforge.errors import InvalidInputError, UnavailableError
from workers.celery_app import QUEUES, TASK_NAME, create_celery, queue_dirs

if TYPE_CHECKING:
    from celery import Celery

    from app.settings import Settings

# One quick retry: a connection dropped by a Redis restart is re-established, a dead Redis is not waited on.
_RETRY_POLICY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}


class Dispatcher:
    def __init__(self, settings: Settings, app: Celery | None = None) -> None:
        self.settings = settings
        self._owns_app = app is None
        self.app = app if app is not None else create_celery(settings, with_tasks=False)

    def enqueue(self, job_id: str, queue: str) -> None:
        if queue not in QUEUES:
            raise InvalidInputError(f"unknown queue {queue!r}; expected one of {', '.join(QUEUES)}")
        try:
            self.app.send_task(
                TASK_NAME,
                args=[str(job_id)],
                queue=queue,
                routing_key=queue,
                retry=True,
                retry_policy=_RETRY_POLICY,
                ignore_result=True,
            )
        except Exception as exc:  # kombu/redis raise several unrelated types for "cannot connect"
            raise self._unavailable(exc) from exc

    def ping(self) -> None:
        """Raise UnavailableError unless a message could be enqueued now."""
        if self.settings.embedded:
            for path in queue_dirs(self.settings.storage.queue_dir).values():
                if not (path.is_dir() and os.access(path, os.W_OK | os.X_OK)):
                    raise UnavailableError(
                        f"filesystem queue folder {path} is missing or not writable",
                        code="BROKER_UNAVAILABLE",
                    )
            return
        try:
            with self.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0.2, interval_max=0.2)
                conn.default_channel.client.ping()
        except Exception as exc:
            raise self._unavailable(exc) from exc

    def close(self) -> None:
        if self._owns_app:
            self.app.close()

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @staticmethod
    def _unavailable(exc: BaseException) -> UnavailableError:
        # The URL may hold a password: name the failure, not the connection string.
        return UnavailableError(f"message broker unavailable ({type(exc).__name__})", code="BROKER_UNAVAILABLE")
