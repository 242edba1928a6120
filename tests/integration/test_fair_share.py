"""Fair share on a shared queue, with a real Redis broker, API and Celery worker: a team that floods the queue
does not make another team's job wait behind all of its own (core/quotas.py's per-team priority)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from core.keys import hash_key
from tests.conftest import FAST_PIPELINE, Services, service_env
from tests.integration._flow import CONFIG, MODEL

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEYS = {
    "team-a": "ofk_fair-share-team-a-0123456789abcdefghijkl",
    "team-b": "ofk_fair-share-team-b-0123456789abcdefghijkl",
}


def _submit(url: str, team: str) -> str:
    with MODEL.open("rb") as model:
        response = httpx.post(
            f"{url}/v1/jobs",
            files={"model": ("model.onnx", model)},
            data={"config": json.dumps(CONFIG)},
            headers={"Authorization": f"Bearer {KEYS[team]}"},
            timeout=60,
        )
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def test_worker_runs_another_teams_first_job_before_a_busy_teams_backlog_when_queue_is_shared(
    services: Services, tmp_path: Path, redis_url: str, redis_test_prefix: str
) -> None:
    keys = json.dumps({team: [hash_key(key)] for team, key in KEYS.items()})
    env = service_env(
        tmp_path / "data", broker_url=redis_url, key_prefix=redis_test_prefix, auth__keys=keys,
        cache__enabled="false", **FAST_PIPELINE,
    )  # fmt: skip
    api = services.serve(env, embedded=False)  # no worker yet: the backlog builds up in Redis
    assert api.url
    backlog = [_submit(api.url, "team-a") for _ in range(3)]
    other = _submit(api.url, "team-b")

    services.worker(env, queues="cpu")  # one worker, one job at a time

    def started(job_id: str, team: str) -> str:
        headers = {"Authorization": f"Bearer {KEYS[team]}"}
        deadline = time.monotonic() + 300
        while True:
            job = httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=headers, timeout=10).raise_for_status().json()
            if job["state"] in {"succeeded", "failed", "canceled"} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert job["state"] == "succeeded", job
        return str(job["started_at"])

    order = sorted([(started(j, "team-a"), "a") for j in backlog] + [(started(other, "team-b"), "b")])
    # team-a's first job was taken before team-b's arrived; team-b's then goes ahead of team-a's backlog.
    assert [team for _, team in order] == ["a", "b", "a", "a"]
