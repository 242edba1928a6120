"""A real S3-compatible server for tests: moto's server mode (``moto[server]`` from PyPI) in its own process on
a free port, so its memory is not the test's. ``s3_endpoint`` is a session fixture; import it into a test
module to use it there."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest

from core.settings import StorageSettings
from tests.conftest import free_port

CREDENTIALS = {"s3_access_key_id": "testing", "s3_secret_access_key": "testing", "s3_region": "us-east-1"}


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of a moto S3 server in its own process (its memory is not ours)."""
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/moto-api/", timeout=1)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("moto's S3 server did not start")
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def client(endpoint: str) -> Any:
    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )  # fmt: skip


def make_bucket(endpoint: str) -> str:
    """A fresh, empty bucket on the test server."""
    bucket = f"onnxforge-{uuid.uuid4().hex[:12]}"
    client(endpoint).create_bucket(Bucket=bucket)
    return bucket


def s3_settings(endpoint: str, tmp_path: Path, **extra: object) -> StorageSettings:
    """Storage settings for a fresh bucket on the test server."""
    return StorageSettings(
        data_dir=tmp_path,
        backend="s3",
        s3_bucket=make_bucket(endpoint),
        s3_endpoint_url=endpoint,
        **CREDENTIALS,
        **extra,  # type: ignore[arg-type]
    )


def s3_env(endpoint: str, bucket: str) -> dict[str, str]:
    """``service_env`` keyword arguments for the s3 backend on the test server."""
    return {
        "storage__backend": "s3",
        "storage__s3_bucket": bucket,
        "storage__s3_endpoint_url": endpoint,
        **{f"storage__{k}": v for k, v in CREDENTIALS.items()},
    }
