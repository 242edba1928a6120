"""The reconciler (workers/reconciler.py) against a real job store and a real broker (T16, T17).

Redis: the test Redis of tests/conftest.py, db 11, a key prefix per test under the session's prefix.
Messages are put there by the real ``Dispatcher`` (as the API does) and taken by a real kombu consumer in
a subprocess that is then SIGKILLed, so the message stays delivered-but-unacknowledged in Redis exactly as
when a worker dies holding it. Rounds are ``reconcile_once`` calls with ``now`` moved forward; the store's
clock follows wall time (shifted), because Redis stamps deliveries with wall time.

The flood these guard against (docs/reliability.md, bug 3): re-enqueueing on staleness alone put one more
message per backlogged job on the queue every round, from every worker.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

from core.broker import Dispatcher, queue_dirs
from core.settings import Settings
from core.store import Job, JobStore
from workers.reconciler import broker_view, job_id_of, reconcile_once, round_lock

ROOT = Path(__file__).resolve().parents[2]
LEASE = 10
GRACE = 2 * LEASE  # queued_grace_seconds
ROUNDS = 6

# Takes one message from queue "cpu" without acknowledging it, says so, and waits to be killed.
_CONSUMER = """
import sys, time
from kombu import Queue
from core.settings import Settings
from core.broker import EXCHANGE, create_celery

settings = Settings(storage={"data_dir": sys.argv[1]}, broker={"url": sys.argv[2], "key_prefix": sys.argv[3]})
app = create_celery(settings)
with app.connection_for_read() as conn:
    message = Queue("cpu", EXCHANGE, routing_key="cpu")(conn.default_channel).get(no_ack=False)
    print("taken" if message is not None else "empty", flush=True)
    time.sleep(120)
"""


def timedelta_s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


class ShiftedClock:
    """Wall time plus an offset: rows can be made old while Redis stamps deliveries with wall time."""

    def __init__(self) -> None:
        self.offset = timedelta()

    def __call__(self) -> datetime:
        return datetime.now(UTC) + self.offset


@pytest.fixture
def clock() -> ShiftedClock:
    return ShiftedClock()


@pytest.fixture
def distributed(tmp_path: Path, redis_url: str, redis_test_prefix: str) -> Settings:
    return Settings(
        storage={"data_dir": tmp_path / "data"},
        broker={"url": redis_url, "key_prefix": redis_test_prefix},
        worker={"lease_seconds": LEASE},
    )


@pytest.fixture
def embedded(tmp_path: Path) -> Settings:
    return Settings(storage={"data_dir": tmp_path / "data"}, worker={"lease_seconds": LEASE})


def _store(settings: Settings, clock: ShiftedClock) -> JobStore:
    store = JobStore(f"sqlite:///{settings.storage.data_dir / 'jobs.db'}", clock=clock)
    store.create_schema()
    return store


def _create(store: JobStore, tenant: str = "t") -> Job:
    return store.create(
        tenant=tenant, model_sha256="0" * 64, model_filename="m.onnx", model_format="onnx", model_size=1,
        samples_sha256=None, config={}, queue="cpu",
    )  # fmt: skip


def _waiting_by_priority(settings: Settings) -> dict[int, Counter[str]]:
    """Priority -> (job id -> number of messages waiting in the ``cpu`` queue at that priority).

    kombu keeps priority 0 in the queue's own list and p > 0 in "<queue>\x06\x16<p>" (core/broker.py).
    """
    client = redis.Redis.from_url(str(settings.broker.url))
    try:
        base = f"{settings.broker.key_prefix}cpu"
        lists = {p: client.lrange(base + (f"\x06\x16{p}" if p else ""), 0, -1) for p in range(10)}
    finally:
        client.close()
    return {p: Counter(job_id_of(raw) for raw in raws) for p, raws in lists.items() if raws}


def _waiting(settings: Settings) -> Counter[str]:
    """Job id -> number of messages waiting in the ``cpu`` queue, at any priority."""
    return sum(_waiting_by_priority(settings).values(), Counter())


def _rounds(store: JobStore, dispatchers: list[Dispatcher], settings: Settings, start: datetime) -> list[int]:
    """ROUNDS reconcile rounds, each by the next worker, GRACE + 1 s apart, so every queued row is stale."""
    return [
        reconcile_once(
            store, dispatchers[n % len(dispatchers)], settings, now=start + timedelta_s((n + 1) * (GRACE + 1))
        )
        for n in range(ROUNDS)
    ]


def _take_and_die(settings: Settings, tmp_path: Path) -> None:
    """A consumer takes one message and is SIGKILLed holding it (it stays unacknowledged in Redis)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CONSUMER, str(tmp_path), str(settings.broker.url), settings.broker.key_prefix],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "taken"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.integration
