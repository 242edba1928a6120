"""The broker client: the Celery configuration built from Settings, and the dispatcher that enqueues jobs.

JSON only, late acks, explicit ``cpu``/``gpu`` queues. ``create_celery(settings)`` builds a producer-only
app; the worker floor (workers/celery_app.py) builds on it and registers the task. Both the API's
``Dispatcher`` and the workers' reconciler enqueue through here, which is why it is ground and not worker
code. ``Dispatcher.enqueue`` runs after the job row is committed; a broker outage answers
``UnavailableError(code="BROKER_UNAVAILABLE")`` within about ``broker.connect_timeout`` seconds (the API
maps it to 503, never 500), and the reconciler later enqueues the queued job anyway (T17).

Two brokers:

* **Distributed** (``broker.url`` set, Redis): every key carries ``broker.key_prefix``
  (``global_keyprefix``), and ``visibility_timeout`` is set on the broker and result-backend transport
  options alike (Celery ``redis.rst`` caveats; security.md T18).
* **Embedded** (``broker.url`` unset): kombu's ``filesystem://`` transport under
  ``<data_dir>/queue``. Producer and consumers use the same ``messages/`` folder, so the API process and
  the worker processes that ``onnxforge serve`` starts share one queue; the queue name is part of each
  message file's name, so ``cpu`` and ``gpu`` stay apart. A consumer takes a message by renaming it into
  ``processed/`` (same file system, so the rename is atomic and exactly one consumer wins). Limits: the
  transport has no broker-side acknowledgement; a message is gone from the queue once a worker took it,
  so a worker killed with SIGKILL does not get it redelivered. ``reject_on_worker_lost`` still requeues
  when a pool child dies under a live worker, and the job table's lease plus the reconciler
  (workers/reconciler.py) re-enqueue whatever was lost. Remote control, events, gossip and mingle are
  off in embedded mode: they rely on fanout queues that a dead worker would leave filling up on disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery import Celery
from kombu import Exchange, Queue

from core.errors import InvalidInputError, UnavailableError

if TYPE_CHECKING:
    from core.settings import Settings

TASK_NAME = "onnxforge.optimize"
QUEUES: tuple[str, ...] = ("cpu", "gpu")
EXCHANGE = Exchange("onnxforge", type="direct", durable=True)

# Celery's own settings that do not depend on Settings (security.md (c)).
_FIXED: dict[str, Any] = {
    "task_serializer": "json",
    "result_serializer": "json",
    "accept_content": ["json"],
    "result_accept_content": ["json"],
    "event_serializer": "json",
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "task_acks_on_failure_or_timeout": True,
    "worker_prefetch_multiplier": 1,
    "task_ignore_result": True,  # the job table is authoritative; nothing reads Celery results
    "task_track_started": False,
    "task_create_missing_queues": False,
    "task_default_queue": "cpu",
    "task_default_exchange": EXCHANGE.name,
    "task_default_routing_key": "cpu",
    "broker_connection_retry_on_startup": True,
    "worker_pool": "prefork",  # never gevent/eventlet: they ignore visibility_timeout (T18)
    "worker_cancel_long_running_tasks_on_connection_loss": True,
    "worker_soft_shutdown_timeout": 60.0,
    "worker_max_tasks_per_child": 50,
    "worker_max_memory_per_child": 1_000_000,  # KiB; the heavy work runs in a separate child anyway
    "enable_utc": True,
}


def queue_dirs(queue_dir: Path) -> dict[str, Path]:
    """The filesystem transport's folders under ``storage.queue_dir``."""
    return {
        "messages": queue_dir / "messages",
        "processed": queue_dir / "processed",
        "control": queue_dir / "control",
    }


def _filesystem_options(settings: Settings) -> dict[str, Any]:
    dirs = queue_dirs(settings.storage.queue_dir)
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    return {
        # Same folder in and out: the API writes where the workers read.
        "data_folder_in": str(dirs["messages"]),
        "data_folder_out": str(dirs["messages"]),
        # store_processed keeps the "take" a same-file-system rename; with False kombu moves the file to
        # /tmp, which may be another file system, where shutil.move copies and two consumers can both win.
        "store_processed": True,
        "processed_folder": str(dirs["processed"]),
        "control_folder": str(dirs["control"]),
        "polling_interval": 0.5,
    }


def celery_config(settings: Settings) -> dict[str, Any]:
    """The complete Celery configuration for ``settings`` (a plain dict, so tests can assert on it)."""
    worker = settings.worker
    config: dict[str, Any] = dict(_FIXED)
    config.update(
        task_queues=tuple(Queue(name, EXCHANGE, routing_key=name) for name in QUEUES),
        task_routes={TASK_NAME: {"queue": "cpu", "routing_key": "cpu"}},
        task_time_limit=worker.task_time_limit,
        # The runner's own wall limit (child_wall_seconds, validated below task_time_limit) fires first and
        # fails the job with TIMEOUT; the soft limit, halfway to the hard one, is only the backstop.
        task_soft_time_limit=(worker.task_time_limit + worker.child_wall_seconds + 1) // 2,
        worker_concurrency=worker.concurrency,
    )
    if settings.embedded:
        config.update(
            broker_url="filesystem://localhost//",  # the host is unused; naming one silences a kombu warning
            broker_transport_options=_filesystem_options(settings),
            worker_enable_remote_control=False,
            worker_send_task_events=False,
        )
    else:
        visibility = settings.broker.visibility_timeout
        timeout = settings.broker.connect_timeout
        transport = {
            "visibility_timeout": visibility,
            "global_keyprefix": settings.broker.key_prefix,
            "socket_connect_timeout": timeout,
            "socket_timeout": max(timeout, 30.0),
            "socket_keepalive": True,
            "health_check_interval": 25,
            # Ten priority lists per queue, served 0 first: the per-team fair share of core/quotas.py.
            "priority_steps": list(range(10)),
            "queue_order_strategy": "priority",
        }
        config.update(
            broker_url=settings.broker.url,
            broker_transport_options=transport,
            result_backend_transport_options={
                "visibility_timeout": visibility,
                "global_keyprefix": settings.broker.key_prefix,
            },
            visibility_timeout=visibility,
            broker_connection_timeout=timeout,
        )
    return config


def create_celery(settings: Settings) -> Celery:
    """A producer-only Celery app for ``settings``: it sends by task name and needs no task code.

    The worker floor (workers/celery_app.py) builds on it and registers the tasks.
    """
    app = Celery("onnxforge", set_as_current=False)
    app.conf.update(celery_config(settings))
    app.conf.onnxforge_settings = settings  # read back by tasks and signals of this app
    return app


# One quick retry: a connection dropped by a Redis restart is re-established, a dead Redis is not waited on.
_RETRY_POLICY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}


class Dispatcher:
    def __init__(self, settings: Settings, app: Celery | None = None) -> None:
        self.settings = settings
        self._owns_app = app is None
        self.app = app if app is not None else create_celery(settings)

    def enqueue(self, job_id: str, queue: str, priority: int | None = None) -> None:
        """``priority``: 0 (first) to 9 (last) on the Redis broker (core/quotas.py); the embedded queue
        ignores it."""
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
                priority=priority,
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
