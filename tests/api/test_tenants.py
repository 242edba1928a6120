"""Teams against a live uvicorn server: bearer tokens, tenant isolation on every route, upload slots.

Two tenants: ``team-a`` from a JSON keys file, ``team-b`` from the ``auth.keys`` setting (the environment's
ONNXFORGE_AUTH__KEYS). Another tenant's job must look exactly like a missing one (404 JOB_NOT_FOUND,
security.md T13), and a tenant over its upload slots gets 429 while others are still served (T12).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.main import create_app
from core.keys import hash_key
from core.store import Job
from tests.api.conftest import Live, make_settings, serve

pytestmark = pytest.mark.integration

KEY_A = "ofk_team-a-test-key-0123456789abcdefghijklmnopq"
KEY_B = "ofk_team-b-test-key-0123456789abcdefghijklmnopq"
BOUNDARY = "onnxforge-tenant-boundary"
MODEL = b"\x08\x07" + b"\x00" * 1000  # any non-archive bytes are an "onnx" upload; the API never parses them
MISSING_ID = "00000000-0000-4000-8000-000000000000"
ID_ROUTES = [("GET", ""), ("DELETE", ""), ("GET", "/artifact"), ("GET", "/report"), ("GET", "/report.html")]


@pytest.fixture(scope="module")
def teams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    data_dir = tmp_path_factory.mktemp("data")
    keys_file = data_dir / "keys.json"
    keys_file.write_text(json.dumps({"team-a": [hash_key(KEY_A)]}))
    settings = make_settings(
        data_dir,
        api={"max_concurrent_uploads_per_tenant": 2},
        auth={"keys_file": keys_file, "keys": {"team-b": [hash_key(KEY_B)]}},
    )
    with serve(settings) as server:
        yield server


def _client(server: Live, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=30)


@pytest.fixture(scope="module")
def team_a(teams: Live) -> Iterator[httpx.Client]:
    with _client(teams, KEY_A) as client:
        yield client


@pytest.fixture(scope="module")
def team_b(teams: Live) -> Iterator[httpx.Client]:
    with _client(teams, KEY_B) as client:
        yield client


@pytest.fixture(scope="module")
def anonymous(teams: Live) -> Iterator[httpx.Client]:
    with _client(teams, None) as client:
        yield client


def _submit(client: httpx.Client) -> httpx.Response:
    return client.post("/v1/jobs", files={"model": ("m.onnx", MODEL)}, data={"config": '{"preset": "safe"}'})


def _assert_problem(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert (body["status"], body["code"]) == (status, code)
    return body


def _succeeded_job(server: Live, client: httpx.Client) -> Job:
    """A job of ``client``'s tenant that a worker has finished, so every download route would answer."""
    job_id = _submit(client).json()["id"]
    claimed = server.store.claim(job_id, "test-worker", 60, max_attempts=3)
    assert claimed is not None
    assert server.store.succeed(
        job_id,
        claimed.attempts,
        artifact_sha256=server.blobs.put_bytes(b"optimized"),
        artifact_format="onnx",
        report_sha256=server.blobs.put_bytes(b'{"passes": []}'),
        report_html_sha256=server.blobs.put_bytes(b"<!doctype html><p>report</p>"),
        summary={},
        timings={},
    )
    return server.store.get(job_id)


@pytest.fixture(scope="module")
def job_of_a(teams: Live, team_a: httpx.Client) -> Job:
    return _succeeded_job(teams, team_a)


# ------------------------------------------------------------------------------------------- tokens


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/passes")]
    + [(method, f"/v1/jobs/{{id}}{suffix}") for method, suffix in ID_ROUTES],
)
def test_v1_route_returns_401_with_bearer_challenge_when_token_missing(
    teams: Live, anonymous: httpx.Client, job_of_a: Job, method: str, path: str
) -> None:
    url = path.format(id=job_of_a.id)
    teams.dispatcher.enqueued.clear()
    files = {"model": ("m.onnx", MODEL)} if method == "POST" else None
    response = anonymous.request(method, url, files=files)
    body = _assert_problem(response, 401, "UNAUTHENTICATED")
    assert response.headers["www-authenticate"] == 'Bearer realm="onnxforge"'
    assert "Bearer" in body["detail"]
    assert teams.dispatcher.enqueued == []
    assert teams.tmp_files() == []
    assert teams.store.get(job_of_a.id).state == "succeeded"


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer ofk_not-a-key",
        f"Bearer {KEY_A}x",
        f"Bearer {hash_key(KEY_A)}",  # the configured hash is not a key
        f"Basic {KEY_A}",  # the right key under another scheme
        "Bearer",
    ],
)
def test_v1_route_returns_401_when_token_wrong(teams: Live, authorization: str) -> None:
    response = httpx.get(f"{teams.base_url}/v1/jobs", headers={"Authorization": authorization})
    _assert_problem(response, 401, "UNAUTHENTICATED")
    assert response.headers["www-authenticate"].startswith("Bearer")


