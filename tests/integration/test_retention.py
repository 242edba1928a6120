"""Retention end to end: a job run by the real embedded service, then ``onnxforge purge``: its files are gone
from disk and the job from the API; a job deleted through DELETE leaves nothing behind either."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import FAST_PIPELINE, ROOT, Services, service_env
from tests.integration._flow import submit, wait

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _blob_files(data_dir: Path) -> set[str]:
    return {p.name for p in (data_dir / "blobs").glob("??/*") if p.is_file()}


def test_purge_deletes_a_finished_jobs_files_from_disk_when_its_retention_has_passed(
    services: Services, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    # About 0.9 s of retention: the job is due as soon as it has finished.
    env = service_env(data_dir, retention__jobs_days="0.00001", retention__blob_grace_seconds=0, **FAST_PIPELINE)
    api = services.serve(env, embedded=True)
    assert api.url
    job = wait(api.url, submit(api.url)["id"])
    assert job["state"] == "succeeded"
    files = {job["model"]["sha256"], *(_blob_files(data_dir))}
    assert job["model"]["sha256"] in _blob_files(data_dir)
    assert len(_blob_files(data_dir)) >= 4  # model, optimized model, JSON and HTML reports
    time.sleep(1.0)

    result = subprocess.run(
        [sys.executable, "-m", "onnxforge.cli", "purge", "--json"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout.splitlines()[-1])
    assert stats["jobs_deleted"] == 1
    assert stats["blobs_deleted"] == len(files)
    assert _blob_files(data_dir) == set()
    assert httpx.get(f"{api.url}/v1/jobs/{job['id']}", timeout=10).status_code == 404
    assert not (data_dir / "work" / job["id"]).exists()

    # DELETE of a finished job: the row and its files go at once.
    again = wait(api.url, submit(api.url)["id"])
    assert again["state"] == "succeeded"
    assert _blob_files(data_dir)
    assert httpx.delete(f"{api.url}/v1/jobs/{again['id']}", timeout=10).status_code == 204
    assert _blob_files(data_dir) == set()
