"""``onnxforge serve`` and ``onnxforge worker``: launch the API and the Celery workers from Settings.

Embedded mode (``broker.url`` unset; the default): ``serve`` creates the job table and the filesystem
queue under ``<data_dir>/queue``, starts ``worker.embedded_workers`` worker subprocesses
(``python -m onnxforge.cli worker --queues cpu,gpu --concurrency 1``, the same task code as a distributed
worker, reading the same ``ONNXFORGE_*`` environment), restarts any that dies, then runs uvicorn in the
foreground. On exit (Ctrl-C, SIGTERM) the workers get SIGTERM, then SIGKILL after a grace period; they
also die with ``serve`` if it is killed outright (PDEATHSIG).

Distributed mode (``broker.url`` set): ``serve`` runs the API only; workers run elsewhere with
``onnxforge worker``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.settings import Settings

log = logging.getLogger("onnxforge.server")

WORKER_STOP_GRACE = 20.0
_RESTART_BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0)


# ------------------------------------------------------------------------------------------------- worker


def run_worker(
    settings: Settings,
    *,
    queues: Sequence[str] | None = None,
    concurrency: int | None = None,
    loglevel: str | None = None,
) -> int:
    """Run a Celery worker (prefork pool) in this process until it is told to stop."""
    from core.broker import QUEUES
    from core.store import JobStore
    from workers.celery_app import create_celery

    level = loglevel or settings.log_level
    _configure_worker_logging(settings, level)
    chosen = list(queues or settings.worker.queues)
    unknown = [q for q in chosen if q not in QUEUES]
    if unknown:
        raise ValueError(f"unknown queue(s) {', '.join(unknown)}; expected {', '.join(QUEUES)}")
    # Migrate here too, so a worker that starts before the API does not fail its first claim.
    store = JobStore(settings.database_url, settings.database.schema_name)
    try:
        store.prepare(auto_migrate=settings.database.auto_migrate)
    finally:
        store.close()
    settings.storage.work_dir.mkdir(parents=True, exist_ok=True)

    app = create_celery(settings)
    argv = [
        "worker",
        f"--queues={','.join(chosen)}",
        f"--concurrency={concurrency or settings.worker.concurrency}",
        f"--loglevel={level}",
        "--pool=prefork",
        f"--hostname=onnxforge-{os.getpid()}@%h",
    ]
    from core.logs import resolve_format

    if resolve_format(settings) == "json":
        argv.insert(0, "--quiet")  # Celery's banner is printed, not logged: it would break the JSON lines
    if settings.embedded:
        # Gossip, mingle and heartbeats use fanout queues; on the filesystem transport a dead worker's
        # fanout queue would keep collecting files (see workers/celery_app.py).
        argv += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    app.worker_main(argv)
    return 0


def _configure_worker_logging(settings: Settings, level: str) -> None:
    """Our handler for the worker and its pool children; Celery installs none while a receiver of
    setup_logging exists, and calls it again in each prefork child."""
    from celery import signals

    from core.logs import configure_logging

    settings = settings.model_copy(update={"log_level": level})

    def _setup(**_: object) -> None:
        configure_logging(settings, process="worker")

    _setup()
    signals.setup_logging.connect(_setup, weak=False)


# -------------------------------------------------------------------------------------------- serve


def _die_with_parent() -> None:  # preexec_fn: only prctl
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedWorkers:
    """Worker subprocesses of ``onnxforge serve``, restarted with backoff when one exits."""

    def __init__(self, count: int, loglevel: str) -> None:
        self.count = count
        self.argv = [
            sys.executable, "-m", "onnxforge.cli", "worker",
            "--queues", "cpu,gpu", "--concurrency", "1", "--loglevel", loglevel,
        ]  # fmt: skip
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * count
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None

    def _spawn(self) -> subprocess.Popen[bytes]:
        # Same environment as serve: the workers read the same ONNXFORGE_* settings.
        return subprocess.Popen(self.argv, start_new_session=True, preexec_fn=_die_with_parent)  # noqa: PLW1509

    def start(self) -> None:
        with self._lock:
            for i in range(self.count):
                self.procs[i] = self._spawn()
        self._monitor = threading.Thread(target=self._watch, name="onnxforge-worker-monitor", daemon=True)
        self._monitor.start()

    def _watch(self) -> None:
        failures = [0] * self.count
        while not self._stop.wait(1.0):
            with self._lock:
                for i, proc in enumerate(self.procs):
                    if proc is None or proc.poll() is None or self._stop.is_set():
                        continue
                    delay = _RESTART_BACKOFF[min(failures[i], len(_RESTART_BACKOFF) - 1)]
                    log.warning("embedded worker %d exited with %s; restarting in %.0f s", i, proc.returncode, delay)
                    failures[i] += 1
                    if self._stop.wait(delay):
                        return
                    self.procs[i] = self._spawn()

    def stop(self, grace: float = WORKER_STOP_GRACE) -> None:
        self._stop.set()
        with self._lock:
            live = [p for p in self.procs if p is not None and p.poll() is None]
            for proc in live:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            for proc in live:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)


def serve(settings: Settings, *, host: str | None = None, port: int | None = None) -> int:
    """Run the API (and, in embedded mode, its workers) until interrupted."""
    import uvicorn

    from app.main import create_app
    from core.logs import configure_logging
    from core.store import JobStore

    configure_logging(settings, process="api")
    host = host or settings.api.host
    port = settings.api.port if port is None else port
    workers: EmbeddedWorkers | None = None
    if settings.embedded:
        from core.broker import queue_dirs

        for path in queue_dirs(settings.storage.queue_dir).values():
            path.mkdir(parents=True, exist_ok=True)
        store = JobStore(settings.database_url, settings.database.schema_name)
        try:
            store.prepare(auto_migrate=settings.database.auto_migrate)
        finally:
            store.close()
        if settings.worker.embedded_workers:
            workers = EmbeddedWorkers(settings.worker.embedded_workers, settings.log_level)
            workers.start()
            log.info("embedded mode: %d worker process(es) on %s", workers.count, settings.storage.queue_dir)
    try:
        config = uvicorn.Config(
            create_app(settings),
            host=host,
            port=port,
            log_level=settings.log_level.lower(),
            log_config=None,  # uvicorn's loggers go through core/logs.py's handler, with the request context
            # security.md (c): bounded concurrency and keep-alive, bounded header size.
            limit_concurrency=256,
            backlog=512,
            timeout_keep_alive=5,
            timeout_graceful_shutdown=30,
            h11_max_incomplete_event_size=16384,
        )
        server = uvicorn.Server(config)
        server.run()
        return 0 if server.started else 1
    finally:
        if workers is not None:
            workers.stop()
