"""Structured logs of a live ``onnxforge serve`` (API, uvicorn, embedded Celery worker): one JSON object per
line, and the request id, job id and team on the lines of the request and the job they belong to."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import FAST_PIPELINE, Services, service_env
from tests.integration._flow import MODEL, wait

pytestmark = [pytest.mark.integration, pytest.mark.slow]


# Celery prints (not logs) one notice when a worker is told to stop; everything else must be JSON.
_CELERY_SHUTDOWN_NOTICE = "worker: Warm shutdown (MainProcess)"


def _lines(text: str) -> list[dict]:
    records = []
    for line in text.splitlines():
        if line.strip() and line.strip() != _CELERY_SHUTDOWN_NOTICE:
            records.append(json.loads(line))  # a line that is not JSON fails the test here
    return records


def test_serve_logs_json_with_request_job_and_team_on_every_line_when_log_format_json(
    services: Services, tmp_path: Path
) -> None:
    env = service_env(tmp_path / "data", log_format="json", **FAST_PIPELINE)
    api = services.serve(env, embedded=True)
    assert api.url
    request_id = f"test-{uuid.uuid4().hex}"

    with MODEL.open("rb") as model:
        response = httpx.post(
            f"{api.url}/v1/jobs",
            files={"model": ("model.onnx", model)},
            data={"config": json.dumps({"preset": "safe"})},
            headers={"X-Request-ID": request_id},
            timeout=60,
        )
    assert response.status_code == 202, response.text
    assert response.headers["X-Request-ID"] == request_id
    job_id = response.json()["id"]
    assert wait(api.url, job_id)["state"] == "succeeded"
    generated = httpx.get(f"{api.url}/healthz", timeout=10).headers["X-Request-ID"]
    services.stop(api)

    records = _lines(api.log.read_text())

    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    access = [r for r in records if r["logger"] == "uvicorn.access" and r.get("request_id") == request_id]
    assert len(access) == 1
    assert "POST /v1/jobs" in access[0]["message"]
    assert access[0]["team"] == "default"
    assert access[0]["job_id"] == job_id
    queued = [r for r in records if r["logger"] == "onnxforge.api" and "queued" in r["message"]]
    assert [(r["request_id"], r["job_id"], r["team"]) for r in queued] == [(request_id, job_id, "default")]
    # The worker's lines: its own, the runner's and Celery's while the job runs carry the job and its team.
    worker = [r for r in records if r.get("process_kind") == "worker" and r.get("job_id") == job_id]
    assert {"workers.tasks", "workers.runner"} <= {r["logger"] for r in worker}
    assert all(r.get("team") == "default" for r in worker if r["logger"] == "workers.runner")
    assert len(generated) == 32 and any(r.get("request_id") == generated for r in records)