def test_v1_route_marks_the_token_invalid_when_one_was_sent(teams: Live) -> None:
    response = httpx.get(f"{teams.base_url}/v1/jobs", headers={"Authorization": "Bearer ofk_wrong"})
    assert response.headers["www-authenticate"] == 'Bearer realm="onnxforge", error="invalid_token"'


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/docs", "/openapi.json"])
def test_health_and_docs_answer_200_when_no_token_is_sent(anonymous: httpx.Client, path: str) -> None:
    assert anonymous.get(path).status_code == 200


def test_openapi_documents_the_bearer_scheme_and_401(anonymous: httpx.Client) -> None:
    spec = anonymous.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["ApiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "description": spec["components"]["securitySchemes"]["ApiKey"]["description"],
    }
    assert "401" in spec["paths"]["/v1/jobs/{job_id}"]["get"]["responses"]
    assert "429" in spec["paths"]["/v1/jobs"]["post"]["responses"]
    assert "security" not in spec["paths"]["/healthz"]["get"]


def test_keys_from_file_and_environment_each_map_to_their_tenant(
    teams: Live, team_a: httpx.Client, team_b: httpx.Client
) -> None:
    a = _submit(team_a)
    b = _submit(team_b)
    assert (a.status_code, b.status_code) == (202, 202), (a.text, b.text)
    assert teams.store.get(a.json()["id"]).tenant == "team-a"
    assert teams.store.get(b.json()["id"]).tenant == "team-b"


# ---------------------------------------------------------------------------------------- isolation


def test_every_id_route_serves_the_owner(team_a: httpx.Client, job_of_a: Job) -> None:
    for method, suffix in ID_ROUTES:
        if method == "GET":
            response = team_a.get(f"/v1/jobs/{job_of_a.id}{suffix}")
            assert response.status_code == 200, (suffix, response.text)


@pytest.mark.parametrize(("method", "suffix"), ID_ROUTES)
def test_id_route_returns_404_when_job_belongs_to_another_tenant(
    teams: Live, team_b: httpx.Client, job_of_a: Job, method: str, suffix: str
) -> None:
    body = _assert_problem(team_b.request(method, f"/v1/jobs/{job_of_a.id}{suffix}"), 404, "JOB_NOT_FOUND")
    # Exactly what a job that does not exist gets: nothing says it exists.
    missing = team_b.request(method, f"/v1/jobs/{MISSING_ID}{suffix}").json()
    assert body.keys() == missing.keys()
    assert body["detail"].replace(job_of_a.id, "ID") == missing["detail"].replace(MISSING_ID, "ID")
    assert teams.store.get(job_of_a.id).state == "succeeded"


def test_delete_returns_404_and_leaves_job_queued_when_job_belongs_to_another_tenant(
    teams: Live, team_a: httpx.Client, team_b: httpx.Client
) -> None:
    job_id = _submit(team_a).json()["id"]
    _assert_problem(team_b.delete(f"/v1/jobs/{job_id}"), 404, "JOB_NOT_FOUND")
    job = teams.store.get(job_id)
    assert (job.state, job.cancel_requested) == ("queued", False)


def test_list_jobs_shows_only_the_callers_jobs(team_a: httpx.Client, team_b: httpx.Client, job_of_a: Job) -> None:
    listed_b = team_b.get("/v1/jobs", params={"limit": 50}).json()
    assert job_of_a.id not in {j["id"] for j in listed_b["jobs"]}
    listed_a = team_a.get("/v1/jobs", params={"limit": 50}).json()
    assert job_of_a.id in {j["id"] for j in listed_a["jobs"]}
    assert listed_b["total"] == len(listed_b["jobs"])
    assert not {j["id"] for j in listed_a["jobs"]} & {j["id"] for j in listed_b["jobs"]}


@pytest.mark.parametrize("job_id", ["..", "%2e%2e", "%2e%2e%2f", "%2e%2e%2f%2e%2e%2fx", "..%2F..%2Fx", "x" * 300])
@pytest.mark.parametrize(("method", "suffix"), ID_ROUTES)
def test_id_route_returns_404_when_id_is_hostile(team_b: httpx.Client, job_id: str, method: str, suffix: str) -> None:
    response = team_b.request(method, f"/v1/jobs/{job_id}{suffix}")
    assert response.status_code in (404, 422), response.text
    assert response.headers["content-type"].startswith("application/problem+json")


