"""Webhooks: signed notices from real worker processes to a receiver on loopback, retries, and the
destination policy at submit (security.md T14).

The receiver is a small HTTP server in the test. The operator's settings allow it explicitly: host
127.0.0.1 on the allow-list, http allowed, private addresses allowed. The refusal tests use a server with
the defaults that matter (private addresses refused, https only where said).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.webhooks import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign, verify
from tests.api.conftest import make_settings, serve
from tests.conftest import FAST_PIPELINE, Services, service_env
from tests.integration._flow import CONFIG, MODEL, wait

pytestmark = pytest.mark.integration

SECRET = "whsec-test-0123456789abcdef"
MODEL_BYTES = b"\x08\x07" + b"\x00" * 1000  # the API never parses a model; refusals happen before any run


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class Receiver:
    """Records every POST. ``/ok`` answers 204; ``/flaky`` 500 twice, then 200; ``/redirect`` a 302 to /ok."""

    url: str
    requests: list[Received] = field(default_factory=list)
    flaky_failures: int = 2
    lock: threading.Lock = field(default_factory=threading.Lock)

    def for_job(self, job_id: str) -> list[Received]:
        with self.lock:
            return [r for r in self.requests if r.headers.get("x-onnxforge-delivery") == job_id]

    def wait_for(self, job_id: str, count: int, timeout: float = 60.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.for_job(job_id)
            if len(got) >= count:
                return got
            time.sleep(0.1)
        raise AssertionError(f"{len(self.for_job(job_id))} of {count} webhook requests for {job_id} arrived")


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    state: dict[str, Receiver] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            recv = state["r"]
            with recv.lock:
                recv.requests.append(
                    Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body, time.monotonic())
                )
                flaky_seen = sum(1 for r in recv.requests if r.path == "/flaky")
            if self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", "/ok")
            elif self.path == "/flaky" and flaky_seen <= recv.flaky_failures:
                self.send_response(500)
            else:
                self.send_response(204 if self.path == "/ok" else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state["r"] = Receiver(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state["r"]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``onnxforge serve`` (embedded, one worker) whose operator allows webhooks to 127.0.0.1 over http."""
    tmp = tmp_path_factory.mktemp("webhooks")
    logs = tmp / "logs"
    logs.mkdir()
    running = Services(logs)
    env = service_env(
        tmp / "data",
        webhooks__allowed_hosts='["127.0.0.1"]',
        webhooks__allow_http="true",
        webhooks__allow_private="true",
        webhooks__secrets=json.dumps({"default": SECRET}),
        webhooks__retry_base_seconds=0.3,
        webhooks__poll_seconds=0.2,
        webhooks__timeout_seconds=3,
        **FAST_PIPELINE,
    )
    try:
        api = running.serve(env, embedded=True)
        assert api.url
        yield api.url
    finally:
        running.stop_all()


def _submit(base_url: str, config: dict[str, Any]) -> httpx.Response:
    with MODEL.open("rb") as f:
        return httpx.post(
            f"{base_url}/v1/jobs",
            files={"model": (MODEL.name, f, "application/octet-stream")},
            data={"config": json.dumps(config)},
            timeout=60,
        )


def _job(base_url: str, job_id: str) -> dict[str, Any]:
    return dict(httpx.get(f"{base_url}/v1/jobs/{job_id}", timeout=10).raise_for_status().json())


def _wait_webhook(base_url: str, job_id: str, state: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _job(base_url, job_id)
        if job["webhook"] and job["webhook"]["state"] == state:
            return job
        time.sleep(0.1)
    raise AssertionError(f"webhook of {job_id} did not become {state}: {_job(base_url, job_id)['webhook']}")


@pytest.mark.slow
def test_webhook_arrives_signed_with_tenant_secret_when_job_succeeds(service: str, receiver: Receiver):
    response = _submit(service, {**CONFIG, "callback_url": f"{receiver.url}/ok"})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert response.json()["webhook"] == {"state": "pending", "attempts": 0, "last_error": None}
    assert wait(service, job_id)["state"] == "succeeded"

    (request,) = receiver.wait_for(job_id, 1)
    assert request.path == "/ok"
    assert request.headers["content-type"] == "application/json"
    timestamp = request.headers[TIMESTAMP_HEADER.lower()]
    signature = request.headers[SIGNATURE_HEADER.lower()]
    assert verify(SECRET, timestamp, request.body, signature)
    assert not verify("another-tenant-secret-000", timestamp, request.body, signature)
    assert not verify(
        SECRET, str(int(timestamp) - 3600), request.body, sign(SECRET, str(int(timestamp) - 3600), request.body)
    )
    body = json.loads(request.body)
    assert body["event"] == "job.succeeded"
    assert body["job"]["id"] == job_id
    assert body["job"]["state"] == "succeeded"
    assert body["job"]["error"] is None
    assert body["job"]["links"]["artifact"] == f"/v1/jobs/{job_id}/artifact"
    assert body["job"]["summary"]["nodes_after"] > 0

    job = _wait_webhook(service, job_id, "delivered")
    assert job["webhook"]["attempts"] == 1
    # The callback URL is the service's business: it never reaches the optimizer's report.
    report = httpx.get(f"{service}/v1/jobs/{job_id}/report", timeout=10).json()
    assert report["config"].get("callback_url") is None
    assert receiver.url not in json.dumps(report)


@pytest.mark.slow
def test_webhook_retried_with_backoff_until_delivered_when_receiver_fails_twice(service: str, receiver: Receiver):
    # Identical to the job above, so it is a cache hit: succeeded at once, and its webhook still goes out.
    response = _submit(service, {**CONFIG, "callback_url": f"{receiver.url}/flaky"})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]

    attempts = receiver.wait_for(job_id, 3)
    assert [r.path for r in attempts] == ["/flaky"] * 3
    gaps = [b.at - a.at for a, b in itertools.pairwise(attempts)]
    assert gaps[0] >= 0.25 and gaps[1] >= 0.55  # 0.3 s, then 0.6 s
    for request in attempts:
        assert verify(
            SECRET, request.headers["x-onnxforge-timestamp"], request.body, request.headers["x-onnxforge-signature"]
        )
    job = _wait_webhook(service, job_id, "delivered")
    assert job["webhook"]["attempts"] == 3
    assert job["webhook"]["last_error"] is None


