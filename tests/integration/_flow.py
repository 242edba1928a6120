"""The end-to-end flow every service variant must pass: upload, poll, download, check numerics and report."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "models" / "mlp_cleanup.onnx"
# rollback_slower off: which passes are kept must not depend on timing noise (the CLI test compares graphs).
CONFIG = {"preset": "safe", "rollback_slower": False}
TERMINAL = {"succeeded", "failed", "canceled"}


def submit(base_url: str, model: Path = MODEL, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """POST /v1/jobs as a curl -F upload would: multipart fields ``model`` (file) and ``config`` (JSON)."""
    with model.open("rb") as f:
        response = httpx.post(
            f"{base_url}/v1/jobs",
            files={"model": (model.name, f, "application/octet-stream")},
            data={"config": json.dumps(config or CONFIG)},
            timeout=60,
        )
    assert response.status_code == 202, response.text
    return dict(response.json())


def wait(base_url: str, job_id: str, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = httpx.get(f"{base_url}/v1/jobs/{job_id}", timeout=10).raise_for_status().json()
        if job["state"] in TERMINAL:
            return job
        time.sleep(0.25)
    raise AssertionError(f"job {job_id} not finished after {timeout} s: {job}")


def outputs(path: Path, batch: int, seed: int) -> list[np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((batch, 16)).astype(np.float32)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return list(session.run(None, {"x": x}))


def check_job_flow(base_url: str, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """Run one job through the live service; returns the downloaded artifact and the report."""
    job = submit(base_url)
    assert job["state"] in {"queued", "running", "succeeded"}

    job = wait(base_url, job["id"])
    assert job["state"] == "succeeded", job.get("error")
    assert job["attempts"] == 1

    artifact = workdir / "artifact.onnx"
    response = httpx.get(f"{base_url}/v1/jobs/{job['id']}/artifact", timeout=60)
    assert response.status_code == 200
    artifact.write_bytes(response.content)
    onnx.checker.check_model(str(artifact))
    assert len(onnx.load(str(artifact)).graph.node) < len(onnx.load(str(MODEL)).graph.node)
    for batch in (1, 5):
        for got, ref in zip(outputs(artifact, batch, 7), outputs(MODEL, batch, 7), strict=True):
            assert got.shape == ref.shape
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)

    report = httpx.get(f"{base_url}/v1/jobs/{job['id']}/report", timeout=30).raise_for_status().json()
    assert [p["name"] for p in report["passes"]], report
    for p in report["passes"]:
        assert isinstance(p["nodes_before"], int) and isinstance(p["nodes_after"], int)
    summary = report["summary"]
    assert summary["nodes_before"] > summary["nodes_after"]
    assert summary["p50_ms_before"] > 0 and summary["p50_ms_after"] > 0
    assert report["benchmark"]["p50_ms_original"] > 0 and report["benchmark"]["p50_ms_optimized"] > 0
    html = httpx.get(f"{base_url}/v1/jobs/{job['id']}/report.html", timeout=30)
    assert html.status_code == 200 and "<html" in html.text.lower()
    return artifact, report
