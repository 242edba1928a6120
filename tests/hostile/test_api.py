"""Upload-side hostile inputs against the live API (security.md T12, T14); tests/api/test_jobs.py already
covers the size caps (with and without Content-Length, chunked) and a client that disconnects mid-upload."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.api.conftest import Live
from tests.hostile.fixtures import SEED_MODEL

pytestmark = pytest.mark.integration

BOUNDARY = "hostile-boundary"


def _problem(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    if code is not None:
        assert body["code"] == code, body
    return body


def _fields(names: list[str], payload: bytes = b"") -> Iterator[bytes]:
    """A multipart body as a generator: httpx sends it chunked, so no Content-Length check stops it early
    and the parser itself has to refuse it."""
    for name in names:
        yield f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + payload + b"\r\n"
    yield f"--{BOUNDARY}--\r\n".encode()


@pytest.mark.parametrize(
    "content_type",
    [
        "multipart/form-data",  # no boundary
        'multipart/form-data; boundary="' + "\\" * 4000,  # CVE-2024-24762-style backtracking bait
        "multipart/form-data; boundary=" + ";a=b" * 2000,
        'application/x-www-form-urlencoded; !="\\' * 300,
        "text/plain",
    ],
)
def test_create_job_refuses_evil_content_type_quickly(api: Live, content_type: str) -> None:
    started = time.monotonic()
    response = api.client.post("/v1/jobs", content=b"x" * 1024, headers={"content-type": content_type})
    assert 400 <= response.status_code < 500, response.text
    # Catastrophic backtracking takes minutes on these headers; 10 s still tells it apart on a loaded machine.
    assert time.monotonic() - started < 10.0
    assert api.tmp_files() == []
    assert api.dispatcher.enqueued == []


@pytest.mark.parametrize("name", ["", "f0"])
def test_create_job_refuses_ten_thousand_empty_fields_at_the_first(api: Live, name: str) -> None:
    body = _fields([name] * 10_000)
    started = time.monotonic()
    response = api.client.post(
        "/v1/jobs", content=body, headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    )
    _problem(response, 422, "UNKNOWN_FIELD")
    # Catastrophic backtracking takes minutes on these headers; 10 s still tells it apart on a loaded machine.
    assert time.monotonic() - started < 10.0
    assert api.tmp_files() == []


def test_create_job_refuses_repeated_config_field(api: Live) -> None:
    body = _fields(["config"] * 10_000, b"{}")
    response = api.client.post(
        "/v1/jobs", content=body, headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    )
    _problem(response, 422, "DUPLICATE_FIELD")


def test_create_job_has_no_url_fetch_field(api: Live) -> None:
    """T14 (SSRF): the service fetches nothing; a model_url field is refused before any of it is read."""
    response = api.client.post(
        "/v1/jobs",
        data={"model_url": "http://169.254.169.254/latest/meta-data/"},
        files={"model": ("m.onnx", SEED_MODEL.read_bytes())},
    )
    body = _problem(response, 422, "UNKNOWN_FIELD")
    assert "model_url" in body["detail"]
    assert api.dispatcher.enqueued == []
    assert api.tmp_files() == []
