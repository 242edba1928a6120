"""Upload rate into the blob store through the live API: ``python -m bench.upload_rate [--mib N] [--runs R]``.

Starts ``onnxforge serve`` (no workers: the job stays queued, so only the upload is timed) on the local
backend, and on the s3 backend against moto's S3 server (a subprocess, as in the tests), then POSTs an
N MiB model R times as one streamed multipart body generated in memory (no client disk reads) and prints
the median MB/s from the first byte sent to the 202. Every upload is different bytes, so each is stored.
The rate is the API's: receive, parse, hash and write (local) or multipart-upload and server-side copy (s3).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1 << 20


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


def _body(boundary: str, size: int, seed: int) -> Iterator[bytes]:
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="config"\r\n\r\n{{"preset": "safe"}}\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"; filename="big.onnx"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    block = bytearray(os.urandom(CHUNK))
    block[:16] = seed.to_bytes(16, "little")  # every run uploads different bytes: nothing deduplicates
    for _ in range(size // CHUNK):
        yield bytes(block)
    yield f"\r\n--{boundary}--\r\n".encode()


def _upload(url: str, size: int, seed: int) -> float:
    boundary = uuid.uuid4().hex
    length = sum(len(part) for part in _body(boundary, 0, seed)) + size
    started = time.monotonic()
    response = httpx.post(
        f"{url}/v1/jobs",
        content=_body(boundary, size, seed),
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}", "Content-Length": str(length)},
        timeout=600,
    )
    seconds = time.monotonic() - started
    if response.status_code != 202:
        raise RuntimeError(f"upload answered {response.status_code}: {response.text[:300]}")
    return size / seconds / 1e6


def measure(backend: str, size: int, runs: int) -> list[float]:
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="onnxforge-upload-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONNXFORGE_")}
        port = _free_port()
        env |= {
            "ONNXFORGE_STORAGE__DATA_DIR": str(Path(tmp) / "data"),
            "ONNXFORGE_API__PORT": str(port),
            "ONNXFORGE_WORKER__EMBEDDED_WORKERS": "0",
            "ONNXFORGE_CACHE__ENABLED": "false",
            "ONNXFORGE_API__MAX_UPLOAD_BYTES": str(size + (1 << 20)),
            "ONNXFORGE_LOG_LEVEL": "WARNING",
        }
        try:
            if backend == "s3":
                s3_port = _free_port()
                endpoint = f"http://127.0.0.1:{s3_port}"
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
                _wait(f"{endpoint}/moto-api/", procs[-1])
                keys = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench", "region_name": "us-east-1"}
                boto3.client("s3", endpoint_url=endpoint, **keys).create_bucket(Bucket="bench")
                env |= {
                    "ONNXFORGE_STORAGE__BACKEND": "s3",
                    "ONNXFORGE_STORAGE__S3_BUCKET": "bench",
                    "ONNXFORGE_STORAGE__S3_ENDPOINT_URL": endpoint,
                    "ONNXFORGE_STORAGE__S3_ACCESS_KEY_ID": "bench",
                    "ONNXFORGE_STORAGE__S3_SECRET_ACCESS_KEY": "bench",
                    "ONNXFORGE_STORAGE__S3_REGION": "us-east-1",
                }
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "onnxforge.cli", "serve"],
                    env=env,
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            url = f"http://127.0.0.1:{port}"
            _wait(f"{url}/healthz", procs[-1])
            return [_upload(url, size, seed) for seed in range(runs)]
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="size of each upload, MiB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backends", default="local,s3")
    args = parser.parse_args()
    for backend in args.backends.split(","):
        rates = measure(backend, args.mib << 20, args.runs)
        print(
            f"{backend}: {args.mib} MiB x {args.runs}: median {statistics.median(rates):.0f} MB/s "
            f"(runs {', '.join(f'{r:.0f}' for r in rates)}; {os.cpu_count()} CPUs)"
        )


if __name__ == "__main__":
    main()
