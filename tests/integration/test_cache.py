"""The result cache against ``onnxforge serve`` (embedded: SQLite, filesystem queue, real worker processes).

Two tenants with API keys. A second identical submission of a tenant is answered from the cache at once
(succeeded, ``cached_from``, ``summary.cached``, the same artifact bytes, nothing run); another config, the
other tenant (``cache.cross_tenant`` off) or ``use_cache: false`` run afresh. With ``cross_tenant`` on, the
other tenant gets the result too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.keys import hash_key
from tests.conftest import FAST_PIPELINE, Services, service_env
from tests.integration._flow import CONFIG, MODEL

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEY_A = "ofk_cache-team-a-0123456789abcdefghijklmnopqrstuv"
KEY_B = "ofk_cache-team-b-0123456789abcdefghijklmnopqrstuv"


def _client(base_url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _submit(client: httpx.Client, config: dict[str, Any] | None = None) -> dict[str, Any]:
    with MODEL.open("rb") as f:
        response = client.post(
            "/v1/jobs",
            files={"model": (MODEL.name, f, "application/octet-stream")},
            data={"config": json.dumps(config or CONFIG)},
        )
    assert response.status_code == 202, response.text
    assert response.headers["location"] == f"/v1/jobs/{response.json()['id']}"
    return dict(response.json())


def _wait(client: httpx.Client, job_id: str, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
        if job["state"] in {"succeeded", "failed", "canceled"}:
            return dict(job)
        time.sleep(0.25)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s")


def test_cache_answers_identical_submission_at_once_and_misses_when_config_or_tenant_differs(
    services: Services, tmp_path: Path
):
    env = service_env(
        tmp_path / "data",
        auth__keys=json.dumps({"team-a": [hash_key(KEY_A)], "team-b": [hash_key(KEY_B)]}),
        **FAST_PIPELINE,
    )
    api = services.serve(env, embedded=True)
    assert api.url
    with _client(api.url, KEY_A) as team_a, _client(api.url, KEY_B) as team_b:
        first = _wait(team_a, _submit(team_a)["id"])
        assert first["state"] == "succeeded", first.get("error")
        assert first["cached_from"] is None
        assert first["hardware_class"].startswith("cpu:")
        assert "cached" not in first["summary"]
        artifact = team_a.get(f"/v1/jobs/{first['id']}/artifact").raise_for_status().content

        # Same bytes, same config: answered from the cache, already succeeded in the submission's answer.
        hit = _submit(team_a)
        assert hit["state"] == "succeeded"
        assert hit["id"] != first["id"]
        assert hit["cached_from"] == first["id"]
        assert hit["summary"]["cached"] is True
        assert hit["summary"]["speedup"] == first["summary"]["speedup"]
        assert hit["attempts"] == 0
        assert hit["hardware_class"] == first["hardware_class"]
        assert team_a.get(f"/v1/jobs/{hit['id']}/artifact").raise_for_status().content == artifact
        report = team_a.get(f"/v1/jobs/{hit['id']}/report").raise_for_status().json()
        assert report["job_id"] == first["id"]  # the earlier job's report, as promised

        # Defaults spelled out and service-only fields do not change the effective configuration.
        spelled = _submit(team_a, {**CONFIG, "seed": 0, "target": "cpu", "callback_url": None})
        assert spelled["cached_from"] == first["id"]

        # Another effective configuration, the other tenant, or use_cache=false: a real job.
        other_config = _submit(team_a, {**CONFIG, "seed": 1})
        other_tenant = _submit(team_b)
        bypass = _submit(team_a, {**CONFIG, "use_cache": False})
        for job in (other_config, other_tenant, bypass):
            assert job["state"] == "queued"
            assert job["cached_from"] is None
        # The bypassing job still runs and succeeds; it does not come from the cache.
        assert _wait(team_a, bypass["id"])["cached_from"] is None
        # Let the other real jobs finish too, so that stopping the service below interrupts none of them.
        _wait(team_a, other_config["id"])
        _wait(team_b, other_tenant["id"])

        metrics = httpx.get(f"{api.url}/metrics", timeout=10).text
        assert "onnxforge_cache_hits_total 2.0" in metrics
        assert 'onnxforge_cache_lookups_total{result="hit"} 2.0' in metrics

    # The operator allows sharing across tenants: team-b now gets team-a's result (same data directory).
    services.stop_all()
    shared = services.serve({**env, "ONNXFORGE_CACHE__CROSS_TENANT": "true"}, embedded=True)
    assert shared.url
    with _client(shared.url, KEY_B) as team_b:
        across = _submit(team_b)
        assert across["state"] == "succeeded"
        assert across["cached_from"] == bypass["id"]  # the newest of team-a's runs
        assert across["summary"]["cached"] is True
