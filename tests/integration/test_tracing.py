"""OpenTelemetry traces across a live ``onnxforge serve`` and its embedded Celery worker (a real worker
process, prefork): the job's worker span is a descendant of the API request span, in the same trace.

Both processes append their spans to one file (``tracing.exporter=file``), which the test reads back: the
SDK's in-memory exporter cannot see another process's spans.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import FAST_PIPELINE, Services, service_env
from tests.integration._flow import MODEL, wait

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ancestors(span: dict, by_id: dict[str, dict]) -> list[dict]:
    chain = []
    parent = span.get("parent_id")
    while parent is not None and parent in by_id:
        chain.append(by_id[parent])
        parent = by_id[parent].get("parent_id")
    return chain


def test_worker_span_is_a_child_of_the_api_request_span_when_tracing_enabled(
    services: Services, tmp_path: Path
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    env = service_env(
        tmp_path / "data", tracing__enabled="true", tracing__exporter="file", tracing__file=spans_file, **FAST_PIPELINE
    )
    api = services.serve(env, embedded=True)
    with MODEL.open("rb") as model:
        response = httpx.post(
            f"{api.url}/v1/jobs",
            files={"model": ("model.onnx", model)},
            data={"config": '{"preset": "safe"}'},
            timeout=60,
        )
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    job = wait(api.url, job_id)
    assert job["state"] == "succeeded", job.get("error")
    services.stop(api)

    spans = _spans(spans_file)
    by_id = {s["context"]["span_id"]: s for s in spans}
    request = [s for s in spans if s["kind"] == "SpanKind.SERVER" and s["name"] == "POST /v1/jobs"]
    assert len(request) == 1, [s["name"] for s in spans]
    assert request[0]["attributes"]["onnxforge.job_id"] == job_id
    assert request[0]["resource"]["attributes"]["service.name"] == "onnxforge-api"
    runs = [s for s in spans if s["name"] == "run/onnxforge.optimize"]
    assert len(runs) == 1, [s["name"] for s in spans]
    run = runs[0]
    assert run["resource"]["attributes"]["service.name"] == "onnxforge-worker"
    assert run["attributes"]["onnxforge.job_id"] == job_id
    assert run["context"]["trace_id"] == request[0]["context"]["trace_id"]
    chain = _ancestors(run, by_id)
    assert request[0] in chain, [s["name"] for s in chain]
    assert chain[0]["name"] == "apply_async/onnxforge.optimize"  # the publish span, in the API process
    assert chain[0]["resource"]["attributes"]["service.name"] == "onnxforge-api"


def test_api_and_worker_load_no_opentelemetry_sdk_when_tracing_disabled() -> None:
    """FastAPI itself imports opentelemetry-api (its own hooks); the SDK, the instrumentations and the
    exporter are ours to load, only when tracing is on."""
    code = (
        "import sys; from app.main import create_app; from core.settings import Settings; "
        "from workers.celery_app import create_celery; create_app(Settings()); create_celery(Settings()); "
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'opentelemetry.instrumentation', 'opentelemetry.exporter'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]"
