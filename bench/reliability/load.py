"""Load run: concurrent uploads plus status polling (``load``)."""

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.reliability._stack import (
    CONFIG,
    UPLOAD_BLOCK,
    Log,
    RssSampler,
    Stack,
    api_process,
    log_stderr,
    model_variants,
    percentile,
    submit,
    workspace,
)

# ------------------------------------------------------------------------------------------------ load


async def _load(
    url: str,
    job_ids: list[str],
    *,
    uploads: int,
    upload_bytes: int,
    rps: float,
    seconds: float,
    healthz_rps: float,
    request_timeout: float,
) -> dict[str, Any]:
    status_lat: list[float] = []
    health_lat: list[float] = []
    codes: dict[str, int] = {}
    upload_results: list[tuple[int, float, int]] = []
    hangs = 0
    errors: dict[str, int] = {}
    boundary = uuid.uuid4().hex
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="config"\r\n\r\n{json.dumps(CONFIG)}\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"; filename="big.onnx"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    # An ONNX-looking prefix is not needed: the API never parses the model; the worker would fail it.
    length = len(head) + upload_bytes + len(tail)
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)

    async def body() -> Any:
        yield head
        left = upload_bytes
        while left:
            n = min(left, len(UPLOAD_BLOCK))
            yield UPLOAD_BLOCK[:n]
            left -= n
        yield tail

    def count(key: str) -> None:
        codes[key] = codes.get(key, 0) + 1

    async with httpx.AsyncClient(limits=limits, timeout=request_timeout) as client:

        async def one_get(path: str, sink: list[float], label: str) -> None:
            nonlocal hangs
            t = time.monotonic()
            try:
                r = await client.get(f"{url}{path}")
                sink.append(time.monotonic() - t)
                count(f"{label} {r.status_code}")
            except httpx.TimeoutException:
                hangs += 1
                count(f"{label} timeout")
            except httpx.HTTPError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

        async def uploader() -> None:
            while time.monotonic() < end:
                t = time.monotonic()
                try:
                    r = await client.post(
                        f"{url}/v1/jobs",
                        content=body(),
                        headers={
                            "Content-Type": f"multipart/form-data; boundary={boundary}",
                            "Content-Length": str(length),
                        },
                        timeout=max(request_timeout, 120),
                    )
                    upload_results.append((r.status_code, time.monotonic() - t, length))
                    count(f"upload {r.status_code}")
                    if r.status_code == 429:
                        await asyncio.sleep(0.5)
                except httpx.HTTPError as exc:
                    count(f"upload {type(exc).__name__}")

        async def ticker(rate: float, make: Callable[[int], Any]) -> None:
            tasks = []
            n = 0
            start = time.monotonic()
            while time.monotonic() < end:
                tasks.append(asyncio.create_task(make(n)))
                n += 1
                await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
            await asyncio.gather(*tasks)

        t_start = time.monotonic()
        await asyncio.gather(
            *(uploader() for _ in range(uploads)),
            ticker(rps, lambda n: one_get(f"/v1/jobs/{job_ids[n % len(job_ids)]}", status_lat, "status")),
            ticker(healthz_rps, lambda n: one_get("/healthz", health_lat, "healthz")),
        )
        wall = time.monotonic() - t_start

    ok_uploads = [u for u in upload_results if u[0] == 202]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return {
        "wall_seconds": round(wall, 2),
        "status_requests": len(status_lat),
        "status_rps_achieved": round(len(status_lat) / wall, 1),
        "status_p50_ms": ms(percentile(status_lat, 50)),
        "status_p99_ms": ms(percentile(status_lat, 99)),
        "healthz_requests": len(health_lat),
        "healthz_p50_ms": ms(percentile(health_lat, 50)),
        "healthz_p99_ms": ms(percentile(health_lat, 99)),
        "codes": codes,
        "five_xx": sum(v for k, v in codes.items() if k.split()[-1].startswith("5")),
        "timeouts": hangs,
        "errors": errors,
        "uploads_accepted": len(ok_uploads),
        "upload_mb_s_total": round(sum(u[2] for u in ok_uploads) / wall / 1e6, 1),
    }


def run_load(
    *,
    uploads: int = 8,
    upload_mb: float = 100,
    rps: float = 200,
    seconds: float = 20,
    healthz_rps: float = 10,
    upload_slots: int | None = None,
    request_timeout: float = 10.0,
    log: Log = log_stderr,
    tmp_parent: Path | None = None,
) -> dict[str, Any]:
    """``uploads`` concurrent uploads of ``upload_mb`` MB (repeated until the end) plus ``rps`` status GETs
    and ``healthz_rps`` /healthz GETs per second for ``seconds`` s, against an API with no workers
    (embedded mode, ``worker.embedded_workers=0``). ``upload_slots`` is the per-tenant upload cap
    (default: ``uploads``, so all are accepted; lower it to see 429s)."""
    with workspace(parent=tmp_parent) as tmp:
        stack = Stack(
            tmp, worker__embedded_workers=0, api__max_concurrent_uploads_per_tenant=upload_slots or uploads,
        )  # fmt: skip
        try:
            stack.start_api()
            with httpx.Client() as c:
                ids = [submit(c, stack.url, b).json()["id"] for b in model_variants(4)]
            with RssSampler(api_process(stack).pid) as rss:
                result = asyncio.run(
                    _load(
                        stack.url, ids, uploads=uploads, upload_bytes=int(upload_mb * 1e6), rps=rps, seconds=seconds,
                        healthz_rps=healthz_rps, request_timeout=request_timeout,
                    )
                )  # fmt: skip
            result.update(
                uploads=uploads, upload_mb=upload_mb, target_rps=rps, seconds=seconds,
                upload_slots=upload_slots or uploads, api_rss_increase_mb=round((rss.peak - rss.baseline) / 2**20, 1),
                api_alive=stack.api is not None and stack.api.alive,
            )  # fmt: skip
            log(f"load: {json.dumps({k: v for k, v in result.items() if k != 'codes'})}")
        finally:
            stack.close()
    return result
