"""The blob store on an S3-compatible object store (boto3): ``storage.backend=s3``.

Same contract as core/storage.py's local store (content-addressed, a blob is visible only once complete,
anything not committed is deleted), so the API, the workers and retention use either through one
interface. Keys: ``<prefix>blobs/ab/abcdef...``; uploads in progress live under ``<prefix>tmp/``.

Writing a blob streamed from a client:

* the bytes are hashed as they arrive and sent as a multipart upload, part by part
  (``storage.s3_part_bytes``): a full part goes to a sender thread while the next one fills, at most
  ``_PARTS_IN_FLIGHT`` at once, so memory stays flat whatever the size;
* when the client declared the digest (``expected_sha256``, from its ``Content-Digest``), the parts go
  to the blob's final key and ``commit`` completes the upload there once the digest is checked (a
  mismatch aborts it: nothing appears);
* otherwise the digest is known only at the end: the parts go to a temp key, and ``commit`` completes
  the upload and copies the temp object to its final key on the server (a multipart copy above 5 GiB;
  nothing travels through this process), then deletes the temp object;
* either way the final object is written even when the blob exists already: that refreshes its
  LastModified, which retention reads as "written now" (core/retention.py's grace period protects a blob
  a new job is about to name);
* a blob smaller than one part goes up in one PUT straight to its final key.

Reading: workers download a blob into their job's local scratch directory (``copy_to``, one streamed GET);
the API redirects an artifact download to a presigned URL (``presigned_url``) and streams reports itself,
so their security headers still apply (``read_chunks``).
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from core.errors import NotFoundError, TooLargeError, UnavailableError
from core.storage import _SHA256, BlobStore, _check_sha, check_digest

if TYPE_CHECKING:
    from core.settings import StorageSettings

_READ_CHUNK = 1 << 20
# Managed transfers (put_file, copy_to, commit's copy): a few parts in flight, each s3_part_bytes.
_TRANSFER_THREADS = 2
_MAX_COPY_BYTES = 5 << 30  # S3's limit of a single-request CopyObject
# Parts of one streamed upload being sent at once: the next part fills while this one goes, so receiving
# and hashing overlap sending; each holds s3_part_bytes of memory (2 x 16 MiB by default, with the one
# filling: the 2 GiB test's RSS bound is 64 MiB).
_PARTS_IN_FLIGHT = 1
# Part senders shared by all uploads of a process (each upload is bounded by _PARTS_IN_FLIGHT).
_PART_SENDERS = 8


def _missing(exc: ClientError) -> bool:
    return exc.response.get("Error", {}).get("Code") in {"404", "NoSuchKey", "NotFound"}


def _unavailable(action: str, exc: Exception) -> UnavailableError:
    return UnavailableError(f"object storage: {action} failed ({type(exc).__name__})", code="STORAGE_UNAVAILABLE")


class S3BlobWriter:
    """One blob being streamed in. Use through ``S3BlobStore.writer()``, which aborts it unless committed.

    A full part is sent by the store's transfer threads while the caller goes on writing the next one; at
    most ``_PARTS_IN_FLIGHT`` parts are being sent at once, and the caller waits for a free slot, so memory
    stays at most (``_PARTS_IN_FLIGHT`` + 1) parts whatever the blob's size."""

    def __init__(self, store: S3BlobStore, max_bytes: int | None, expected_sha256: str | None = None) -> None:
        self._store = store
        self.max_bytes = max_bytes
        self.expected_sha256 = expected_sha256
        self.size = 0
        self._hash = hashlib.sha256()
        self._buffer = bytearray()
        # Declared digest: the parts go to the final key, where completing the upload makes the blob
        # appear at once (S3 shows no part of a multipart upload before it is completed); no copy.
        temp = f"{store.prefix}tmp/upload-{secrets.token_hex(16)}"
        self._key = store.key(expected_sha256) if expected_sha256 else temp
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._slots = threading.BoundedSemaphore(_PARTS_IN_FLIGHT)
        self._committed: str | None = None
        self._closed = False

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    @property
    def committed(self) -> bool:
        return self._committed is not None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise ValueError("blob writer is closed")
        if self.max_bytes is not None and self.size + len(data) > self.max_bytes:
            raise TooLargeError(
                f"upload exceeds the limit of {self.max_bytes} bytes",
                code="PAYLOAD_TOO_LARGE",
                detail={"limit_bytes": self.max_bytes},
            )
        self._hash.update(data)
        self.size += len(data)
        self._buffer += data
        if len(self._buffer) >= self._store.part_bytes:
            self._send_part()

    def _send_part(self) -> None:
        client, bucket = self._store.client, self._store.bucket
        if self._upload_id is None:
            try:
                self._upload_id = client.create_multipart_upload(Bucket=bucket, Key=self._key)["UploadId"]
            except (BotoCoreError, ClientError) as exc:
                raise _unavailable("upload", exc) from exc
        # A part that failed fails the upload now, rather than after the rest of the body was sent.
        failed = next((exc for p in self._parts if p.done() and (exc := p.exception()) is not None), None)
        if failed is not None:
            raise _unavailable("upload", failed) from failed
        self._slots.acquire()
        body, self._buffer = self._buffer, bytearray()
        number = len(self._parts) + 1

        def send() -> dict[str, Any]:
            try:
                response = client.upload_part(
                    Bucket=bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=body
                )
                return {"ETag": response["ETag"], "PartNumber": number}
            finally:
                self._slots.release()

        try:
            self._parts.append(self._store.part_senders.submit(send))
        except BaseException:
            self._slots.release()
            raise

    def _sent_parts(self) -> list[dict[str, Any]]:
        """Wait for every part; the first failure raises."""
        return [part.result() for part in self._parts]

    def commit(self) -> str:
        """Make the blob visible under its digest and return the digest. Idempotent."""
        if self._committed is not None:
            return self._committed
        if self._closed:
            raise ValueError("blob writer was aborted")
        sha = check_digest(self.sha256, self.expected_sha256)
        store, final = self._store, self._store.key(sha)
        try:
            if self._upload_id is None:  # smaller than one part: one PUT, no temp object
                store.client.put_object(Bucket=store.bucket, Key=final, Body=self._buffer)
            else:
                if self._buffer:
                    self._send_part()
                store.client.complete_multipart_upload(
                    Bucket=store.bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._sent_parts()},
                )
                self._upload_id = None
                if self._key != final:
                    try:
                        store.server_copy(self._key, final, self.size)
                    finally:
                        store.client.delete_object(Bucket=store.bucket, Key=self._key)
        except (BotoCoreError, ClientError) as exc:
            self.abort()
            raise _unavailable("commit", exc) from exc
        except BaseException:
            self.abort()
            raise
        self._buffer = bytearray()
        self._committed = sha
        self._closed = True
        return sha

    def abort(self) -> None:
        """Drop what was sent. Safe to call more than once and after commit (no-op then)."""
        self._closed = True
        self._buffer = bytearray()
        if self._committed is None and self._upload_id is not None:
            wait(self._parts)  # a part still being sent would otherwise outlive the abort and linger
            with contextlib.suppress(BotoCoreError, ClientError):
                self._store.client.abort_multipart_upload(
                    Bucket=self._store.bucket, Key=self._key, UploadId=self._upload_id
                )
            self._upload_id = None


