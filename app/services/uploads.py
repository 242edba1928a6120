"""Receive ``POST /v1/jobs``: the body streamed into the blob store, never held whole in memory.

Two forms. The fast one, ``application/octet-stream``, is the model alone: its bytes go straight into a
size-capped ``BlobWriter`` (hashed as written), the config rides in the ``Onnxforge-Config`` header, the
file name in ``Content-Disposition`` and, optionally, the digest in ``Content-Digest`` (RFC 9530), which
an object store uses to write the model to its final key at once. The multipart form
(``multipart/form-data``, fields ``model``, ``samples``, ``config``) is the one that carries samples.
Starlette's ``request.form()`` spools parts itself; we feed ``request.stream()`` to python-multipart's
streaming ``MultipartParser`` instead, so each part goes straight into a size-capped ``BlobWriter``.
Either way a rejected upload leaves no file behind (security.md T12):

* at most the fields ``model``, ``samples`` and ``config``, each once; anything else is refused at its
  headers, before its data is read (UNKNOWN_FIELD / DUPLICATE_FIELD);
* per-field caps (``max_upload_bytes``, ``max_samples_bytes``, ``max_config_bytes``) counted while
  streaming, plus a cap on the whole body that a ``Content-Length`` is checked against up front;
* parsing, hashing and writing run in a worker thread, a batch of ``_BATCH_BYTES`` at a time
  (``_Batches``), so they never block the event loop;
* at most ``api.max_concurrent_uploads_per_tenant`` uploads per tenant in flight (``UploadSlots``), else
  429 TOO_MANY_UPLOADS with Retry-After; the slot is taken before any byte of the body is read;
* free disk space is checked up front against ``Content-Length``, and for a chunked body before each
  batch is written (503 INSUFFICIENT_STORAGE, not a failed write).

The blobs stay uncommitted (temp files) until the job service has validated the config and calls
``Upload.commit()``; leaving the ``Upload`` context without committing deletes them.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import PurePosixPath
from typing import Literal

import anyio
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from core.errors import ErrorKind, InvalidInputError, InvalidModelError, OnnxforgeError, TooLargeError
from core.settings import ApiSettings
from core.storage import BlobStore, BlobWriter, check_digest

ModelFormat = Literal["onnx", "zip", "tar"]

FIELDS = ("model", "samples", "config")
# Boundaries, part headers and the like, on top of the three fields' caps.
MULTIPART_OVERHEAD = 64 << 10
MULTIPART_MEDIA = b"multipart/form-data"
RAW_MEDIA = b"application/octet-stream"
CONFIG_HEADER = "onnxforge-config"
# Bytes handed to the worker thread at a time (uvicorn delivers the body in pieces of 64-256 KiB).
_BATCH_BYTES = 1 << 20
_HEAD_BYTES = 512
_MAX_FILENAME = 255
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_GZIP_MAGIC = b"\x1f\x8b"
# After refusing a body we read on a little, discarding, so the client is not reset mid-send and gets to
# read our answer; beyond this the connection is closed instead.
_DRAIN_BYTES = 8 << 20
_DRAIN_SECONDS = 2.0
_SLOT_RETRY_AFTER_SECONDS = 5


class TooManyUploadsError(OnnxforgeError):
    code = "TOO_MANY_UPLOADS"
    kind = ErrorKind.RATE_LIMITED


class UploadSlots:
    """Uploads in flight per tenant, capped. The count lives in this process: with several API processes
    (uvicorn workers, replicas) a tenant can have that many times ``limit`` uploads in flight."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, tenant: str) -> Iterator[None]:
        """One slot for the duration of the block; raises TooManyUploadsError when all are taken."""
        with self._lock:
            taken = self._in_flight.get(tenant, 0)
            if taken >= self.limit:
                raise TooManyUploadsError(
                    f"{taken} uploads of this tenant are already in progress (limit {self.limit}); retry when "
                    "one has finished",
                    detail={"limit": self.limit, "retry_after": _SLOT_RETRY_AFTER_SECONDS},
                )
            self._in_flight[tenant] = taken + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._in_flight[tenant] - 1
                if left:
                    self._in_flight[tenant] = left
                else:
                    del self._in_flight[tenant]


@dataclasses.dataclass(frozen=True)
class UploadLimits:
    model_bytes: int
    samples_bytes: int
    config_bytes: int

    @classmethod
    def from_settings(cls, api: ApiSettings) -> UploadLimits:
        return cls(api.max_upload_bytes, api.max_samples_bytes, api.max_config_bytes)

    @property
    def body_bytes(self) -> int:
        return self.model_bytes + self.samples_bytes + self.config_bytes + MULTIPART_OVERHEAD


@dataclasses.dataclass
class ReceivedFile:
    field: str
    filename: str
    size: int
    sha256: str
    format: str
    writer: BlobWriter


