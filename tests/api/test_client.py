"""onnxforge/client.py against a live server: retries with backoff that honour Retry-After, and one job per
submit however often it is retried (Idempotency-Key)."""

from __future__ import annotations

import hashlib
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

from app.main import create_app
from onnxforge.client import ApiError, Client
from tests.api.conftest import RecordingDispatcher, ServerThread, make_settings, serve

pytestmark = pytest.mark.integration

MODEL_BYTES = b"\x08\x07" + b"\x00" * 1000


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.onnx"
    path.write_bytes(MODEL_BYTES)
    return path


def test_client_submit_waits_retry_after_and_succeeds_when_quota_frees_up(tmp_path: Path, model: Path) -> None:
    settings = make_settings(tmp_path / "data", quotas={"max_concurrent_jobs": 1, "retry_after_seconds": 1})
    with serve(settings) as live, Client(live.base_url, max_wait=5) as client:
        first = client.submit(model)
        threading.Timer(0.3, live.store.request_cancel, args=(first["id"], None)).start()

        started = time.monotonic()
        second = client.submit(model)
        waited = time.monotonic() - started

        assert second["state"] == "queued" and second["id"] != first["id"]
        assert waited >= 1.0  # the 429's Retry-After, not an immediate retry
        assert len(live.dispatcher.enqueued) == 2


def test_client_raises_api_error_with_retry_after_when_retries_run_out(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(tmp_path / "data", quotas={"max_concurrent_jobs": 1, "retry_after_seconds": 1})
    with serve(settings) as live, Client(live.base_url, retries=1) as client:
        client.submit(model)
        sent: list[str] = []
        send = Client._send

        def counting_send(self: Client, method: str, url: str, **kwargs: Any) -> Any:
            sent.append(f"{method} {url}")
            return send(self, method, url, **kwargs)

        monkeypatch.setattr(Client, "_send", counting_send)
        started = time.monotonic()
        with pytest.raises(ApiError) as refused:
            client.submit(model)

        error = refused.value
        assert (error.status, error.code, error.retry_after) == (429, "QUOTA_CONCURRENT_JOBS", 1)
        # One retry (retries=1), after the 429's Retry-After: counted, not timed, so a loaded host cannot fail it.
        assert sent == ["POST /v1/jobs", "POST /v1/jobs"]
        assert time.monotonic() - started >= 1.0
        assert len(live.dispatcher.enqueued) == 1


def test_client_retries_until_server_answers_when_it_starts_late(tmp_path: Path, model: Path) -> None:
    server = ServerThread(create_app(make_settings(tmp_path / "data"), dispatcher=RecordingDispatcher()))
    starter = threading.Timer(0.5, server.start)  # the port refuses connections until then
    starter.start()
    try:
        with Client(f"http://127.0.0.1:{server.port}", retries=8, max_wait=1) as client:
            job = client.submit(model)
            assert client.get(job["id"])["state"] == "queued"
    finally:
        starter.join()
        server.stop()


def test_client_submit_returns_the_first_job_when_resent_with_same_idempotency_key(tmp_path: Path, model: Path) -> None:
    with serve(make_settings(tmp_path / "data")) as live, Client(live.base_url) as client:
        first = client.submit(model, idempotency_key="pipeline-run-42")
        again = client.submit(model, idempotency_key="pipeline-run-42")

        assert again["id"] == first["id"]
        assert len(live.dispatcher.enqueued) == 1


def test_client_submit_sends_the_model_as_the_body_with_its_digest_when_no_samples(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[str] = []
    real_send = Client._send

    def recording_send(self: Client, method: str, url: str, **kwargs: object) -> object:
        headers = kwargs.get("headers") or {}
        assert isinstance(headers, dict)
        sent.append(headers.get("Content-Type", "multipart"))
        return real_send(self, method, url, **kwargs)

    monkeypatch.setattr(Client, "_send", recording_send)
    samples = tmp_path / "s.npz"
    with zipfile.ZipFile(samples, "w") as archive:
        archive.writestr("x.npy", b"\x93NUMPY")
    with serve(make_settings(tmp_path / "data")) as live, Client(live.base_url) as client:
        raw = client.submit(model, config={"preset": "safe", "target": "cuda"})
        form = client.submit(model, samples=samples)

        assert sent == ["application/octet-stream", "multipart"]
        assert raw["model"]["sha256"] == form["model"]["sha256"] == hashlib.sha256(MODEL_BYTES).hexdigest()
        assert raw["model"]["filename"] == "m.onnx"
        assert [queue for _, queue in live.dispatcher.enqueued] == ["gpu", "cpu"]
        assert live.store.get(form["id"]).samples_sha256 is not None