@pytest.mark.slow
def test_webhook_fails_without_following_redirect_when_receiver_answers_302(service: str, receiver: Receiver):
    response = _submit(service, {**CONFIG, "callback_url": f"{receiver.url}/redirect"})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]

    job = _wait_webhook(service, job_id, "failed", timeout=90)
    assert job["webhook"]["attempts"] == 5
    assert "302" in job["webhook"]["last_error"]
    assert [r.path for r in receiver.for_job(job_id)] == ["/redirect"] * 5  # never /ok


# ------------------------------------------------------------------------------------- policy at submit


def _post(client: httpx.Client, callback_url: str) -> httpx.Response:
    config = json.dumps({"preset": "safe", "callback_url": callback_url})
    return client.post("/v1/jobs", files={"model": ("m.onnx", MODEL_BYTES)}, data={"config": config})


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """An API whose operator lists hosts but leaves allow_private off."""
    settings = make_settings(
        tmp_path_factory.mktemp("strict"),
        webhooks={
            "allowed_hosts": ["169.254.169.254", "::1", "127.0.0.1", "localhost", "::ffff:127.0.0.1", "*.example.com"],
            "allow_http": True,
            "secrets": {"default": SECRET},
        },
    )
    with serve(settings) as live:
        yield live.client


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",  # cloud metadata (link-local)
        "http://[::1]:8080/hook",
        "http://127.0.0.1:9/hook",
        "http://localhost/hook",  # a name resolving to loopback
        "http://[::ffff:127.0.0.1]/hook",  # IPv4-mapped loopback
        "https://evil.example.net/hook",  # not on the allow-list
    ],
)
def test_submit_returns_422_callback_url_not_allowed_when_destination_refused(strict: httpx.Client, url: str):
    response = _post(strict, url)
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "CALLBACK_URL_NOT_ALLOWED"
    assert strict.get("/v1/jobs").json()["total"] == 0


@pytest.mark.parametrize(
    "url",
    [
        "ftp://hooks.example.com/x",
        "https://user:pw@hooks.example.com/x",
        "https:///nohost",
        "https://h.example.com:99999/",
    ],
)
def test_submit_returns_422_callback_url_invalid_when_url_unusable(strict: httpx.Client, url: str):
    response = _post(strict, url)
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "CALLBACK_URL_INVALID"


def test_submit_returns_422_when_http_callback_and_operator_requires_https(tmp_path: Path):
    settings = make_settings(
        tmp_path / "data", webhooks={"allowed_hosts": ["hooks.example.com"], "secrets": {"default": SECRET}}
    )
    with serve(settings) as live:
        response = _post(live.client, "http://hooks.example.com/hook")
        assert response.status_code == 422
        assert response.json()["code"] == "CALLBACK_URL_NOT_ALLOWED"
        assert "https" in response.json()["detail"]


def test_submit_returns_422_when_tenant_has_no_webhook_secret(tmp_path: Path):
    settings = make_settings(
        tmp_path / "data",
        webhooks={"allowed_hosts": ["127.0.0.1"], "allow_http": True, "allow_private": True},
    )
    with serve(settings) as live:
        response = _post(live.client, "http://127.0.0.1:9/hook")
        assert response.status_code == 422
        assert response.json()["code"] == "CALLBACK_URL_NOT_ALLOWED"
        assert "secret" in response.json()["detail"]


def test_submit_returns_422_when_webhooks_not_configured(tmp_path: Path):
    with serve(make_settings(tmp_path / "data")) as live:
        response = _post(live.client, "https://hooks.example.com/hook")
        assert response.status_code == 422
        assert response.json()["code"] == "CALLBACK_URL_NOT_ALLOWED"