def test_reconcile_once_adds_no_message_when_backlog_outlasts_two_leases(distributed, clock):
    store = _store(distributed, clock)
    with Dispatcher(distributed) as api, Dispatcher(distributed) as w1, Dispatcher(distributed) as w2:
        jobs = [_create(store) for _ in range(20)]
        for job in jobs:
            api.enqueue(job.id, job.queue)

        enqueued = _rounds(store, [w1, w2], distributed, datetime.now(UTC))

    assert enqueued == [0] * ROUNDS
    assert _waiting(distributed) == Counter({job.id: 1 for job in jobs})
    store.close()


@pytest.mark.integration
def test_reconcile_once_reenqueues_each_lost_message_once_when_rounds_repeat(distributed, clock):
    store = _store(distributed, clock)
    with Dispatcher(distributed) as api, Dispatcher(distributed) as w1, Dispatcher(distributed) as w2:
        jobs = [_create(store) for _ in range(6)]
        for job in jobs[:3]:  # the other three messages were lost (Redis restarted without them)
            api.enqueue(job.id, job.queue)

        enqueued = _rounds(store, [w1, w2], distributed, datetime.now(UTC))

    assert enqueued == [3] + [0] * (ROUNDS - 1)
    assert _waiting(distributed) == Counter({job.id: 1 for job in jobs})
    store.close()


@pytest.mark.integration
def test_reconcile_once_reenqueues_lost_job_at_its_fair_share_priority_when_its_team_has_jobs_ahead(
    tmp_path, redis_url, redis_test_prefix, clock
):
    settings = Settings(
        storage={"data_dir": tmp_path / "data"},
        broker={"url": redis_url, "key_prefix": redis_test_prefix},
        worker={"lease_seconds": LEASE},
        quotas={"teams": {"flood": {"priority": 2}}},
    )
    store = _store(settings, clock)
    with Dispatcher(settings) as api, Dispatcher(settings) as w1, Dispatcher(settings) as w2:
        other = _create(store, "quiet")  # another team's job, older, does not count against "flood"
        first, second, lost = (_create(store, "flood") for _ in range(3))
        api.enqueue(first.id, first.queue, 2)  # as the API sends them: base 2 plus the team's jobs in flight
        api.enqueue(second.id, second.queue, 3)  # the lost job was sent at 4, then Redis lost it

        enqueued = _rounds(store, [w1, w2], settings, datetime.now(UTC))

    # Re-enqueued once, at 4 and not 0; the later rounds see it in the priority-4 list and leave it alone.
    assert enqueued == [2] + [0] * (ROUNDS - 1)
    assert _waiting_by_priority(settings) == {
        0: Counter({other.id: 1}),
        2: Counter({first.id: 1}),
        3: Counter({second.id: 1}),
        4: Counter({lost.id: 1}),
    }
    store.close()


