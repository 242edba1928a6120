"""The service on object storage: ``onnxforge serve`` (embedded workers) with storage.backend=s3 against a real
S3-compatible server (moto, tests/s3server.py). Uploads stream into the bucket, workers fetch into their
local scratch and store results there, artifact downloads redirect to a presigned URL, and DELETE removes
the job's objects."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from onnxforge.client import Client
from tests.conftest import FAST_PIPELINE, Services, service_env
from tests.integration._flow import MODEL, outputs, submit, wait
from tests.s3server import client, make_bucket, s3_endpoint, s3_env

__all__ = ["s3_endpoint"]  # the session fixture, imported so pytest finds it here

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_serve_keeps_uploads_and_results_in_object_storage_when_backend_is_s3(
    services: Services, tmp_path: Path, s3_endpoint: str
) -> None:
    bucket = make_bucket(s3_endpoint)
    data_dir = tmp_path / "data"
    env = service_env(data_dir, retention__blob_grace_seconds=0, **s3_env(s3_endpoint, bucket), **FAST_PIPELINE)
    api = services.serve(env, embedded=True)
    assert api.url

    job = wait(api.url, submit(api.url)["id"])

    assert job["state"] == "succeeded", job.get("error")
    keys = [o["Key"] for o in client(s3_endpoint).list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert f"onnxforge/blobs/{job['model']['sha256'][:2]}/{job['model']['sha256']}" in keys
    assert len(keys) == 4  # model, optimized model, JSON and HTML reports; no temp objects
    assert not [p for p in (data_dir / "blobs").rglob("*") if p.is_file()]  # nothing on the shared disk

    redirect = httpx.get(f"{api.url}/v1/jobs/{job['id']}/artifact", timeout=30)
    assert redirect.status_code == 307
    artifact = tmp_path / "artifact.onnx"
    artifact.write_bytes(httpx.get(redirect.headers["location"], timeout=60).raise_for_status().content)
    for got, ref in zip(outputs(artifact, 3, 1), outputs(MODEL, 3, 1), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    with Client(api.url) as api_client:  # the Python client follows the redirect
        assert (
            api_client.download_artifact(job["id"], tmp_path / "via-client.onnx").read_bytes() == artifact.read_bytes()
        )
    report = httpx.get(f"{api.url}/v1/jobs/{job['id']}/report", timeout=30).raise_for_status().json()
    assert report["job_id"] == job["id"]
    html = httpx.get(f"{api.url}/v1/jobs/{job['id']}/report.html", timeout=30)
    assert html.status_code == 200 and "default-src 'none'" in html.headers["content-security-policy"]

    assert httpx.delete(f"{api.url}/v1/jobs/{job['id']}", timeout=30).status_code == 204
    assert client(s3_endpoint).list_objects_v2(Bucket=bucket).get("Contents", []) == []
