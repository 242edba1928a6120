"""``GET /metrics`` against live services: jobs by state, queue depth, durations and upload bytes move as
jobs are submitted and run (embedded filesystem queue and Redis), and the allow-list and switch hold."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import make_settings, serve
from tests.conftest import FAST_PIPELINE, Services, service_env
from tests.integration._flow import MODEL, submit, wait

pytestmark = pytest.mark.integration


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    response = httpx.get(f"{base_url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.slow
def test_metrics_count_jobs_queue_depth_and_upload_bytes_when_jobs_queue_then_run_embedded(
    services: Services, tmp_path: Path
):
    # No embedded workers: the jobs wait in the filesystem queue until the worker below starts.
    env = service_env(tmp_path / "data", worker__embedded_workers=0, **FAST_PIPELINE)
    api = services.serve(env, embedded=True)
    assert api.url
    before = scrape(api.url)
    assert value(before, "onnxforge_jobs", queue="cpu", state="queued") == 0
    assert value(before, "onnxforge_queue_depth", queue="cpu") == 0
    assert value(before, "onnxforge_upload_bytes_total", field="model") == 0

    jobs = [submit(api.url, config={"preset": "safe", "rollback_slower": False, "seed": i}) for i in range(2)]

    queued = scrape(api.url)
    assert value(queued, "onnxforge_jobs", queue="cpu", state="queued") == 2
    assert value(queued, "onnxforge_queue_depth", queue="cpu") == 2
    assert value(queued, "onnxforge_queue_depth", queue="gpu") == 0
    assert value(queued, "onnxforge_upload_bytes_total", field="model") == 2 * MODEL.stat().st_size
    assert value(queued, "onnxforge_cache_lookups_total", result="miss") == 2

    services.worker(env)
    for job in jobs:
        assert wait(api.url, job["id"])["state"] == "succeeded"

    done = scrape(api.url)
    assert value(done, "onnxforge_jobs", queue="cpu", state="queued") == 0
    assert value(done, "onnxforge_jobs", queue="cpu", state="succeeded") == 2
    assert value(done, "onnxforge_queue_depth", queue="cpu") == 0
    assert value(done, "onnxforge_job_duration_seconds_gcount", queue="cpu", state="succeeded") == 2
    assert value(done, "onnxforge_job_duration_seconds_bucket", queue="cpu", state="succeeded", le="+Inf") == 2
    assert value(done, "onnxforge_job_duration_seconds_gsum", queue="cpu", state="succeeded") > 0
    # Every pass of the safe preset ran in both jobs.
    assert value(done, "onnxforge_pass_duration_seconds_gcount", **{"pass": "shape_inference"}) == 2


@pytest.mark.slow
def test_metrics_queue_depth_reads_redis_list_when_distributed(
    services: Services, tmp_path: Path, redis_broker: dict[str, str]
):
    env = service_env(tmp_path / "data", **redis_broker)
    api = services.serve(env, embedded=False)  # no worker: the message stays in Redis
    assert api.url
    before = value(scrape(api.url), "onnxforge_queue_depth", queue="cpu")

    submit(api.url)
    submit(api.url, config={"preset": "safe", "target": "cuda"})

    after = scrape(api.url)
    assert value(after, "onnxforge_queue_depth", queue="cpu") == before + 1
    assert value(after, "onnxforge_queue_depth", queue="gpu") >= 1
    assert value(after, "onnxforge_jobs", queue="gpu", state="queued") == 1


def test_metrics_returns_403_when_client_not_in_allow_from(tmp_path: Path):
    settings = make_settings(tmp_path / "data", metrics={"allow_from": ["10.0.0.0/8"]})
    with serve(settings) as live:
        response = live.client.get("/metrics")
        assert response.status_code == 403
        assert response.json()["code"] == "METRICS_FORBIDDEN"


def test_metrics_served_to_loopback_when_allow_from_names_it(tmp_path: Path):
    settings = make_settings(tmp_path / "data", metrics={"allow_from": ["127.0.0.0/8", "::1"]})
    with serve(settings) as live:
        response = live.client.get("/metrics")
        assert response.status_code == 200
        assert "onnxforge_jobs" in response.text


def test_metrics_not_served_when_disabled(tmp_path: Path):
    with serve(make_settings(tmp_path / "data", metrics={"enabled": False})) as live:
        assert live.client.get("/metrics").status_code == 404