@pytest.mark.integration
def test_reconcile_once_reenqueues_running_job_once_and_it_finishes_when_its_worker_died(distributed, clock, tmp_path):
    store = _store(distributed, clock)
    with Dispatcher(distributed) as api, Dispatcher(distributed) as w1, Dispatcher(distributed) as w2:
        job = _create(store)
        api.enqueue(job.id, job.queue)
        _take_and_die(distributed, tmp_path)  # the worker took the message ...
        assert store.claim(job.id, "dead-worker", LEASE, max_attempts=3) is not None  # ... claimed, then died
        assert _waiting(distributed) == Counter()
        after_lease = datetime.now(UTC) + timedelta_s(LEASE + 1)
        assert reconcile_once(store, w1, distributed, now=datetime.now(UTC)) == 0  # lease still valid

        enqueued = _rounds(store, [w1, w2], distributed, after_lease - timedelta_s(GRACE + 1))

        assert enqueued == [1] + [0] * (ROUNDS - 1)
        assert _waiting(distributed) == Counter({job.id: 1})
        clock.offset = timedelta_s(LEASE + 1)  # the next worker claims once the dead one's lease expired
        second = store.claim(job.id, "live-worker", LEASE, max_attempts=3)
        assert second is not None and second.attempts == 2
        assert store.succeed(
            job.id, 2, artifact_sha256="a" * 64, artifact_format="onnx", report_sha256="b" * 64,
            report_html_sha256="c" * 64, summary={}, timings={},
        )  # fmt: skip
    assert store.get(job.id).state == "succeeded"
    store.close()


@pytest.mark.integration
def test_reconcile_once_leaves_queued_job_alone_when_a_worker_took_its_message_recently(distributed, clock, tmp_path):
    store = _store(distributed, clock)
    clock.offset = -timedelta_s(3 * GRACE)  # the job has waited in a backlog for a long time
    job = _create(store)
    clock.offset = timedelta()
    with Dispatcher(distributed) as api, Dispatcher(distributed) as w1:
        api.enqueue(job.id, job.queue)
        _take_and_die(distributed, tmp_path)
        view = broker_view(distributed)
        assert job.id not in view.waiting and job.id in view.delivered

        # Just delivered: its worker may still claim it.
        assert reconcile_once(store, w1, distributed) == 0
        # Delivered longer ago than the grace and still queued: that worker is gone.
        assert reconcile_once(store, w1, distributed, now=datetime.now(UTC) + timedelta_s(GRACE + 1)) == 1
    assert _waiting(distributed) == Counter({job.id: 1})
    store.close()


@pytest.mark.integration
def test_reconcile_once_enqueues_nothing_when_another_worker_holds_the_round_lock(distributed, clock):
    store = _store(distributed, clock)
    job = _create(store)  # its message was lost
    later = datetime.now(UTC) + timedelta_s(GRACE + 1)
    with Dispatcher(distributed) as w1:
        with round_lock(distributed) as lock:
            assert lock == "held"
            assert reconcile_once(store, w1, distributed, now=later) == 0
        assert reconcile_once(store, w1, distributed, now=later) == 1
    assert _waiting(distributed) == Counter({job.id: 1})
    store.close()


def _message_files(settings: Settings) -> list[Path]:
    return sorted(queue_dirs(settings.storage.queue_dir)["messages"].glob("*.msg"))


def test_reconcile_once_reenqueues_only_lost_messages_when_embedded(embedded, clock):
    store = _store(embedded, clock)
    with Dispatcher(embedded) as api, Dispatcher(embedded) as w1:
        kept, lost = _create(store), _create(store)
        api.enqueue(kept.id, kept.queue)
        api.enqueue(lost.id, lost.queue)
        (lost_file,) = [p for p in _message_files(embedded) if lost.id in p.read_text()]
        lost_file.unlink()

        enqueued = _rounds(store, [w1], embedded, datetime.now(UTC))

    assert enqueued == [1] + [0] * (ROUNDS - 1)
    ids: list[Any] = [job_id_of(p.read_bytes()) for p in _message_files(embedded)]
    assert Counter(ids) == Counter({kept.id: 1, lost.id: 1})
    store.close()


def test_job_id_of_returns_none_when_message_is_not_a_task_message():
    assert job_id_of(b"not json") is None
    assert job_id_of(b'{"body": "W10=", "properties": {"body_encoding": "base64"}}') is None  # body []
    assert job_id_of(b'{"body": "[[\\"../../x\\"], {}, {}]"}') is None
