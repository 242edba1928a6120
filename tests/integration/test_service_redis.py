"""Distributed mode: a real uvicorn API, a real ``onnxforge worker`` (Celery, prefork) and real Redis.

Redis db 11 with a key prefix unique to the session; the job store is SQLite or PostgreSQL.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from pathlib import Path

import httpx
import pytest
from kombu import Producer

from core.broker import EXCHANGE, TASK_NAME, create_celery
from core.settings import Settings
from tests.conftest import FAST_PIPELINE, Services, service_env
from tests.integration._flow import MODEL, check_job_flow, submit, wait
from workers.child import FAULT_ENV

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_service_optimizes_model_when_distributed_over_redis(
    services: Services,
    tmp_path: Path,
    redis_broker: dict[str, str],
    request: pytest.FixtureRequest,
    database: str,
):
    db: dict[str, str] = {}
    if database == "postgresql":
        url, schema = request.getfixturevalue("postgres_url")
        db = {"database_url": url, "schema": schema}
    env = service_env(tmp_path / "data", **redis_broker, **db, **FAST_PIPELINE)

    api = services.serve(env, embedded=False)
    services.worker(env)

    assert api.url
    check_job_flow(api.url, tmp_path)
    assert " ready." not in api.log_tail(50000)  # distributed serve starts no worker of its own


def test_worker_refuses_pickle_message_and_keeps_running_when_sent_one(
    services: Services, tmp_path: Path, redis_url: str, redis_prefix: str
):
    env = service_env(tmp_path / "data", broker_url=redis_url, key_prefix=redis_prefix)
    worker = services.worker(env, queues="cpu")
    settings = Settings(storage={"data_dir": tmp_path / "data"}, broker={"url": redis_url, "key_prefix": redis_prefix})
    app = create_celery(settings)

    with app.connection_for_write() as conn:
        Producer(conn.default_channel).publish(
            {"job": "x"},  # would be args under pickle; Celery must not even decode it
            exchange=EXCHANGE,
            routing_key="cpu",
            serializer="pickle",
            headers={"task": TASK_NAME, "id": str(uuid.uuid4()), "lang": "py"},
            declare=[],
        )

    deadline = time.monotonic() + 20
    while "untrusted content" not in worker.log_tail(20000):
        assert time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.2)
    assert worker.proc.poll() is None
    app.close()


def test_job_succeeds_on_second_attempt_when_worker_is_killed_mid_job(
    services: Services, tmp_path: Path, redis_broker: dict[str, str]
):
    # Short lease and reconcile interval so recovery takes seconds; the child sleeps 2 s before the pipeline
    # (test-only fault hook) so the kill lands mid-job.
    env = service_env(
        tmp_path / "data", **redis_broker, **FAST_PIPELINE,
        worker__lease_seconds=5, worker__reconcile_interval_seconds=1,
    )  # fmt: skip
    env[FAULT_ENV] = "sleep:2"
    api = services.serve(env, embedded=False)
    first = services.worker(env)
    assert api.url
    job = submit(api.url)
    deadline = time.monotonic() + 30
    while httpx.get(f"{api.url}/v1/jobs/{job['id']}", timeout=10).json()["stage"] != "fault-injection":
        assert time.monotonic() < deadline
        time.sleep(0.1)

    os.killpg(first.proc.pid, signal.SIGKILL)  # worker main process and its pool, mid-job
    first.proc.wait(10)
    services.worker(env)

    finished = wait(api.url, job["id"], timeout=90)
    assert finished["state"] == "succeeded", finished.get("error")
    assert finished["attempts"] == 2


def test_api_answers_503_broker_unavailable_fast_when_redis_is_down(services: Services, tmp_path: Path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/11"
    api = services.serve(service_env(tmp_path / "data", broker_url=dead), embedded=False)
    assert api.url

    started = time.monotonic()
    with MODEL.open("rb") as f:
        response = httpx.post(f"{api.url}/v1/jobs", files={"model": (MODEL.name, f)}, timeout=30)

    assert response.status_code == 503, response.text
    assert response.json()["code"] == "BROKER_UNAVAILABLE"
    assert time.monotonic() - started < 5
    jobs = httpx.get(f"{api.url}/v1/jobs", timeout=10).json()
    assert jobs["total"] == 0  # nothing half-submitted
    ready = httpx.get(f"{api.url}/readyz", timeout=10)
    assert ready.status_code == 503
