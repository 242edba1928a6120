"""A small HTTP client of the onnxforge API (used by ``onnxforge submit`` and the service tests).

    with Client("http://127.0.0.1:8000") as client:
        job = client.submit("model.onnx", config={"preset": "safe"})
        job = client.wait(job["id"], progress=ProgressBar())  # or any callable taking the job
        client.download_artifact(job["id"], "model.optimized.onnx")

Uploads stream from the file (httpx reads it in chunks): a model without samples goes as the body itself
(``application/octet-stream``, the config in ``Onnxforge-Config``, its SHA-256 in ``Content-Digest``,
read once before sending), which the server stores faster than a multipart form; with samples, the
multipart form. Downloads stream to a temp file that is renamed into place, so a failed download never
leaves a truncated model behind. Server errors (RFC 9457 problem documents) raise ``ApiError`` carrying
the stable ``code``.

Retries (tenacity): a request that could not reach the server, or that was answered 429, 502, 503 or 504,
is sent again up to ``retries`` times, after the server's ``Retry-After`` when it gave one (capped at
``max_wait`` seconds), else after an exponential backoff with jitter. ``submit`` sends an
``Idempotency-Key`` (a new UUID per call unless given), so a retried upload whose first attempt did reach
the server answers the job it created instead of a second one.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import httpx
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt
from tenacity.wait import wait_exponential_jitter

from core.errors import OnnxforgeError

TERMINAL = frozenset({"succeeded", "failed", "canceled"})
# A config longer than this goes in the multipart form: servers and proxies cap header sizes at 8-16 KiB.
_MAX_CONFIG_HEADER = 8 << 10
_DIGEST_CHUNK = 1 << 20
RETRY_STATUSES = frozenset({0, 429, 502, 503, 504})


class ApiError(OnnxforgeError):
    """The server answered with an error (or could not be reached: status 0)."""

    def __init__(
        self, status: int, code: str, message: str, pass_name: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message, code=code, pass_name=pass_name)
        self.status = status
        self.retry_after = retry_after  # seconds, from the answer's Retry-After header


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, ApiError) and exc.status in RETRY_STATUSES


class _WaitRetryAfter:
    """tenacity wait: the server's Retry-After when it sent one, else exponential backoff with jitter."""

    def __init__(self, max_wait: float) -> None:
        self.max_wait = max_wait
        self.backoff = wait_exponential_jitter(multiplier=0.5, max=max_wait)

    def __call__(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, ApiError) and exc.retry_after is not None:
            return min(max(exc.retry_after, 0.0), self.max_wait)
        return float(self.backoff(state))