class S3BlobStore(BlobStore):
    """Blobs in a bucket. ``local_tmp``: a local folder for nothing but the base class's temp directory."""

    def __init__(
        self,
        *,
        bucket: str,
        prefix: str,
        client: Any,
        local_tmp: Path,
        part_bytes: int = 16 << 20,
        presign_seconds: int = 900,
    ) -> None:
        super().__init__(local_tmp)
        self.bucket = bucket
        self.prefix = prefix
        self.client = client
        self.part_bytes = part_bytes
        self.presign_seconds = presign_seconds
        self.transfer = TransferConfig(
            multipart_threshold=part_bytes,
            multipart_chunksize=part_bytes,
            max_concurrency=_TRANSFER_THREADS,
            max_io_queue=4,
        )
        self.part_senders = ThreadPoolExecutor(_PART_SENDERS, thread_name_prefix="s3-part")

    @classmethod
    def from_settings(cls, storage: StorageSettings) -> S3BlobStore:
        assert storage.s3_bucket is not None
        secret = storage.s3_secret_access_key.get_secret_value() if storage.s3_secret_access_key else None
        client = boto3.client(
            "s3",
            endpoint_url=storage.s3_endpoint_url,
            region_name=storage.s3_region,
            aws_access_key_id=storage.s3_access_key_id,
            aws_secret_access_key=secret,
            config=Config(
                signature_version="s3v4",
                # S3-compatible servers (MinIO, Ceph, moto) are reached by path; AWS itself by virtual host.
                s3={"addressing_style": "path" if storage.s3_endpoint_url else "auto"},
                retries={"mode": "standard", "max_attempts": 5},
                # Completing or copying a multi-GB object can take minutes on the server; a shorter read
                # timeout would retry a request that is still running.
                connect_timeout=10,
                read_timeout=600,
                # Checksums only where S3 requires them: several S3-compatible servers reject the rest.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        return cls(
            bucket=storage.s3_bucket,
            prefix=storage.s3_prefix,
            client=client,
            local_tmp=storage.blobs_dir,
            part_bytes=storage.s3_part_bytes,
            presign_seconds=storage.s3_presign_seconds,
        )

    def key(self, sha256: str) -> str:
        return f"{self.prefix}blobs/{sha256[:2]}/{sha256}"

    def server_copy(self, source_key: str, dest_key: str, size: int) -> None:
        source = {"Bucket": self.bucket, "Key": source_key}
        if size < _MAX_COPY_BYTES:
            self.client.copy_object(Bucket=self.bucket, Key=dest_key, CopySource=source)
        else:  # a multipart copy, part by part on the server
            self.client.copy(source, self.bucket, dest_key, Config=self.transfer)

    # ------------------------------------------------------------------------------------------ writing

    @contextlib.contextmanager
    def writer(
        self, max_bytes: int | None = None, *, expected_size: int | None = None, expected_sha256: str | None = None
    ) -> Iterator[Any]:
        blob = S3BlobWriter(self, max_bytes, None if expected_sha256 is None else _check_sha(expected_sha256))
        try:
            yield blob
        finally:
            blob.abort()

    def put_file(self, path: Path | str, max_bytes: int | None = None) -> str:
        """Upload a local file (hashed first, then sent in parts straight to its final key)."""
        path = Path(path)
        digest = hashlib.sha256()
        size = 0
        with path.open("rb") as src:
            while chunk := src.read(_READ_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        if max_bytes is not None and size > max_bytes:
            raise TooLargeError(f"{path.name} exceeds {max_bytes} bytes", code="PAYLOAD_TOO_LARGE")
        sha = digest.hexdigest()
        try:
            self.client.upload_file(str(path), self.bucket, self.key(sha), Config=self.transfer)
        except (BotoCoreError, ClientError) as exc:
            raise _unavailable("upload", exc) from exc
        return sha

    def put_bytes(self, data: bytes) -> str:
        with self.writer() as blob:
            blob.write(data)
            return str(blob.commit())

    # ------------------------------------------------------------------------------------------ reading

    def _head(self, sha256: str) -> dict[str, Any] | None:
        try:
            return dict(self.client.head_object(Bucket=self.bucket, Key=self.key(_check_sha(sha256))))
        except ClientError as exc:
            if _missing(exc):
                return None
            raise _unavailable("lookup", exc) from exc
        except BotoCoreError as exc:
            raise _unavailable("lookup", exc) from exc

    def exists(self, sha256: str) -> bool:
        return self._head(sha256) is not None

    def path(self, sha256: str) -> Path:
        raise NotFoundError("blobs in object storage have no local path", code="BLOB_NOT_LOCAL")

    def local_path(self, sha256: str) -> Path | None:
        return None

    def copy_to(self, sha256: str, dest: Path) -> Path:
        """One streamed GET into ``dest`` (a worker's scratch). Not boto3's ranged parallel download: some
        S3-compatible servers read the whole object for every range asked, which makes that quadratic."""
        chunks = self.read_chunks(sha256)
        try:
            with dest.open("wb") as out:
                for chunk in chunks:
                    out.write(chunk)
        except (BotoCoreError, ClientError) as exc:
            dest.unlink(missing_ok=True)
            raise _unavailable("download", exc) from exc
        return dest

    def read_chunks(self, sha256: str, chunk_size: int = _READ_CHUNK) -> Iterator[bytes]:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(_check_sha(sha256)))["Body"]
        except ClientError as exc:
            if _missing(exc):
                raise NotFoundError(f"blob {sha256} is not in the store", code="BLOB_NOT_FOUND") from exc
            raise _unavailable("download", exc) from exc
        except BotoCoreError as exc:
            raise _unavailable("download", exc) from exc

        def chunks() -> Iterator[bytes]:
            with contextlib.closing(body):
                yield from body.iter_chunks(chunk_size)

        return chunks()

    def presigned_url(self, sha256: str, *, filename: str, media_type: str) -> str | None:
        if not self.exists(sha256):
            raise NotFoundError(f"blob {sha256} is not in the store", code="BLOB_NOT_FOUND")
        return str(
            self.client.generate_presigned_url(
                "get_object",
                Params={
                    "Bucket": self.bucket,
                    "Key": self.key(sha256),
                    "ResponseContentDisposition": f'attachment; filename="{filename}"',
                    "ResponseContentType": media_type,
                },
                ExpiresIn=self.presign_seconds,
            )
        )

    def open(self, sha256: str) -> int:
        raise NotFoundError("blobs in object storage have no file descriptor", code="BLOB_NOT_LOCAL")

    # -------------------------------------------------------------------------------- retention, health

    def age_seconds(self, sha256: str) -> float | None:
        head = self._head(sha256)
        if head is None:
            return None
        return (datetime.now(UTC) - head["LastModified"]).total_seconds()

    def delete(self, sha256: str) -> bool:
        if not self.exists(sha256):
            return False
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key(sha256))
        except (BotoCoreError, ClientError) as exc:
            raise _unavailable("delete", exc) from exc
        return True

    def iter_shas(self) -> Iterator[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{self.prefix}blobs/")
        for page in pages:
            for item in page.get("Contents", []):
                name = item["Key"].rsplit("/", 1)[-1]
                if _SHA256.fullmatch(name):
                    yield name

    def ping(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError) as exc:
            raise _unavailable(f"bucket {self.bucket}", exc) from exc

    def sweep_tmp(self, older_than_seconds: float) -> int:
        """Abort multipart uploads and delete temp objects left by writers that died."""
        cutoff = datetime.now(UTC) - timedelta(seconds=older_than_seconds)
        removed = 0
        tmp = f"{self.prefix}tmp/"
        try:
            uploads = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=tmp).get("Uploads", [])
            for upload in uploads:
                if upload["Initiated"] < cutoff:
                    key, upload_id = upload["Key"], upload["UploadId"]
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
                    removed += 1
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=tmp):
                for item in page.get("Contents", []):
                    if item["LastModified"] < cutoff:
                        self.client.delete_object(Bucket=self.bucket, Key=item["Key"])
                        removed += 1
        except (BotoCoreError, ClientError) as exc:
            raise _unavailable("cleanup", exc) from exc
        return removed

    def check_free_space(self, needed: int) -> None:
        """Object storage has no free-space figure to check; the bucket's quota, if any, answers on write."""


def open_blob_store(storage: StorageSettings) -> BlobStore:
    """The blob store ``storage.backend`` names."""
    if storage.backend == "s3":
        return S3BlobStore.from_settings(storage)
    return BlobStore(storage.blobs_dir)