class Upload:
    """The parsed body. Blobs are temp files until ``commit()``; closing without it deletes them."""

    def __init__(
        self,
        model: ReceivedFile,
        samples: ReceivedFile | None,
        config: bytes | None,
        stack: contextlib.ExitStack,
    ) -> None:
        self.model = model
        self.samples = samples
        self.config = config
        self._stack = stack

    def commit(self) -> None:
        self.model.writer.commit()
        if self.samples is not None:
            self.samples.writer.commit()

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def detect_model_format(filename: str, head: bytes) -> ModelFormat:
    """Archive or plain model, from the magic bytes; a known suffix must agree with them."""
    if head.startswith(_GZIP_MAGIC):
        raise InvalidModelError(
            "compressed uploads are not accepted; send an .onnx, a .zip or an uncompressed .tar",
            code="MODEL_FORMAT_UNSUPPORTED",
        )
    if head.startswith(_ZIP_MAGIC):
        sniffed: ModelFormat = "zip"
    elif head[257:262] == b"ustar":
        sniffed = "tar"
    else:
        sniffed = "onnx"
    claimed = {".onnx": "onnx", ".zip": "zip", ".tar": "tar"}.get(PurePosixPath(filename).suffix.lower())
    if claimed is not None and claimed != sniffed:
        raise InvalidModelError(
            f"the file name says {claimed} but the content is {sniffed}", code="MODEL_FORMAT_MISMATCH"
        )
    return sniffed


def _client_filename(raw: bytes | None, default: str) -> str:
    """The client's name, reduced to a base name without control characters: metadata only."""
    if not raw:
        return default
    name = raw.decode("utf-8", errors="replace").replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if ch.isprintable()).strip()
    return name[:_MAX_FILENAME] or default


