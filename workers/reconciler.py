"""Re-enqueue jobs the broker lost: running with an expired lease, or queued for too long (T16, T17).

The job table is the source of truth and the broker only a hint, so a message may be lost (Redis
restarted without AOF, the filesystem queue's consumer died holding it, the enqueue failed after the row
was written). Every worker's main process runs ``start_reconciler_thread``.

A stale job is enqueued again only when the broker holds no live message for it. Staleness alone is not
enough: in a backlog longer than ``2 x lease`` every queued job is "stale" while its message still waits,
and a running job whose worker died stays stale until a worker claims it, so re-enqueueing on staleness
alone put one more copy of each on the queue every round, from every worker (docs/reliability.md, bug 3).
``broker_view`` reads the job ids of the messages waiting in the queues and of those delivered but not
acknowledged (with their delivery time). A delivered message counts as live only while it is recent and,
for a running job, newer than the job's lease: otherwise it belongs to a worker that died holding it
(Redis gives it back only after ``visibility_timeout``, hours later). Rounds are serialized by a lock (a
Redis key with a TTL, or ``flock`` on the filesystem queue), so two workers never both see a job as
missing and both enqueue it. A duplicate that still slips through (a worker took the message but has not
claimed yet, embedded mode) meets ``claim``'s compare-and-set and does nothing.

A job goes back at its fair-share priority (core/quotas.py): its team's base priority plus the team's jobs
in flight submitted before it. The row keeps no priority, so this is recomputed; it equals the priority the
job was sent with less the jobs ahead of it that have finished since, as if it had been submitted behind
the ones still in flight. Re-enqueueing at 0 would have put a flooding team's lost jobs ahead of every
other team's first ones.

In embedded mode each round also deletes consumed message files older than a day from the filesystem
queue's ``processed/`` folder. Every round deletes the attempt directories that killed attempts left and no
later attempt will (``workers.runner.prune_attempt_dirs``).
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from core.broker import QUEUES, Dispatcher, queue_dirs
from core.errors import UnavailableError
from core.quotas import Quota
from workers.runner import prune_attempt_dirs

if TYPE_CHECKING:
    from core.broker import Dispatcher
    from core.settings import Settings
    from core.store import Job, JobStore

log = logging.getLogger(__name__)

PROCESSED_KEEP_SECONDS = 24 * 3600
# kombu's Redis transport keeps a queue's priority p > 0 messages in the list "<queue>\x06\x16<p>", one list
# per step of core/broker.py's priority_steps (0-9): a list left unread hides its jobs, which then look lost.
_PRIORITY_SEP = "\x06\x16"
_PRIORITY_STEPS = tuple(range(10))
_IN_FLIGHT = ("queued", "running")
_PAGE = 500
_LOCK_KEY = "onnxforge.reconciler.lock"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def queued_grace_seconds(settings: Settings) -> int:
    """How long a queued job may wait untouched before the reconciler looks for its message."""
    return 2 * settings.worker.lease_seconds


@dataclass
class BrokerView:
    """The job ids the broker holds a message for."""

    waiting: set[str] = field(default_factory=set)  # in a queue, not yet delivered
    delivered: dict[str, float] = field(default_factory=dict)  # unacknowledged: job id -> latest delivery (epoch s)

    def has_live_message(self, job: Job, now: datetime, grace_seconds: int) -> bool:
        if job.id in self.waiting:
            return True
        delivered = self.delivered.get(job.id)
        if delivered is None:
            return False
        newer_than = now.timestamp() - grace_seconds
        if job.state == "running" and job.lease_expires_at is not None:
            newer_than = max(newer_than, job.lease_expires_at.timestamp())
        return delivered > newer_than


def job_id_of(raw: bytes | str | dict[str, Any]) -> str | None:
    """The job id a kombu message (JSON envelope, base64 body ``[[job_id], {}, {...}]``) carries, or None."""
    with contextlib.suppress(ValueError, TypeError, KeyError, IndexError, AttributeError):
        envelope = raw if isinstance(raw, dict) else json.loads(raw)
        body = envelope["body"]
        if envelope.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        job_id = json.loads(body)[0][0]
        return str(uuid.UUID(job_id)) if isinstance(job_id, str) else None
    return None


def _redis_client(settings: Settings) -> Any:
    import redis

    timeout = max(settings.broker.connect_timeout, 5.0)
    assert settings.broker.url is not None
    return redis.Redis.from_url(settings.broker.url, socket_connect_timeout=timeout, socket_timeout=timeout)


def broker_view(settings: Settings) -> BrokerView:
    """Read the broker's messages (raises when the broker cannot be read)."""
    view = BrokerView()
    if settings.embedded:
        folder = queue_dirs(settings.storage.queue_dir)["messages"]
        for entry in os.scandir(folder):
            if not entry.name.endswith(".msg"):
                continue
            with contextlib.suppress(OSError):  # taken by a consumer meanwhile: no longer waiting
                with open(entry.path, "rb") as f:
                    job_id = job_id_of(f.read())
                if job_id:
                    view.waiting.add(job_id)
        return view
    prefix = settings.broker.key_prefix
    client = _redis_client(settings)
    try:
        for queue in QUEUES:
            for step in _PRIORITY_STEPS:
                key = f"{prefix}{queue}" + (f"{_PRIORITY_SEP}{step}" if step else "")
                for raw in client.lrange(key, 0, -1):
                    if job_id := job_id_of(raw):
                        view.waiting.add(job_id)
        index = client.zrange(f"{prefix}unacked_index", 0, -1, withscores=True)  # delivery tag -> delivery time
        delivered_at = {tag.decode(): score for tag, score in index}
        for tag, value in client.hgetall(f"{prefix}unacked").items():
            with contextlib.suppress(ValueError, TypeError, IndexError):
                job_id = job_id_of(json.loads(value)[0])  # [message, exchange, routing_key]
                at = delivered_at.get(tag.decode())
                if job_id and at is not None:
                    view.delivered[job_id] = max(at, view.delivered.get(job_id, 0.0))
    finally:
        client.close()
    return view


