"""``POST /v1/jobs`` with the model alone as ``application/octet-stream`` (the fast form), live uvicorn."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import CONFIG_CAP, MODEL_CAP, Live

pytestmark = pytest.mark.integration

MODEL = (Path(__file__).parents[1] / "models" / "mlp_cleanup.onnx").read_bytes()


def _digest(data: bytes) -> str:
    return f"sha-256=:{base64.b64encode(hashlib.sha256(data).digest()).decode()}:"


def _post(api: Live, body: bytes | Iterator[bytes], **headers: str) -> httpx.Response:
    sent = {"content-type": "application/octet-stream", **{k.replace("_", "-"): v for k, v in headers.items()}}
    return api.client.post("/v1/jobs", content=body, headers=sent)


def _problem(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    assert response.json()["code"] == code
    return dict(response.json())


def test_raw_upload_queues_job_with_config_filename_and_digest_when_all_given(api: Live) -> None:
    response = _post(
        api,
        MODEL,
        onnxforge_config=json.dumps({"preset": "safe", "target": "cuda"}),
        content_disposition='attachment; filename="../x/mlp.onnx"',
        content_digest=_digest(MODEL),
    )
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["model"]["sha256"] == hashlib.sha256(MODEL).hexdigest()
    assert job["model"]["filename"] == "mlp.onnx"
    assert job["model"]["size"] == len(MODEL)
    assert api.dispatcher.enqueued[-1] == (job["id"], "gpu")
    assert api.blobs.exists(job["model"]["sha256"])
    assert api.tmp_files() == []


def test_raw_upload_queues_job_with_defaults_when_body_is_chunked_without_headers(api: Live) -> None:
    response = _post(api, iter([MODEL[:1000], MODEL[1000:]]))
    assert "content-length" not in response.request.headers
    assert response.status_code == 202, response.text
    assert response.json()["model"]["filename"] == "model"
    assert api.dispatcher.enqueued[-1][1] == "cpu"


def test_raw_upload_returns_422_and_leaves_no_file_when_digest_differs(api: Live) -> None:
    other = MODEL[:-1] + bytes([MODEL[-1] ^ 1])
    before = len(api.dispatcher.enqueued)
    body = _problem(_post(api, other, content_digest=_digest(MODEL)), 422, "DIGEST_MISMATCH")
    assert body["context"]["actual_sha256"] == hashlib.sha256(other).hexdigest()
    assert not api.blobs.exists(hashlib.sha256(other).hexdigest())
    assert api.tmp_files() == []
    assert len(api.dispatcher.enqueued) == before


@pytest.mark.parametrize("digest", ["sha-256=:bm90IGEgZGlnZXN0:", "sha-256=abc", "sha-256=:!!:"])
def test_raw_upload_returns_422_when_digest_malformed(api: Live, digest: str) -> None:
    _problem(_post(api, MODEL, content_digest=digest), 422, "DIGEST_INVALID")
    assert api.tmp_files() == []


def test_raw_upload_ignores_digests_of_other_algorithms(api: Live) -> None:
    response = _post(api, MODEL, content_digest="sha-512=:AAAA:")
    assert response.status_code == 202, response.text


@pytest.mark.parametrize("chunked", [False, True])
def test_raw_upload_returns_413_and_leaves_no_file_when_model_exceeds_cap(api: Live, chunked: bool) -> None:
    big = b"\1" * (MODEL_CAP + 1)
    before = len(api.dispatcher.enqueued)
    body = iter([big[i : i + (64 << 10)] for i in range(0, len(big), 64 << 10)]) if chunked else big
    _problem(_post(api, body), 413, "PAYLOAD_TOO_LARGE")
    assert api.tmp_files() == []
    assert len(api.dispatcher.enqueued) == before


def test_raw_upload_returns_413_when_config_header_too_large(api: Live) -> None:
    config = json.dumps({"seed": 1, "pad": "x" * CONFIG_CAP})
    body = _problem(_post(api, MODEL, onnxforge_config=config), 413, "PAYLOAD_TOO_LARGE")
    assert body["context"]["field"] == "config"
    assert api.tmp_files() == []


def test_raw_upload_returns_422_when_config_header_invalid(api: Live) -> None:
    response = _post(api, MODEL, onnxforge_config='{"preset": "nope"}')
    assert response.status_code == 422, response.text
    assert api.tmp_files() == []


def test_raw_upload_returns_422_when_body_empty_or_gzip(api: Live) -> None:
    _problem(_post(api, b""), 422, "MODEL_MISSING")
    _problem(_post(api, b"\x1f\x8b" + MODEL), 422, "MODEL_FORMAT_UNSUPPORTED")
    assert api.tmp_files() == []


def test_raw_upload_detects_zip_from_magic_bytes_when_named_zip(api: Live) -> None:
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("m.onnx", MODEL)
    response = _post(api, buffer.getvalue(), content_disposition='attachment; filename="m.zip"')
    assert response.status_code == 202, response.text
    assert response.json()["model"]["format"] == "zip"


def test_submit_answers_422_naming_query_parameters_when_options_sent_as_query(api: Live) -> None:
    # ?preset=fast used to be ignored: the job ran the default passes and said nothing
    before = api.client.get("/v1/jobs?limit=50").json()["total"]
    response = api.client.post(
        "/v1/jobs?preset=fast&target=cpu", content=MODEL, headers={"content-type": "application/octet-stream"}
    )

    problem = _problem(response, 422, "UNKNOWN_QUERY_PARAMETER")
    assert "preset, target" in problem["detail"] and "Onnxforge-Config" in problem["detail"]
    assert api.client.get("/v1/jobs?limit=50").json()["total"] == before  # no job queued
