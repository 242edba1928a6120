"""The Celery task: thin. A job id in, ``runner.run_job`` does the rest.

``register_tasks(app, settings)`` is called by ``create_celery``; it registers ``onnxforge.optimize`` on
that app (explicitly, no ``current_app``/``shared_task``) and, in a worker's main process, starts the
reconciler thread and the webhook delivery thread (workers/webhooks.py) once the worker is ready. The
message carries only the job UUID (security.md T15); everything else is read from the job table, so a
duplicate delivery is a no-op (``claim`` is a CAS).

Error mapping: model faults end inside ``run_job`` as a failed job (never retried). Infrastructure
faults (database, storage) propagate; the task fails, its message is acknowledged, and the job keeps a
lease that expires, after which the reconciler re-enqueues it (bounded by ``worker.max_attempts``).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery import signals

from core.broker import TASK_NAME
from core.logs import log_context
from core.tracing import set_attributes

if TYPE_CHECKING:
    from celery import Celery

    from core.settings import Settings
    from core.storage import BlobStore
    from core.store import JobStore

log = logging.getLogger(__name__)


@dataclass
class WorkerContext:
    """Per-process handles. Built lazily after the prefork fork, so no DB connection crosses it."""

    pid: int
    store: JobStore
    blobs: BlobStore


_contexts: dict[tuple[int, str, str | None, str], WorkerContext] = {}
_lock = threading.Lock()


def worker_context(settings: Settings) -> WorkerContext:
    pid = os.getpid()
    key = (pid, settings.database_url, settings.database.schema_name, str(settings.storage.blobs_dir))
    with _lock:
        ctx = _contexts.get(key)
        if ctx is None:
            from core.objectstore import open_blob_store
            from core.store import JobStore

            store = JobStore(settings.database_url, schema=settings.database.schema_name)
            ctx = WorkerContext(pid, store, open_blob_store(settings.storage))  # local disk or object storage
            # A forked child keeps its parent's entry untouched: collecting it would close the parent's
            # pooled DB connections over the shared sockets.
            _contexts[key] = ctx
        return ctx


def optimize(job_id: str, settings: Settings, worker_name: str | None = None) -> None:
    """The task body, callable without Celery."""
    from workers.runner import run_job

    ctx = worker_context(settings)
    run_job(job_id, settings, ctx.store, ctx.blobs, worker_name=worker_name)


def register_tasks(app: Celery, settings: Settings) -> None:
    # shared=False: a shared task is added to every Celery app finalized later in this process, closing
    # over *this* app's settings; each app must run with its own.
    @app.task(
        name=TASK_NAME,
        bind=True,
        shared=False,
        acks_late=True,
        reject_on_worker_lost=True,
        ignore_result=True,
    )
    def optimize_task(self: Any, job_id: str) -> None:
        # The broker is untrusted (T15): accept nothing but a UUID string.
        if not isinstance(job_id, str):
            log.error("dropping %s message with a non-string job id", TASK_NAME)
            return
        try:
            job_id = str(uuid.UUID(job_id))
        except ValueError:
            log.error("dropping %s message with an invalid job id %r", TASK_NAME, job_id[:64])
            return
        with log_context(job_id=job_id):  # every line of this job, Celery's included, names it
            set_attributes(job_id=job_id)  # on the task's span, when tracing is on
            log.info("job %s delivered (Celery task %s)", job_id, self.request.id)
            optimize(job_id, settings, worker_name=self.request.hostname)

    def _on_worker_ready(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        from core.broker import Dispatcher
        from workers.reconciler import start_reconciler_thread
        from workers.webhooks import start_webhook_thread

        ctx = worker_context(settings)
        start_reconciler_thread(ctx.store, Dispatcher(settings, app=app), settings)
        start_webhook_thread(ctx.store, settings)

    # weak=False: the closure has no other reference and would be collected at once.
    signals.worker_ready.connect(_on_worker_ready, weak=False)
