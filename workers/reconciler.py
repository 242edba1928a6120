"""Re-enqueue jobs the broker lost: running with an expired lease, or queued for too long (T16, T17).

The job table is the source of truth and the broker only a hint, so a message may be lost (Redis
restarted without AOF, the filesystem queue's consumer died holding it, the enqueue failed after the row
was written). Every worker's main process runs ``start_reconciler_thread``; several at once are safe,
because a duplicate message meets ``claim``'s compare-and-set and does nothing. In embedded mode each round
also deletes consumed message files older than a day from the filesystem queue's ``processed/`` folder.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from onnxforge.errors import UnavailableError

if TYPE_CHECKING:
    from app.settings import Settings
    from app.store import JobStore
    from workers.dispatch import Dispatcher

log = logging.getLogger(__name__)

PROCESSED_KEEP_SECONDS = 24 * 3600


def queued_grace_seconds(settings: Settings) -> int:
    """How long a queued job may wait untouched before it is enqueued again."""
    return 2 * settings.worker.lease_seconds


def reconcile_once(store: JobStore, dispatcher: Dispatcher, settings: Settings, now: datetime | None = None) -> int:
    """Enqueue every stale job once; returns how many were enqueued."""
    now = now or datetime.now(UTC)
    count = 0
    for job in store.stale(now, queued_older_than_seconds=queued_grace_seconds(settings)):
        try:
            dispatcher.enqueue(job.id, job.queue)
        except UnavailableError:
            log.warning("reconciler: broker unavailable; will retry next round")
            break
        store.touch_queued(job.id)
        log.info("reconciler: re-enqueued %s job %s (attempts %d)", job.state, job.id, job.attempts)
        count += 1
    return count


def prune_processed(settings: Settings, older_than_seconds: float = PROCESSED_KEEP_SECONDS) -> int:
    """Embedded mode: delete consumed message files (kombu keeps them in ``queue/processed``)."""
    if not settings.embedded:
        return 0
    from workers.celery_app import queue_dirs

    folder = queue_dirs(settings.storage.queue_dir)["processed"]
    cutoff = time.time() - older_than_seconds
    removed = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.name.endswith(".msg") and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.path)
                removed += 1
        except OSError:
            continue
    return removed


def start_reconciler_thread(
    store: JobStore, dispatcher: Dispatcher, settings: Settings, stop: threading.Event | None = None
) -> threading.Thread:
    """Run ``reconcile_once`` every ``worker.reconcile_interval_seconds`` in a daemon thread."""
    stop = stop or threading.Event()
    interval = settings.worker.reconcile_interval_seconds

    def loop() -> None:
        while not stop.wait(interval):
            try:
                reconcile_once(store, dispatcher, settings)
                prune_processed(settings)
            except Exception:  # a database outage must not kill the thread; try again next round
                log.warning("reconciler round failed", exc_info=True)

    thread = threading.Thread(target=loop, name="onnxforge-reconciler", daemon=True)
    thread.stop_event = stop  # type: ignore[attr-defined]
    thread.start()
    return thread
