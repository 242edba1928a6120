"""Health, readiness, the pass catalogue and the OpenAPI document of a live server."""

from __future__ import annotations

import pytest

from tests.api.conftest import Live

pytestmark = pytest.mark.integration


def test_healthz_returns_ok(api: Live) -> None:
    response = api.client.get("/healthz")
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


def test_readyz_returns_200_when_all_dependencies_answer(api: Live) -> None:
    response = api.client.get("/readyz")
    assert response.status_code == 200, response.text
    assert response.json()["checks"] == {"database": "ok", "broker": "ok", "storage": "ok"}


def test_readyz_returns_503_naming_broker_when_dispatcher_ping_fails(api: Live) -> None:
    api.dispatcher.down = True
    response = api.client.get("/readyz")
    assert response.status_code == 503
    assert response.headers["content-type"].startswith("application/problem+json")
    assert int(response.headers["retry-after"]) > 0
    body = response.json()
    assert body["code"] == "NOT_READY"
    assert body["checks"]["broker"].startswith("BROKER_UNAVAILABLE")
    assert body["checks"]["database"] == "ok"
    assert "broker" in body["detail"]


def test_passes_lists_passes_and_presets(api: Live) -> None:
    response = api.client.get("/v1/passes")
    assert response.status_code == 200
    body = response.json()
    names = {p["name"] for p in body["passes"]}
    assert {"constant_folding", "dead_node_elimination"} <= names
    assert all("options_schema" in p and p["summary"] for p in body["passes"])
    presets = {p["name"]: p for p in body["presets"]}
    assert "safe" in presets
    assert set(presets["safe"]["passes"]) <= names


def test_openapi_documents_routes_multipart_body_and_problems(api: Live) -> None:
    response = api.client.get("/openapi.json")
    assert response.status_code == 200
    spec = response.json()
    assert spec["openapi"].startswith("3.")
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/artifact", "/v1/passes", "/readyz"} <= set(
        spec["paths"]
    )
    post = spec["paths"]["/v1/jobs"]["post"]
    body_schema = post["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert set(body_schema["properties"]) == {"model", "samples", "config"}
    assert body_schema["required"] == ["model"]
    assert post["responses"]["413"]["content"]["application/problem+json"]["schema"] == {
        "$ref": "#/components/schemas/Problem"
    }
    assert "Problem" in spec["components"]["schemas"]
    assert api.client.get("/docs").status_code == 200