class Client:
    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout: float = 30.0,
        *,
        retries: int = 5,
        max_wait: float = 60.0,
    ) -> None:
        """``retries``: further attempts of a request answered 429/502/503/504 or not answered (0: none)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.retries = retries
        self.max_wait = max_wait

    def _retrying(self) -> Retrying:
        return Retrying(
            retry=retry_if_exception(_retryable),
            stop=stop_after_attempt(self.retries + 1),
            wait=_WaitRetryAfter(self.max_wait),
            reraise=True,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --------------------------------------------------------------------------------------------- calls

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        for attempt in self._retrying():
            with attempt:
                return self._send(method, url, **kwargs)
        raise AssertionError("unreachable: tenacity re-raises the last error")

    def _send(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(0, "CONNECTION_FAILED", f"cannot reach {self.base_url}: {exc}") from exc
        _raise_for_problem(response)
        return response

    def submit(
        self,
        model: str | Path,
        *,
        config: dict[str, Any] | None = None,
        samples: str | Path | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Upload a model (.onnx, or .zip/.tar with external data) and queue a job; returns the job.

        Every attempt re-opens the files; all attempts send the same ``idempotency_key`` (default: a new UUID),
        so at most one job is created."""
        key = idempotency_key or str(uuid.uuid4())
        model = Path(model)
        raw = samples is None and _plain_name(model.name) and len(json.dumps(config)) <= _MAX_CONFIG_HEADER
        digest = _content_digest(model) if raw else None
        for attempt in self._retrying():
            with attempt:
                if digest is not None:
                    return self._submit_raw(model, config, digest, key)
                return self._submit_once(model, config, samples, key)
        raise AssertionError("unreachable: tenacity re-raises the last error")

    def _submit_raw(self, model: Path, config: dict[str, Any] | None, digest: str, key: str) -> dict[str, Any]:
        """The fast form: the model alone as the body, the rest in headers."""
        headers = {
            "Idempotency-Key": key,
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f'attachment; filename="{model.name}"',
            "Content-Digest": digest,
        }
        if config is not None:
            headers["Onnxforge-Config"] = json.dumps(config)
        with model.open("rb") as body:
            response = self._send("POST", "/v1/jobs", content=body, headers=headers, timeout=None)
        return dict(response.json())

    def _submit_once(
        self, model: Path, config: dict[str, Any] | None, samples: str | Path | None, key: str
    ) -> dict[str, Any]:
        with ExitStack() as stack:
            files: dict[str, Any] = {
                "model": (model.name, stack.enter_context(model.open("rb")), "application/octet-stream")
            }
            if samples is not None:
                samples = Path(samples)
                files["samples"] = (
                    samples.name,
                    stack.enter_context(samples.open("rb")),
                    "application/octet-stream",
                )
            if config is not None:
                files["config"] = (None, json.dumps(config), "application/json")
            headers = {"Idempotency-Key": key}
            response = self._send("POST", "/v1/jobs", files=files, headers=headers, timeout=None)
        return dict(response.json())

    def get(self, job_id: str) -> dict[str, Any]:
        return dict(self._request("GET", f"/v1/jobs/{job_id}").json())

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Stop a queued or running job, keeping it and what it produced."""
        return dict(self._request("POST", f"/v1/jobs/{job_id}/cancel").json())

    def delete(self, job_id: str) -> dict[str, Any] | None:
        """Delete a job and its files; a running job is canceled first, and this returns it (else None)."""
        response = self._request("DELETE", f"/v1/jobs/{job_id}")
        return dict(response.json()) if response.status_code == 202 else None

    def passes(self) -> dict[str, Any]:
        return dict(self._request("GET", "/v1/passes").json())

    def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        interval: float = 0.5,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Poll until the job is terminal; ``progress(job)`` is called on every change of state/stage."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last: tuple[Any, ...] | None = None
        while True:
            job = self.get(job_id)
            seen = (job.get("state"), job.get("stage"), round(float(job.get("progress") or 0), 2))
            if progress is not None and seen != last:
                progress(job)
            last = seen
            if job.get("state") in TERMINAL:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.get('state')} after {timeout} s")
            time.sleep(interval)

    def download_artifact(self, job_id: str, dest: str | Path) -> Path:
        return self._download(f"/v1/jobs/{job_id}/artifact", Path(dest))

    def download_report(self, job_id: str, dest: str | Path, *, html: bool = False) -> Path:
        return self._download(f"/v1/jobs/{job_id}/report{'.html' if html else ''}", Path(dest))

    def report(self, job_id: str) -> dict[str, Any]:
        return dict(self._request("GET", f"/v1/jobs/{job_id}/report").json())

    def _download(self, url: str, dest: Path) -> Path:
        for attempt in self._retrying():
            with attempt:
                return self._download_once(url, dest)
        raise AssertionError("unreachable: tenacity re-raises the last error")

    def _download_once(self, url: str, dest: Path) -> Path:
        tmp = dest.with_name(f".{dest.name}.part")
        try:
            # Object storage answers 307 to a presigned URL; httpx drops the API key on that cross-origin hop.
            with self._http.stream("GET", url, timeout=None, follow_redirects=True) as response:
                if response.is_error:
                    response.read()
                    _raise_for_problem(response)
                with tmp.open("wb") as out:
                    for chunk in response.iter_bytes(1 << 20):
                        out.write(chunk)
            os.replace(tmp, dest)
        except httpx.HTTPError as exc:
            raise ApiError(0, "CONNECTION_FAILED", f"download from {self.base_url} failed: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
        return dest


class ProgressBar:
    """A ``progress`` callback for ``Client.wait`` that draws ``[state] stage [#####.....] 45%`` on stderr.

    On a terminal the line is redrawn in place; elsewhere (CI logs, pipes) one line is written per change.
    """

    def __init__(self, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self._drawn = 0
        self._last = ""

    def __call__(self, job: dict[str, Any]) -> None:
        state = str(job.get("state"))
        fraction = 1.0 if state == "succeeded" else min(max(float(job.get("progress") or 0), 0.0), 1.0)
        filled = round(self.width * fraction)
        stage = f" {job['stage']}" if job.get("stage") else ""
        line = f"[{state}]{stage} [{'#' * filled}{'.' * (self.width - filled)}] {round(100 * fraction)}%"
        if line == self._last:
            return
        self._last = line
        if not self.tty:
            print(line, file=self.stream, flush=True)
            return
        self.stream.write("\r" + line.ljust(self._drawn) + ("\n" if state in TERMINAL else ""))
        self.stream.flush()
        self._drawn = 0 if state in TERMINAL else len(line)


def _plain_name(name: str) -> bool:
    """A name a Content-Disposition header carries as it is (printable ASCII, no quote or backslash)."""
    return name.isascii() and name.isprintable() and not any(c in name for c in '"\\')


def _content_digest(path: Path) -> str:
    """RFC 9530 ``sha-256=:<base64>:`` of a file, read once before sending."""
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while chunk := src.read(_DIGEST_CHUNK):
            digest.update(chunk)
    return f"sha-256=:{base64.b64encode(digest.digest()).decode()}:"


def _raise_for_problem(response: httpx.Response) -> None:
    if not response.is_error:
        return
    try:
        body = response.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    raise ApiError(
        response.status_code,
        str(body.get("code") or f"HTTP_{response.status_code}"),
        str(body.get("detail") or response.reason_phrase or "request failed"),
        body.get("pass"),
        retry_after=_retry_after(response.headers.get("Retry-After")),
    )


def _retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: delta-seconds, or an HTTP date (RFC 9110 10.2.3)."""
    if not value:
        return None
    if value.strip().isdigit():
        return float(value.strip())
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())