@pytest.mark.parametrize("target", ["/v1/jobs/../../x", "/v1/jobs/../../etc/passwd/report", "/v1/jobs/./../jobs"])
def test_id_route_returns_404_when_path_has_unnormalized_dot_segments(teams: Live, target: str) -> None:
    # httpx normalizes "../" away; send the request line as written.
    host, port = teams.client.base_url.host, teams.client.base_url.port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            f"GET {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY_B}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status = int(reply.split(b" ", 2)[1])
    assert status in (404, 422), reply[:500]


def test_no_route_serves_a_blob_by_digest(tmp_path: Path) -> None:
    """Blobs are shared between tenants; only a tenant-checked job row may lead to one."""
    app = create_app(make_settings(tmp_path))
    paths = set(app.openapi()["paths"]) | {r.path for r in app.routes if isinstance(getattr(r, "path", None), str)}
    assert "/v1/jobs/{job_id}/artifact" in paths
    params = set(re.findall(r"{(\w+)[}:]", " ".join(paths)))
    assert params == {"job_id"}
    assert not [p for p in paths if any(word in p.lower() for word in ("blob", "sha", "file", "static"))]


# ------------------------------------------------------------------------------------------ uploads


def _slow_upload(server: Live, token: str, release: threading.Event, results: list[httpx.Response]) -> threading.Thread:
    """An upload that sends 200 KiB (enough for the server to start writing it), then waits for ``release``."""

    def body() -> Iterator[bytes]:
        yield (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"; filename="slow.onnx"\r\n\r\n'
        ).encode() + b"\x08" * (200 << 10)
        release.wait(30)
        yield f"\r\n--{BOUNDARY}--\r\n".encode()

    def run() -> None:
        with _client(server, token) as client:
            headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
            results.append(client.post("/v1/jobs", content=body(), headers=headers))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_create_job_returns_429_with_retry_after_when_tenant_exceeds_upload_slots(
    teams: Live, team_a: httpx.Client, team_b: httpx.Client
) -> None:
    release = threading.Event()
    results: list[httpx.Response] = []
    threads = [_slow_upload(teams, KEY_A, release, results) for _ in range(2)]
    try:
        deadline = time.monotonic() + 10
        while len(teams.tmp_files()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(teams.tmp_files()) == 2, "the two slow uploads never reached the server"

        refused = team_a.post("/v1/jobs", files={"model": ("m.onnx", MODEL)})
        body = _assert_problem(refused, 429, "TOO_MANY_UPLOADS")
        assert int(refused.headers["retry-after"]) > 0
        assert body["context"] == {"limit": 2}
        assert len(teams.tmp_files()) == 2, "the refused upload must not have been written"

        assert _submit(team_b).status_code == 202, "another tenant's slots are its own"
    finally:
        release.set()
        for thread in threads:
            thread.join(timeout=30)
    assert [r.status_code for r in results] == [202, 202], [r.text for r in results]
    assert _submit(team_a).status_code == 202, "finished uploads give their slots back"
    assert teams.tmp_files() == []


def test_create_job_gives_the_slot_back_when_upload_is_refused(team_a: httpx.Client) -> None:
    for _ in range(3):  # more than the 2 slots: a leaked slot would turn the third into a 429
        _assert_problem(
            team_a.post("/v1/jobs", files={"model": ("m.onnx", MODEL)}, data={"config": "{"}), 422, "INVALID_CONFIG"
        )
    assert _submit(team_a).status_code == 202


# ---------------------------------------------------------------------------------------- open mode


def test_open_mode_serves_v1_without_token_when_no_keys_and_loopback(api: Live) -> None:
    """The shared ``live`` server has no keys and binds 127.0.0.1: open mode, every caller is ``default``."""
    with httpx.Client(base_url=api.base_url) as client:
        response = _submit(client)
        assert response.status_code == 202, response.text
        assert api.store.get(response.json()["id"]).tenant == "default"
        assert client.get("/v1/passes").status_code == 200
        # A token is not needed and, with no keys configured, not looked at.
        assert client.get("/v1/jobs", headers={"Authorization": "Bearer anything"}).status_code == 200


def test_open_mode_true_serves_v1_without_token_when_explicit_on_loopback(tmp_path: Path) -> None:
    with serve(make_settings(tmp_path, auth={"open_mode": True})) as server:
        assert server.client.get("/v1/jobs").status_code == 200


def test_closed_mode_refuses_v1_when_open_mode_false_and_no_keys(tmp_path: Path) -> None:
    with serve(make_settings(tmp_path, auth={"open_mode": False})) as server:
        _assert_problem(server.client.get("/v1/jobs"), 401, "UNAUTHENTICATED")
        assert server.client.get("/healthz").status_code == 200