class _Sink:
    """The parser callbacks: route each part to a blob writer or a small buffer, enforcing the rules."""

    def __init__(self, blobs: BlobStore, limits: UploadLimits, stack: contextlib.ExitStack) -> None:
        self._blobs = blobs
        self._limits = limits
        self._stack = stack
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._field: str | None = None
        self._filename = ""
        self._writer: BlobWriter | None = None
        self._head = bytearray()
        self._config = bytearray()
        self.seen: set[str] = set()
        self.files: dict[str, ReceivedFile] = {}
        self.config: bytes | None = None
        self.ended = False

    def callbacks(self) -> dict[str, Callable[..., None]]:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda d, s, e: self._header_name.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self._header_value.extend(d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def _part_begin(self) -> None:
        self._headers.clear()
        self._field = None
        self._writer = None
        self._head.clear()

    def _header_end(self) -> None:
        self._headers[bytes(self._header_name).strip().lower()] = bytes(self._header_value).strip()
        self._header_name.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        disposition, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        if disposition != b"form-data":
            raise InvalidInputError("each part needs Content-Disposition: form-data", code="MULTIPART_INVALID")
        field = params.get(b"name", b"").decode("utf-8", errors="replace")
        if field not in FIELDS:
            raise InvalidInputError(
                f"unknown field {field[:64]!r}; accepted fields: {', '.join(FIELDS)}",
                code="UNKNOWN_FIELD",
                detail={"field": field[:64], "accepted": list(FIELDS)},
            )
        if field in self.seen:
            raise InvalidInputError(f"field {field!r} given twice", code="DUPLICATE_FIELD")
        self.seen.add(field)
        self._field = field
        if field == "config":
            return
        self._filename = _client_filename(params.get(b"filename"), default=field)
        cap = self._limits.model_bytes if field == "model" else self._limits.samples_bytes
        self._writer = self._stack.enter_context(self._blobs.writer(cap))

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = memoryview(data)[start:end]
        if self._field == "config":
            if len(self._config) + len(chunk) > self._limits.config_bytes:
                raise TooLargeError(
                    f"config exceeds the limit of {self._limits.config_bytes} bytes",
                    code="PAYLOAD_TOO_LARGE",
                    detail={"field": "config", "limit_bytes": self._limits.config_bytes},
                )
            self._config.extend(chunk)
            return
        if self._writer is None:  # data before headers finished cannot happen; guard anyway
            raise InvalidInputError("malformed multipart body", code="MULTIPART_INVALID")
        if len(self._head) < _HEAD_BYTES:
            self._head.extend(chunk[: _HEAD_BYTES - len(self._head)])
        try:
            self._writer.write(chunk)
        except TooLargeError as exc:
            exc.detail = {"field": self._field, **exc.detail}
            exc.message = f"{self._field} {exc.message}"
            raise

    def _part_end(self) -> None:
        field, writer = self._field, self._writer
        if field == "config":
            self.config = bytes(self._config) or None
        elif field is not None and writer is not None and writer.size > 0:
            if field == "model":
                fmt: str = detect_model_format(self._filename, bytes(self._head))
            else:
                if not bytes(self._head).startswith(_ZIP_MAGIC):
                    raise InvalidInputError(
                        "samples must be an .npz file (a zip of .npy arrays)", code="SAMPLES_INVALID"
                    )
                fmt = "npz"
            self.files[field] = ReceivedFile(field, self._filename, writer.size, writer.sha256, fmt, writer)
        self._field = None
        self._writer = None

    def _end(self) -> None:
        self.ended = True


def _media_type(content_type: str | None) -> tuple[bytes, dict[bytes, bytes]]:
    media, params = parse_options_header(content_type or "")
    if media == MULTIPART_MEDIA and params.get(b"boundary"):
        return media, params
    if media == RAW_MEDIA:
        return media, params
    raise InvalidInputError(
        "the body must be multipart/form-data with a boundary (fields model, samples, config), or the model "
        "alone as application/octet-stream (config in the Onnxforge-Config header)",
        code="MULTIPART_REQUIRED",
    )


def parse_content_digest(value: str | None) -> str | None:
    """The SHA-256 (hex) of an RFC 9530 ``Content-Digest: sha-256=:<base64>:``; None without one.

    Other algorithms are ignored (the RFC lets a recipient ignore what it does not use)."""
    if not value:
        return None
    for member in value.split(","):
        name, _, raw = member.strip().partition("=")
        if name.strip().lower() != "sha-256":
            continue
        raw = raw.strip()
        try:
            digest = base64.b64decode(raw[1:-1], validate=True) if raw[:1] == raw[-1:] == ":" else b""
        except binascii.Error:
            digest = b""
        if len(digest) != 32:
            raise InvalidInputError(
                "Content-Digest's sha-256 must be the 32-byte digest in base64 between colons: sha-256=:...:",
                code="DIGEST_INVALID",
            )
        return digest.hex()
    return None


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    received = 0
    with anyio.move_on_after(_DRAIN_SECONDS):
        async for chunk in chunks:
            received += len(chunk)
            if received > _DRAIN_BYTES:
                break


class _Batches:
    """Hands the body to a worker thread in batches of ``_BATCH_BYTES``, one at a time, so hashing,
    writing and parsing never block the event loop. One at a time, not overlapped with receiving: on a
    machine whose CPUs are busy, a second busy thread in the API process fought the event loop for the GIL
    and uploads got slower (bench/README.md); the socket's buffer holds what arrives meanwhile."""

    def __init__(self, consume: Callable[[list[bytes]], None]) -> None:
        self._consume = consume
        self._batch: list[bytes] = []
        self.batch_bytes = 0
        self._started = False

    def add(self, chunk: bytes) -> bool:
        """Queue a chunk; True when the batch should be flushed: full, or the body's first chunk (so a
        multipart body's first part headers are judged before more of it is read)."""
        self._batch.append(chunk)
        self.batch_bytes += len(chunk)
        if not self._started:
            self._started = True
            return True
        return self.batch_bytes >= _BATCH_BYTES

    async def flush(self) -> None:
        if self._batch:
            batch, self._batch, self.batch_bytes = self._batch, [], 0
            # Each hand-over costs two thread switches: a batch, not a chunk, at a time. Not cancellable
            # midway (to_thread's default), so a writer is never closed under a write in progress.
            await anyio.to_thread.run_sync(self._consume, batch)


class _RawSink:
    """The consumer of a raw (``application/octet-stream``) body: all of it is the model."""

    def __init__(self, writer: BlobWriter) -> None:
        self.writer = writer
        self.head = bytearray()

    def __call__(self, batch: list[bytes]) -> None:
        for chunk in batch:
            if len(self.head) >= _HEAD_BYTES:
                break
            self.head.extend(chunk[: _HEAD_BYTES - len(self.head)])
        try:
            for chunk in batch:  # as received: no copy on the way to the file
                self.writer.write(chunk)
        except TooLargeError as exc:
            exc.detail = {"field": "model", **exc.detail}
            exc.message = f"model {exc.message}"
            raise


def _raw_config(value: str | None, limits: UploadLimits) -> bytes | None:
    if value is None:
        return None
    raw = value.encode("latin-1", errors="replace")
    if len(raw) > limits.config_bytes:
        raise TooLargeError(
            f"config exceeds the limit of {limits.config_bytes} bytes",
            code="PAYLOAD_TOO_LARGE",
            detail={"field": "config", "limit_bytes": limits.config_bytes},
        )
    return raw or None


async def _pump(
    batches: _Batches, chunks: AsyncIterator[bytes], cap: int, expected: int | None, blobs: BlobStore
) -> None:
    received = 0
    async for chunk in chunks:
        received += len(chunk)
        if received > cap:
            # What was received within the cap is parsed first: a body refused for what its first fields
            # hold (a repeated or unknown field) says so, whether or not its batch had filled.
            await batches.flush()
            raise TooLargeError(
                f"request body exceeds the limit of {cap} bytes",
                code="PAYLOAD_TOO_LARGE",
                detail={"limit_bytes": cap},
            )
        if batches.add(chunk):
            if expected is None:  # chunked: no up-front check was possible
                blobs.check_free_space(batches.batch_bytes)
            await batches.flush()
    await batches.flush()


async def receive_upload(
    blobs: BlobStore,
    *,
    headers: Mapping[str, str],
    chunks: AsyncIterator[bytes],
    limits: UploadLimits,
    slot: contextlib.AbstractContextManager[object] | None = None,
) -> Upload:
    """Parse the body into uncommitted blobs and the raw config; raise OnnxforgeError when refused.

    ``headers``: the request's (case-insensitive). ``multipart/form-data``: the fields ``model``,
    ``samples`` and ``config``. ``application/octet-stream``: the body is the model, named by
    ``Content-Disposition: attachment; filename="..."``, with the config in ``Onnxforge-Config`` and
    optionally its digest in ``Content-Digest`` (a mismatch answers 422 DIGEST_MISMATCH, and lets an
    object store write the model straight to its final key).

    ``slot`` (``UploadSlots.hold(tenant)``) is entered before anything else and held until the returned
    ``Upload`` is closed, or released at once when the upload is refused.
    """
    stack = contextlib.ExitStack()
    try:
        if slot is not None:
            stack.enter_context(slot)
        media, params = _media_type(headers.get("content-type"))
        raw = media == RAW_MEDIA
        cap = limits.model_bytes if raw else limits.body_bytes
        expected: int | None = None
        content_length = headers.get("content-length")
        if content_length is not None:
            try:
                expected = int(content_length)
            except ValueError:
                raise InvalidInputError("Content-Length is not a number", code="REQUEST_INVALID") from None
            if expected > cap:
                raise TooLargeError(
                    f"request body of {expected} bytes exceeds the limit of {cap} bytes",
                    code="PAYLOAD_TOO_LARGE",
                    detail={"limit_bytes": cap},
                )
            blobs.check_free_space(expected)
        if raw:
            return await _receive_raw(
                blobs, headers=headers, chunks=chunks, limits=limits, cap=cap, expected=expected, stack=stack
            )
        sink = _Sink(blobs, limits, stack)
        parser = MultipartParser(params[b"boundary"], callbacks=sink.callbacks())  # type: ignore[arg-type]
        # The parser costs a Python call per piece it finds: one joined batch, not each chunk.
        await _pump(_Batches(lambda batch: parser.write(b"".join(batch))), chunks, cap, expected, blobs)
        parser.finalize()
        if not sink.ended:
            raise InvalidInputError("the multipart body ended before its closing boundary", code="MULTIPART_INVALID")
        model = sink.files.get("model")
        if model is None:
            raise InvalidInputError(
                "no model: send the .onnx (or .zip/.tar) file in the multipart field 'model'",
                code="MODEL_MISSING",
            )
        return Upload(model, sink.files.get("samples"), sink.config, stack)
    except BaseException as exc:
        stack.close()
        if isinstance(exc, FormParserError):
            await _drain(chunks)
            raise InvalidInputError(f"malformed multipart body: {exc}", code="MULTIPART_INVALID") from None
        if isinstance(exc, OnnxforgeError):
            await _drain(chunks)
        raise


async def _receive_raw(
    blobs: BlobStore,
    *,
    headers: Mapping[str, str],
    chunks: AsyncIterator[bytes],
    limits: UploadLimits,
    cap: int,
    expected: int | None,
    stack: contextlib.ExitStack,
) -> Upload:
    config = _raw_config(headers.get(CONFIG_HEADER), limits)
    digest = parse_content_digest(headers.get("content-digest"))
    _, params = parse_options_header(headers.get("content-disposition") or "")
    filename = _client_filename(params.get(b"filename"), default="model")
    writer = stack.enter_context(blobs.writer(limits.model_bytes, expected_sha256=digest))
    sink = _RawSink(writer)
    await _pump(_Batches(sink), chunks, cap, expected, blobs)
    if writer.size == 0:
        raise InvalidInputError("no model: the body is empty", code="MODEL_MISSING")
    fmt = detect_model_format(filename, bytes(sink.head))
    check_digest(writer.sha256, digest)  # refused here, before the job service sees it
    model = ReceivedFile("model", filename, writer.size, writer.sha256, fmt, writer)
    return Upload(model, None, config, stack)
