"""Celery configuration invariants (docs/security.md T15-T18), the dispatcher and the reconciler.

The filesystem-queue test runs a consumer in another interpreter: embedded mode depends on the API
process and the worker processes sharing one queue.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from core.broker import QUEUES, TASK_NAME, Dispatcher, celery_config, queue_dirs
from core.broker import create_celery as broker_celery
from core.errors import InvalidInputError, UnavailableError
from core.settings import Settings
from core.store import JobStore
from workers.celery_app import create_celery
from workers.reconciler import prune_processed, reconcile_once

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def distributed(tmp_path: Path) -> Settings:
    return Settings(
        storage={"data_dir": tmp_path / "data"},
        broker={"url": "redis://127.0.0.1:6379/11", "key_prefix": "onnxforge-cfg-test:"},
    )


@pytest.fixture
def embedded(tmp_path: Path) -> Settings:
    return Settings(storage={"data_dir": tmp_path / "data"})


def test_celery_config_is_json_only_with_late_acks_when_distributed(distributed):
    conf = celery_config(distributed)

    assert conf["task_serializer"] == conf["result_serializer"] == "json"
    assert conf["accept_content"] == ["json"]
    assert conf["task_acks_late"] is True
    assert conf["task_reject_on_worker_lost"] is True
    assert conf["worker_prefetch_multiplier"] == 1
    assert conf["task_ignore_result"] is True
    assert conf["worker_pool"] == "prefork"
    assert conf["broker_connection_retry_on_startup"] is True


def test_celery_config_visibility_exceeds_time_limit_when_distributed(distributed):
    conf = celery_config(distributed)
    limit = conf["task_time_limit"]

    assert distributed.worker.child_wall_seconds < conf["task_soft_time_limit"] < limit
    assert conf["broker_transport_options"]["visibility_timeout"] > limit
    assert conf["result_backend_transport_options"]["visibility_timeout"] > limit
    assert conf["visibility_timeout"] > limit


def test_settings_refuse_visibility_below_time_limit_when_configured_so(tmp_path):
    with pytest.raises(ValueError, match="visibility_timeout"):
        Settings(broker={"url": "redis://x", "visibility_timeout": 100}, worker={"task_time_limit": 200})


def test_celery_config_has_explicit_prefixed_queues_when_distributed(distributed):
    conf = celery_config(distributed)

    assert {q.name for q in conf["task_queues"]} == set(QUEUES) == {"cpu", "gpu"}
    assert conf["task_create_missing_queues"] is False
    assert conf["broker_transport_options"]["global_keyprefix"] == "onnxforge-cfg-test:"
    assert conf["task_routes"][TASK_NAME]["queue"] == "cpu"


def test_celery_config_uses_shared_filesystem_folder_when_embedded(embedded):
    conf = celery_config(embedded)
    options = conf["broker_transport_options"]

    assert conf["broker_url"].startswith("filesystem://")
    assert options["data_folder_in"] == options["data_folder_out"]
    assert options["store_processed"] is True
    assert Path(options["processed_folder"]).parent == Path(options["data_folder_in"]).parent
    assert conf["worker_enable_remote_control"] is False
    assert conf["accept_content"] == ["json"]


def test_create_celery_registers_optimize_task_with_late_ack_when_built(embedded):
    app = create_celery(embedded)
    task = app.tasks[TASK_NAME]

    assert task.acks_late is True
    assert task.reject_on_worker_lost is True
    assert task.ignore_result is True
    assert app.conf.accept_content == ["json"]


def test_create_celery_binds_task_to_its_own_app_when_several_apps_exist(embedded, distributed):
    first, second = create_celery(distributed), create_celery(embedded)

    assert first.tasks[TASK_NAME] is not second.tasks[TASK_NAME]
    assert second.tasks[TASK_NAME].app is second


def test_optimize_task_drops_message_when_job_id_is_not_a_uuid(embedded):
    task = create_celery(embedded).tasks[TASK_NAME]

    assert task.run("../../etc/passwd") is None  # returns before touching the job store
    assert task.run({"id": 1}) is None
    assert not embedded.storage.work_dir.exists()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_dispatcher_raises_broker_unavailable_fast_when_redis_is_down(tmp_path):
    settings = Settings(storage={"data_dir": tmp_path}, broker={"url": f"redis://127.0.0.1:{_closed_port()}/11"})
    with Dispatcher(settings) as dispatcher:
        started = time.monotonic()
        with pytest.raises(UnavailableError) as info:
            dispatcher.enqueue("6b1c1d52-5f2e-4a8f-9a3c-2a7f0e0d9f11", "cpu")
        assert info.value.code == "BROKER_UNAVAILABLE"
        with pytest.raises(UnavailableError):
            dispatcher.ping()
    assert time.monotonic() - started < 5


def test_dispatcher_refuses_unknown_queue_when_enqueueing(embedded):
    with Dispatcher(embedded) as dispatcher, pytest.raises(InvalidInputError):
        dispatcher.enqueue("6b1c1d52-5f2e-4a8f-9a3c-2a7f0e0d9f11", "cpuu")


_CONSUMER = """
import json, sys
from core.settings import Settings
from core.broker import create_celery
app = create_celery(Settings(storage={"data_dir": sys.argv[1]}))
got = {}
with app.connection_for_read() as conn:
    channel = conn.default_channel
    for queue in ("cpu", "gpu"):
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            got.setdefault(queue, []).append(message.headers["argsrepr"])
print(json.dumps(got))
"""


def test_filesystem_queue_delivers_per_queue_once_when_consumed_from_another_process(embedded):
    with Dispatcher(embedded) as dispatcher:
        dispatcher.ping()
        dispatcher.enqueue("11111111-1111-4111-8111-111111111111", "cpu")
        dispatcher.enqueue("22222222-2222-4222-8222-222222222222", "gpu")
        # kombu's filesystem transport names a message by the millisecond it was put, then a random uuid, and
        # reads them in name order: FIFO holds between milliseconds, not within one (CI once read 3333 first)
        time.sleep(0.005)
        dispatcher.enqueue("33333333-3333-4333-8333-333333333333", "cpu")

    def consume() -> dict[str, list[str]]:
        result = subprocess.run(
            [sys.executable, "-c", _CONSUMER, str(embedded.storage.data_dir)],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return json.loads(result.stdout)

    got = consume()
    assert [len(got.get("cpu", [])), len(got.get("gpu", []))] == [2, 1]
    assert "1111" in got["cpu"][0] and "3333" in got["cpu"][1]  # FIFO within a queue
    assert "2222" in got["gpu"][0]
    assert consume() == {}  # taken means gone: no second delivery
    assert not list(queue_dirs(embedded.storage.queue_dir)["messages"].iterdir())


def test_reconcile_once_reenqueues_stale_queued_job_when_lease_window_passed(embedded):
    store = JobStore(embedded.database_url)
    store.create_schema()
    job = store.create(
        tenant="t", model_sha256="0" * 64, model_filename="m.onnx", model_format="onnx", model_size=1,
        samples_sha256=None, config={}, queue="gpu",
    )  # fmt: skip
    messages = queue_dirs(embedded.storage.queue_dir)["messages"]
    with Dispatcher(embedded) as dispatcher:
        assert reconcile_once(store, dispatcher, embedded) == 0  # fresh: left alone

        later = datetime.now(UTC) + timedelta(seconds=3 * embedded.worker.lease_seconds)
        assert reconcile_once(store, dispatcher, embedded, now=later) == 1

    files = [p.name for p in messages.iterdir()]
    assert len(files) == 1 and files[0].endswith(".gpu.msg")
    assert job.id in (messages / files[0]).read_text()
    store.close()


def test_prune_processed_deletes_only_old_message_files_when_embedded(embedded):
    broker_celery(embedded)  # creates the queue folders
    processed = queue_dirs(embedded.storage.queue_dir)["processed"]
    old, new = processed / "1_a.cpu.msg", processed / "2_b.cpu.msg"
    old.write_text("{}")
    new.write_text("{}")
    past = time.time() - 2 * 24 * 3600
    os.utime(old, (past, past))

    assert prune_processed(embedded) == 1

    assert [p.name for p in processed.iterdir()] == [new.name]
