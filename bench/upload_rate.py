"""Upload rate into the blob store through the live API: ``python -m bench.upload_rate [--mib N] [--runs R]``.

Starts ``onnxforge serve`` (no workers: the job stays queued, so only the upload is timed) on the local
backend, and on the s3 backend against moto's S3 server (a subprocess, as in the tests), then POSTs an
N MiB model R times per form, generated in memory (no client disk reads), and prints the median MB/s from
the first byte sent to the 202. Every upload is different bytes, so each is stored. The forms:

* ``multipart``: one streamed multipart/form-data body (fields config and model);
* ``raw``: the model alone as application/octet-stream, config in ``Onnxforge-Config`` and the digest in
  ``Content-Digest``, as the Python client sends it. The client hashes the model before sending (as
  ``Client.submit`` does); that time is the client's and is not counted.

``--baseline PATH`` also serves a second checkout (e.g. ``git worktree add /tmp/base HEAD~3``) beside this
one, so before and after are measured in one run: the variants take turns within each round, in an order
that alternates from round to round, so load on a shared machine hits them alike. The rate is the API's:
receive, parse, hash and write (local) or multipart-upload (s3).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
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
import psutil

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1 << 20
CONFIG = '{"preset": "safe"}'


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


def _block(seed: int) -> bytes:
    block = bytearray(os.urandom(CHUNK))
    block[:16] = seed.to_bytes(16, "little")  # every run uploads different bytes: nothing deduplicates
    return bytes(block)


def _model(block: bytes, size: int) -> Iterator[bytes]:
    for _ in range(size // CHUNK):
        yield block


def _multipart(boundary: str, block: bytes, size: int) -> Iterator[bytes]:
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="config"\r\n\r\n{CONFIG}\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"; filename="big.onnx"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    yield from _model(block, size)
    yield f"\r\n--{boundary}--\r\n".encode()


def _request(form: str, size: int, seed: int) -> tuple[Iterator[bytes], dict[str, str]]:
    """The body and headers of one upload; for ``raw``, hashed first as Client.submit does."""
    block = _block(seed)
    if form == "raw":
        digest = hashlib.sha256()
        for piece in _model(block, size):
            digest.update(piece)
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(size),
            "Content-Disposition": 'attachment; filename="big.onnx"',
            "Onnxforge-Config": CONFIG,
            "Content-Digest": f"sha-256=:{base64.b64encode(digest.digest()).decode()}:",
        }
        return _model(block, size), headers
    boundary = uuid.uuid4().hex
    length = sum(len(part) for part in _multipart(boundary, block, 0)) + size
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}", "Content-Length": str(length)}
    return _multipart(boundary, block, size), headers


def _upload(url: str, form: str, size: int, seed: int) -> float:
    body, headers = _request(form, size, seed)
    started = time.monotonic()
    response = httpx.post(f"{url}/v1/jobs", content=body, headers=headers, timeout=600)
    seconds = time.monotonic() - started
    if response.status_code != 202:
        raise RuntimeError(f"upload answered {response.status_code}: {response.text[:300]}")
    return size / seconds / 1e6


@contextlib.contextmanager
def _moto(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """A moto S3 server with a bucket; yields the settings that point a server at it."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait(f"{endpoint}/moto-api/", proc)
        keys = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench", "region_name": "us-east-1"}
        boto3.client("s3", endpoint_url=endpoint, **keys).create_bucket(Bucket="bench")
        yield {
            "ONNXFORGE_STORAGE__BACKEND": "s3",
            "ONNXFORGE_STORAGE__S3_BUCKET": "bench",
            "ONNXFORGE_STORAGE__S3_ENDPOINT_URL": endpoint,
            "ONNXFORGE_STORAGE__S3_ACCESS_KEY_ID": "bench",
            "ONNXFORGE_STORAGE__S3_SECRET_ACCESS_KEY": "bench",
            "ONNXFORGE_STORAGE__S3_REGION": "us-east-1",
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def _server(root: Path, data: Path, size: int, extra: dict[str, str]) -> Iterator[tuple[str, psutil.Process]]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONNXFORGE_")}
    env |= {
        "ONNXFORGE_STORAGE__DATA_DIR": str(data),
        "ONNXFORGE_API__PORT": str(port),
        "ONNXFORGE_WORKER__EMBEDDED_WORKERS": "0",
        "ONNXFORGE_CACHE__ENABLED": "false",
        "ONNXFORGE_API__MAX_UPLOAD_BYTES": str(size + (1 << 20)),
        "ONNXFORGE_LOG_LEVEL": "WARNING",
        **extra,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "onnxforge.cli", "serve"],
        env=env,
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(f"{url}/healthz", proc)
        # The first job loads the pass registry; a tiny upload does it before anything is timed.
        _upload(url, "multipart", CHUNK, seed=1 << 64)
        yield url, psutil.Process(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def measure(
    backend: str, size: int, runs: int, variants: list[tuple[str, Path, str]]
) -> dict[str, list[tuple[float, float]]]:
    """Per variant (label, checkout, form): (MB/s, the server's CPU seconds per GiB) of each upload, the
    variants taking turns within each round. CPU time is user + system of the API process, which load
    moves far less than the rate on a shared machine."""
    rates: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in variants}
    with tempfile.TemporaryDirectory(prefix="onnxforge-upload-") as tmp, contextlib.ExitStack() as stack:
        extra = stack.enter_context(_moto(dict(os.environ))) if backend == "s3" else {}
        urls = {
            root: stack.enter_context(_server(root, Path(tmp) / f"data{i}", size, extra))
            for i, root in enumerate(dict.fromkeys(root for _, root, _ in variants))
        }
        seed = 0
        for round_ in range(runs):
            order = variants if round_ % 2 == 0 else variants[::-1]
            for label, root, form in order:
                seed += 1
                url, server = urls[root]
                before = server.cpu_times()
                rate = _upload(url, form, size, seed)
                after = server.cpu_times()
                cpu = (after.user - before.user) + (after.system - before.system)
                rates[label].append((rate, cpu / (size / (1 << 30))))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="size of each upload, MiB")
    parser.add_argument("--runs", type=int, default=3, help="rounds; each variant uploads once per round")
    parser.add_argument("--backends", default="local,s3")
    parser.add_argument("--forms", default="multipart,raw")
    parser.add_argument("--baseline", type=Path, help="another checkout to serve too (multipart form only)")
    args = parser.parse_args()
    variants = [(form, ROOT, form) for form in args.forms.split(",")]
    if args.baseline is not None:
        variants.insert(0, ("baseline multipart", args.baseline.resolve(), "multipart"))
    for backend in args.backends.split(","):
        rates = measure(backend, args.mib << 20, args.runs, variants)
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        for label, values in rates.items():
            mbs, cpus = [r for r, _ in values], [c for _, c in values]
            print(
                f"{backend} {label}: {args.mib} MiB x {args.runs}: median {statistics.median(mbs):.0f} MB/s "
                f"(runs {', '.join(f'{r:.0f}' for r in mbs)}); API CPU median {statistics.median(cpus):.2f} s/GiB "
                f"(runs {', '.join(f'{c:.2f}' for c in cpus)}); {os.cpu_count()} CPUs; load {load}",
                flush=True,
            )


if __name__ == "__main__":
    main()
