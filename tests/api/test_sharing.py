"""Sharing one endpoint, against a live uvicorn server: Idempotency-Key, per-team quotas, fair-share priority.

Two tenants with their own API keys (``team-a`` with tight quotas, ``team-b`` with the defaults). The broker
is the recorder of tests/api/conftest.py, so the priority each job was enqueued with can be read back; the
job table and blob store are real.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from core.keys import hash_key
from tests.api.conftest import Live, make_settings, serve

pytestmark = pytest.mark.integration

KEY_A = "ofk_team-a-sharing-key-0123456789abcdefghijklmno"
KEY_B = "ofk_team-b-sharing-key-0123456789abcdefghijklmno"
MODEL = b"\x08\x07" + b"\x00" * 1000  # any non-archive bytes are an "onnx" upload; the API never parses them
BYTES_PER_DAY = 2500  # two MODEL uploads fit, a third does not


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    settings = make_settings(
        tmp_path_factory.mktemp("data"),
        api={"max_concurrent_uploads_per_tenant": 8},
        auth={"keys": {"team-a": [hash_key(KEY_A)], "team-b": [hash_key(KEY_B)]}},
        quotas={"retry_after_seconds": 17, "teams": {"team-a": {"max_concurrent_jobs": 3, "priority": 1}}},
        cache={"enabled": False},
    )
    with serve(settings) as server:
        yield server


@pytest.fixture
def team_a(shared: Live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared.base_url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30) as c:
        yield c


@pytest.fixture
def team_b(shared: Live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared.base_url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30) as c:
        yield c


def _submit(
    client: httpx.Client, key: str | None = None, config: dict | None = None, model: bytes = MODEL
) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    data = {"config": json.dumps(config or {"preset": "safe"})}
    return client.post("/v1/jobs", data=data, files={"model": ("m.onnx", model)}, headers=headers)


def _cancel_all(live: Live, client: httpx.Client) -> None:
    for job in client.get("/v1/jobs", params={"limit": 50}).json()["jobs"]:
        if job["state"] in {"queued", "running"}:
            client.delete(f"/v1/jobs/{job['id']}")


def test_submit_returns_first_job_when_idempotency_key_is_repeated(shared: Live, team_b: httpx.Client) -> None:
    key = str(uuid.uuid4())

    first = _submit(team_b, key)
    again = _submit(team_b, key)

    assert first.status_code == 202, first.text
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Location"] == f"/v1/jobs/{first.json()['id']}"
    assert [job_id for job_id, _ in shared.dispatcher.enqueued].count(first.json()["id"]) == 1
    assert shared.store.get(first.json()["id"]).idempotency_key == key


def test_submit_answers_422_when_idempotency_key_names_another_request(team_b: httpx.Client) -> None:
    key = str(uuid.uuid4())
    first = _submit(team_b, key)

    other = _submit(team_b, key, config={"preset": "fast"})

    assert other.status_code == 422
    assert other.json()["code"] == "IDEMPOTENCY_KEY_REUSED"
    assert first.json()["id"] in other.json()["detail"]


def test_submit_creates_separate_jobs_when_two_tenants_use_the_same_idempotency_key(
    shared: Live, team_a: httpx.Client, team_b: httpx.Client
) -> None:
    key = str(uuid.uuid4())
    try:
        a = _submit(team_a, key)
        b = _submit(team_b, key)
        assert (a.status_code, b.status_code) == (202, 202)
        assert a.json()["id"] != b.json()["id"]
    finally:
        _cancel_all(shared, team_a)


def test_submit_creates_one_job_when_the_same_idempotency_key_races(shared: Live, team_b: httpx.Client) -> None:
    key = str(uuid.uuid4())
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda _: _submit(team_b, key), range(4)))

    assert sorted(r.status_code for r in responses) == [200, 200, 200, 202]
    assert len({r.json()["id"] for r in responses}) == 1


@pytest.mark.parametrize("key", ["", "a" * 256, "has space", "naïve"])
def test_submit_answers_422_when_idempotency_key_is_malformed(team_b: httpx.Client, key: str) -> None:
    response = team_b.post("/v1/jobs", files={"model": ("m.onnx", MODEL)}, headers={"Idempotency-Key": key.encode()})

    assert response.status_code == 422
    assert response.json()["code"] == "IDEMPOTENCY_KEY_INVALID"


def test_submit_answers_429_with_retry_after_when_quota_of_concurrent_jobs_exceeded(
    shared: Live, team_a: httpx.Client, team_b: httpx.Client
) -> None:
    try:
        accepted = [_submit(team_a) for _ in range(3)]
        refused = _submit(team_a)
        other_team = _submit(team_b)

        assert [r.status_code for r in accepted] == [202, 202, 202]
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "17"
        assert refused.json()["code"] == "QUOTA_CONCURRENT_JOBS"
        assert other_team.status_code == 202  # one team's quota never blocks another

        team_a.delete(f"/v1/jobs/{accepted[0].json()['id']}")  # a slot frees up
        assert _submit(team_a).status_code == 202
    finally:
        _cancel_all(shared, team_a)


def test_submit_gives_later_jobs_of_a_busy_team_a_lower_priority_when_enqueued(
    shared: Live, team_a: httpx.Client, team_b: httpx.Client
) -> None:
    _cancel_all(shared, team_b)  # team-b starts with nothing in flight
    shared.dispatcher.priorities.clear()
    try:
        for _ in range(3):
            assert _submit(team_a).status_code == 202
        assert _submit(team_b).status_code == 202

        # team-a: its base priority 1, plus one per job it already has in flight; team-b's first job gets 0,
        # so the broker serves it before team-a's second and third.
        assert shared.dispatcher.priorities == [1, 2, 3, 0]
    finally:
        _cancel_all(shared, team_a)
        _cancel_all(shared, team_b)


def test_submit_answers_429_with_retry_after_when_bytes_per_day_exceeded(tmp_path) -> None:
    settings = make_settings(tmp_path / "data", quotas={"max_bytes_per_day": BYTES_PER_DAY}, cache={"enabled": False})
    with serve(settings) as live:
        assert [_submit(live.client).status_code for _ in range(2)] == [202, 202]

        refused = _submit(live.client)
        too_big = _submit(live.client, model=MODEL * 3)

    assert refused.status_code == 429
    assert refused.json()["code"] == "QUOTA_BYTES_PER_DAY"
    # The window frees the first upload's bytes 24 hours after it was made.
    assert 86_000 < int(refused.headers["Retry-After"]) <= 86_400
    assert too_big.status_code == 413  # one upload larger than the whole day's quota can never fit
    assert too_big.json()["code"] == "QUOTA_BYTES_PER_DAY"