@contextlib.contextmanager
def round_lock(settings: Settings) -> Iterator[str]:
    """Yield ``"held"`` while this process holds the reconciler lock for one round, ``"busy"`` when another
    process does, ``"unavailable"`` when the broker (Redis) cannot be reached to take it."""
    if settings.embedded:
        path = settings.storage.queue_dir / "reconciler.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+b") as handle:  # the kernel drops the flock when a holder dies
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield "busy"
                return
            try:
                yield "held"
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
        return
    client = _redis_client(settings)
    key, token = f"{settings.broker.key_prefix}{_LOCK_KEY}", uuid.uuid4().hex
    # The TTL frees the lock of a worker killed mid-round: until then no round runs anywhere, so it is short
    # (a round takes well under a second). A round that outlives it only risks a duplicate, which is a no-op.
    ttl_ms = 1000 * max(5, 2 * settings.worker.reconcile_interval_seconds)
    try:
        try:
            held = bool(client.set(key, token, nx=True, px=ttl_ms))
        except Exception as exc:  # redis-py raises several types for "cannot connect"
            log.warning("reconciler: broker unavailable (%s); will retry next round", type(exc).__name__)
            yield "unavailable"
            return
        try:
            yield "held" if held else "busy"
        finally:
            if held:
                with contextlib.suppress(Exception):  # broker gone mid-round: the TTL frees the lock
                    client.eval(_RELEASE, 1, key, token)
    finally:
        client.close()


def _in_flight_since(store: JobStore, tenant: str) -> list[datetime]:
    """Creation times of the tenant's jobs queued or running, sorted."""
    stamps: list[datetime] = []
    for state in _IN_FLIGHT:
        offset, total = 0, 1
        while offset < total:
            page, total = store.list(tenant, limit=_PAGE, offset=offset, state=state)
            if not page:
                break
            stamps.extend(job.created_at for job in page)
            offset += len(page)
    return sorted(stamps)


class _Priorities:
    """Each job's fair-share priority for one round, reading each team's jobs in flight once."""

    def __init__(self, store: JobStore, settings: Settings) -> None:
        self.store, self.settings = store, settings
        self._since: dict[str, list[datetime]] = {}

    def of(self, job: Job) -> int | None:
        if self.settings.embedded:  # the filesystem queue is first in, first out
            return None
        if job.tenant not in self._since:
            self._since[job.tenant] = _in_flight_since(self.store, job.tenant)
        ahead = bisect.bisect_left(self._since[job.tenant], job.created_at)
        return Quota.for_team(self.settings.quotas, job.tenant).fair_priority(ahead)


def reconcile_once(store: JobStore, dispatcher: Dispatcher, settings: Settings, now: datetime | None = None) -> int:
    """Enqueue every stale job that the broker holds no live message for; returns how many were enqueued."""
    now = now or datetime.now(UTC)
    grace = queued_grace_seconds(settings)
    stale = store.stale(now, queued_older_than_seconds=grace)
    if not stale:
        return 0
    with round_lock(settings) as lock:
        if lock != "held":
            return 0
        try:
            view: BrokerView | None = broker_view(settings)
        except Exception:  # unreadable queues: enqueue as before; a duplicate costs only a delivery
            log.warning("reconciler: cannot read the broker's queues; enqueuing every stale job", exc_info=True)
            view = None
        count, priorities = 0, _Priorities(store, settings)
        for job in stale:
            if view is not None and view.has_live_message(job, now, grace):
                continue
            try:
                priority = priorities.of(job)
                dispatcher.enqueue(job.id, job.queue, priority)
            except UnavailableError:
                log.warning("reconciler: broker unavailable; will retry next round")
                break
            store.touch_queued(job.id)
            log.info(
                "reconciler: re-enqueued %s job %s (attempts %d, priority %s)",
                job.state,
                job.id,
                job.attempts,
                priority,
            )
            count += 1
        return count


def prune_processed(settings: Settings, older_than_seconds: float = PROCESSED_KEEP_SECONDS) -> int:
    """Embedded mode: delete consumed message files (kombu keeps them in ``queue/processed``)."""
    if not settings.embedded:
        return 0
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
                prune_attempt_dirs(settings, store)
            except Exception:  # a database outage must not kill the thread; try again next round
                log.warning("reconciler round failed", exc_info=True)

    thread = threading.Thread(target=loop, name="onnxforge-reconciler", daemon=True)
    thread.stop_event = stop  # type: ignore[attr-defined]
    thread.start()
    return thread
