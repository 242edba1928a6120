"""/v1/jobs against a live uvicorn server: submit, read, list, cancel, downloads, error documents."""

from __future__ import annotations

import hashlib
import io
import json
import socket
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from core.errors import NotFoundError
from tests.api.conftest import CONFIG_CAP, MODEL_CAP, Live

pytestmark = pytest.mark.integration

MODEL_PATH = Path(__file__).parents[1] / "models" / "mlp_cleanup.onnx"
BOUNDARY = "onnxforge-test-boundary"


def _model() -> bytes:
    return MODEL_PATH.read_bytes()


def _submit(api: Live, config: dict | str | None = None, **files: tuple[str, bytes]) -> httpx.Response:
    data = {}
    if config is not None:
        data["config"] = config if isinstance(config, str) else json.dumps(config)
    files = files or {"model": ("mlp_cleanup.onnx", _model())}
    return api.client.post("/v1/jobs", data=data, files=files)


def _assert_problem(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["status"] == status
    assert body["code"] == code
    assert {"type", "title", "detail"} <= body.keys()
    return body


def _multipart_chunks(parts: list[tuple[str, str, bytes]], chunk: int = 16 << 10) -> Iterator[bytes]:
    """A multipart body as a generator, so httpx sends it chunked, without Content-Length."""
    for name, filename, payload in parts:
        yield (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        for start in range(0, len(payload), chunk):
            yield payload[start : start + chunk]
        yield b"\r\n"
    yield f"--{BOUNDARY}--\r\n".encode()


def _npz() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("x.npy", b"\x93NUMPY fake")
    return buffer.getvalue()


def test_create_job_returns_202_with_location_and_enqueues_on_cpu(api: Live) -> None:
    response = _submit(api, {"preset": "safe"})
    assert response.status_code == 202, response.text
    job = response.json()
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["state"] == "queued"
    assert job["queue"] == "cpu"
    assert job["model"] == {
        "sha256": hashlib.sha256(_model()).hexdigest(),
        "filename": "mlp_cleanup.onnx",
        "size": len(_model()),
        "format": "onnx",
    }
    assert job["config"]["preset"] == "safe"
    assert job["links"]["self"] == f"/v1/jobs/{job['id']}"
    assert job["links"]["artifact"] is None
    assert api.dispatcher.enqueued == [(job["id"], "cpu")]
    assert api.blobs.path(job["model"]["sha256"]).read_bytes() == _model()
    assert api.tmp_files() == []


@pytest.mark.parametrize("target", ["cuda", "tensorrt"])
def test_create_job_enqueues_on_gpu_when_target_is_gpu(api: Live, target: str) -> None:
    response = _submit(api, {"target": target})
    assert response.status_code == 202, response.text
    assert api.dispatcher.enqueued == [(response.json()["id"], "gpu")]


def test_create_job_stores_samples_when_npz_given(api: Live) -> None:
    samples = _npz()
    response = _submit(api, model=("m.onnx", _model()), samples=("s.npz", samples))
    assert response.status_code == 202, response.text
    assert response.json()["samples_sha256"] == hashlib.sha256(samples).hexdigest()


def test_create_job_detects_zip_archive_from_magic_bytes(api: Live) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("model.onnx", _model())
    response = _submit(api, model=("bundle.zip", buffer.getvalue()))
    assert response.status_code == 202, response.text
    assert response.json()["model"]["format"] == "zip"


def test_create_job_returns_422_when_suffix_contradicts_content(api: Live) -> None:
    body = _assert_problem(_submit(api, model=("model.zip", _model())), 422, "MODEL_FORMAT_MISMATCH")
    assert "zip" in body["detail"]
    assert api.tmp_files() == []


def test_create_job_keeps_client_filename_as_metadata_only(api: Live) -> None:
    response = _submit(api, model=("../../etc/evil.onnx", _model()))
    assert response.status_code == 202, response.text
    assert response.json()["model"]["filename"] == "evil.onnx"


def test_create_job_returns_413_and_leaves_no_file_when_content_length_too_large(api: Live) -> None:
    response = _submit(api, model=("big.onnx", b"\0" * (MODEL_CAP * 2)))
    body = _assert_problem(response, 413, "PAYLOAD_TOO_LARGE")
    assert "limit" in body["detail"]
    assert api.tmp_files() == []
    assert api.dispatcher.enqueued == []


def test_create_job_returns_413_and_leaves_no_file_when_model_part_exceeds_cap(api: Live) -> None:
    # Content-Length is within the body cap; the model part alone is over its cap.
    response = _submit(api, model=("big.onnx", b"\0" * (MODEL_CAP + 1)))
    body = _assert_problem(response, 413, "PAYLOAD_TOO_LARGE")
    assert body["context"]["field"] == "model"
    assert api.tmp_files() == []
    assert api.dispatcher.enqueued == []


def test_create_job_returns_413_and_leaves_no_file_when_chunked_upload_too_large(api: Live) -> None:
    response = api.client.post(
        "/v1/jobs",
        content=_multipart_chunks([("model", "big.onnx", b"\1" * (MODEL_CAP * 3))]),
        headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"},
    )
    assert "content-length" not in response.request.headers
    _assert_problem(response, 413, "PAYLOAD_TOO_LARGE")
    assert api.tmp_files() == []
    assert api.dispatcher.enqueued == []


def test_create_job_accepts_chunked_upload_within_cap(api: Live) -> None:
    response = api.client.post(
        "/v1/jobs",
        content=_multipart_chunks([("model", "m.onnx", _model())]),
        headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"},
    )
    assert response.status_code == 202, response.text
    assert response.json()["model"]["sha256"] == hashlib.sha256(_model()).hexdigest()


def test_create_job_returns_413_when_config_too_large(api: Live) -> None:
    response = _submit(api, json.dumps({"seed": 1, "pad": "x" * CONFIG_CAP}))
    body = _assert_problem(response, 413, "PAYLOAD_TOO_LARGE")
    assert body["context"]["field"] == "config"


def test_create_job_returns_422_naming_field_when_config_invalid(api: Live) -> None:
    body = _assert_problem(_submit(api, {"target": "tpu"}), 422, "INVALID_CONFIG")
    assert "target" in body["detail"]
    body = _assert_problem(_submit(api, "{not json"), 422, "INVALID_CONFIG")
    assert api.dispatcher.enqueued == []
    assert api.tmp_files() == []


def test_create_job_returns_422_with_close_match_when_pass_unknown(api: Live) -> None:
    body = _assert_problem(_submit(api, {"passes": ["constant_foldin"]}), 422, "UNKNOWN_PASS")
    assert "constant_folding" in body["detail"]
    assert body["context"]["close_matches"][0] == "constant_folding"
    assert api.dispatcher.enqueued == []


def test_create_job_returns_422_when_preset_unknown(api: Live) -> None:
    body = _assert_problem(_submit(api, {"preset": "saf"}), 422, "UNKNOWN_PRESET")
    assert "safe" in body["detail"]


def test_create_job_returns_422_when_pass_option_unknown(api: Live) -> None:
    response = _submit(api, {"passes": [{"name": "constant_folding", "options": {"no_such_option": 1}}]})
    body = _assert_problem(response, 422, "INVALID_PASS_OPTIONS")
    assert "no_such_option" in body["detail"]


def test_create_job_returns_422_when_field_unknown(api: Live) -> None:
    response = api.client.post("/v1/jobs", files={"model": ("m.onnx", _model()), "weights": ("w.bin", b"123")})
    body = _assert_problem(response, 422, "UNKNOWN_FIELD")
    assert "weights" in body["detail"]
    assert api.tmp_files() == []


def test_create_job_returns_422_when_model_missing(api: Live) -> None:
    response = api.client.post("/v1/jobs", data={"config": "{}"}, files={"samples": ("s.npz", _npz())})
    _assert_problem(response, 422, "MODEL_MISSING")
    assert api.tmp_files() == []


def test_create_job_returns_422_when_samples_not_npz(api: Live) -> None:
    response = _submit(api, model=("m.onnx", _model()), samples=("s.npz", b"not a zip"))
    _assert_problem(response, 422, "SAMPLES_INVALID")


def test_create_job_returns_422_when_body_neither_multipart_nor_raw(api: Live) -> None:
    response = api.client.post("/v1/jobs", content=_model(), headers={"content-type": "text/plain"})
    _assert_problem(response, 422, "MULTIPART_REQUIRED")


def test_create_job_returns_503_and_keeps_no_job_when_broker_down(api: Live) -> None:
    before = api.client.get("/v1/jobs").json()["total"]
    api.dispatcher.down = True
    response = _submit(api)
    _assert_problem(response, 503, "BROKER_UNAVAILABLE")
    assert int(response.headers["retry-after"]) > 0
    assert api.client.get("/v1/jobs").json()["total"] == before
    assert api.store.list(None, limit=1000, offset=0)[1] == before


def test_get_job_returns_job_when_known(api: Live) -> None:
    created = _submit(api).json()
    response = api.client.get(f"/v1/jobs/{created['id']}")
    assert response.status_code == 200
    job = response.json()
    assert job["id"] == created["id"]
    assert job["state"] == "queued"
    assert job["error"] is None
    assert job["durations"] == {"queued_seconds": None, "run_seconds": None, "total_seconds": None}


@pytest.mark.parametrize(
    ("job_id", "code"),
    [
        (str(uuid.uuid4()), "JOB_NOT_FOUND"),
        ("not-a-uuid", "JOB_NOT_FOUND"),
        ("%2e%2e", "JOB_NOT_FOUND"),
        ("%2e%2e%2f%2e%2e%2fetc", "NOT_FOUND"),  # decodes to another path: no route, still a problem
    ],
)
def test_get_job_returns_404_problem_when_unknown(api: Live, job_id: str, code: str) -> None:
    body = _assert_problem(api.client.get(f"/v1/jobs/{job_id}"), 404, code)
    assert body["title"] == "Not Found"


def test_get_job_returns_404_when_job_belongs_to_another_tenant(api: Live) -> None:
    other = api.store.create(
        tenant="someone-else",
        model_sha256="a" * 64,
        model_filename="m.onnx",
        model_format="onnx",
        model_size=1,
        samples_sha256=None,
        config={},
        queue="cpu",
    )
    _assert_problem(api.client.get(f"/v1/jobs/{other.id}"), 404, "JOB_NOT_FOUND")
    _assert_problem(api.client.delete(f"/v1/jobs/{other.id}"), 404, "JOB_NOT_FOUND")
    assert other.id not in {j["id"] for j in api.client.get("/v1/jobs?limit=50").json()["jobs"]}


def test_get_job_shows_error_when_job_failed(api: Live) -> None:
    job_id = _submit(api).json()["id"]
    api.store.fail(job_id, None, code="VERIFICATION_FAILED", message="outputs differ", pass_name="fuse_gelu")
    job = api.client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "failed"
    assert job["error"] == {"code": "VERIFICATION_FAILED", "message": "outputs differ", "pass": "fuse_gelu"}


def test_list_jobs_pages_newest_first_with_next_link(api: Live) -> None:
    ids = [_submit(api).json()["id"] for _ in range(3)]
    first = api.client.get("/v1/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in first["jobs"]] == ids[::-1][:2]
    assert first["total"] >= 3
    assert first["next"] == "/v1/jobs?limit=2&offset=2"
    second = api.client.get(first["next"]).json()
    assert second["jobs"][0]["id"] == ids[0]
    last = api.client.get("/v1/jobs", params={"limit": 2, "offset": first["total"] - 1}).json()
    assert len(last["jobs"]) == 1
    assert last["next"] is None


def test_list_jobs_filters_by_state(api: Live) -> None:
    job_id = _submit(api).json()["id"]
    api.client.post(f"/v1/jobs/{job_id}/cancel")
    canceled = api.client.get("/v1/jobs", params={"state": "canceled", "limit": 50}).json()
    assert job_id in {j["id"] for j in canceled["jobs"]}
    assert {j["state"] for j in canceled["jobs"]} == {"canceled"}


@pytest.mark.parametrize("query", [{"limit": 0}, {"limit": 51}, {"offset": -1}, {"state": "bogus"}])
def test_list_jobs_returns_422_when_query_invalid(api: Live, query: dict) -> None:
    body = api.client.get("/v1/jobs", params=query).json()
    assert body["status"] == 422
    assert body["code"] in {"REQUEST_INVALID", "PAGINATION_INVALID"}


def test_cancel_job_cancels_queued_job_then_returns_409_when_finished(api: Live) -> None:
    job_id = _submit(api).json()["id"]
    response = api.client.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code == 202
    assert response.json()["state"] == "canceled"
    _assert_problem(api.client.post(f"/v1/jobs/{job_id}/cancel"), 409, "JOB_FINISHED")
    assert api.client.get(f"/v1/jobs/{job_id}").json()["state"] == "canceled"  # canceled, not deleted


def test_delete_job_removes_queued_job_and_its_upload_when_no_other_job_uses_it(api: Live) -> None:
    own = b"\x08\x07" + uuid.uuid4().bytes * 64  # bytes no other test uploads
    job = _submit(api, model=("own.onnx", own)).json()
    shared = _submit(api).json()
    path = api.blobs.path(job["model"]["sha256"])
    shared_path = api.blobs.path(shared["model"]["sha256"])

    response = api.client.delete(f"/v1/jobs/{job['id']}")

    assert response.status_code == 204
    assert not path.exists()
    _assert_problem(api.client.get(f"/v1/jobs/{job['id']}"), 404, "JOB_NOT_FOUND")
    _assert_problem(api.client.delete(f"/v1/jobs/{job['id']}"), 404, "JOB_NOT_FOUND")
    # Deleting another job with the same model as a live one keeps the file the live one needs.
    twin = _submit(api).json()
    assert api.client.delete(f"/v1/jobs/{twin['id']}").status_code == 204
    assert shared_path.exists()
    assert api.client.get(f"/v1/jobs/{shared['id']}").status_code == 200


def test_delete_job_cancels_running_job_and_removes_it_when_worker_stops(api: Live) -> None:
    job_id = _submit(api).json()["id"]
    claimed = api.store.claim(job_id, "test-worker", 60, max_attempts=3)
    assert claimed is not None

    response = api.client.delete(f"/v1/jobs/{job_id}")

    assert response.status_code == 202
    assert (response.json()["state"], response.json()["cancel_requested"]) == ("running", True)
    _assert_problem(api.client.get(f"/v1/jobs/{job_id}"), 404, "JOB_NOT_FOUND")
    assert job_id not in {j["id"] for j in api.client.get("/v1/jobs", params={"limit": 50}).json()["jobs"]}
    # The worker sees the cancel at its next heartbeat and stops: the row goes with it.
    assert api.store.mark_canceled(job_id, claimed.attempts)
    with pytest.raises(NotFoundError):
        api.store.get(job_id)


def test_artifact_returns_409_when_job_not_succeeded(api: Live) -> None:
    job_id = _submit(api).json()["id"]
    for suffix in ("artifact", "report", "report.html"):
        body = _assert_problem(api.client.get(f"/v1/jobs/{job_id}/{suffix}"), 409, "JOB_NOT_SUCCEEDED")
        assert body["context"]["state"] == "queued"


def test_results_are_served_when_job_succeeded(api: Live) -> None:
    job_id = _submit(api, model=("my model.onnx", _model())).json()["id"]
    job = api.store.claim(job_id, "test-worker", 60, max_attempts=3)
    assert job is not None
    artifact = b"optimized-model-bytes"
    report = {"job": job_id, "passes": []}
    html = b"<!doctype html><title>report</title><p>ok</p>"
    assert api.store.succeed(
        job_id,
        job.attempts,
        artifact_sha256=api.blobs.put_bytes(artifact),
        artifact_format="onnx",
        report_sha256=api.blobs.put_bytes(json.dumps(report).encode()),
        report_html_sha256=api.blobs.put_bytes(html),
        summary={"speedup": 1.2},
        timings={"passes": 0.5},
    )
    status = api.client.get(f"/v1/jobs/{job_id}").json()
    assert status["state"] == "succeeded"
    assert status["summary"] == {"speedup": 1.2}
    assert status["links"]["artifact"] == f"/v1/jobs/{job_id}/artifact"
    assert status["durations"]["total_seconds"] is not None

    response = api.client.get(status["links"]["artifact"])
    assert response.status_code == 200
    assert response.content == artifact
    assert 'filename="my_model.optimized.onnx"' in response.headers["content-disposition"]

    response = api.client.get(status["links"]["report"])
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.json() == report

    response = api.client.get(status["links"]["report_html"])
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert response.headers["content-security-policy"] == (
        "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
    )
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.content == html


def test_unknown_route_returns_404_problem(api: Live) -> None:
    _assert_problem(api.client.get("/v1/nothing-here"), 404, "NOT_FOUND")


def test_create_job_leaves_no_file_when_client_disconnects_mid_upload(api: Live) -> None:
    host, port = api.client.base_url.host, api.client.base_url.port
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"; filename="m.onnx"\r\n\r\n'
    ).encode() + b"\0" * (200 << 10)
    with socket.create_connection((host, port)) as sock:
        sock.sendall(
            (
                f"POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                f"Content-Length: {MODEL_CAP}\r\n\r\n"
            ).encode()
            + head
        )
        deadline = time.monotonic() + 5
        while not api.tmp_files() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert api.tmp_files(), "the server never started writing the upload"
    deadline = time.monotonic() + 5
    while api.tmp_files() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert api.tmp_files() == []
    assert api.dispatcher.enqueued == []
