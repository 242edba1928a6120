"""Content-addressed blob store: every file is named by its SHA-256, under ``root/ab/abcdef...``.

Writers stream into a private temp file in ``root/tmp`` (the same file system), hash as they go, refuse
to grow past a cap, and on commit rename the file into place atomically, so a reader never sees a
partial blob and two writers of the same bytes end with one blob. Anything not committed, whatever the
reason, is deleted. Files are opened with ``O_NOFOLLOW`` and must be regular files (security.md T2).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from core.errors import InvalidInputError, NotFoundError, TooLargeError, UnavailableError

_SHA256 = re.compile(r"[0-9a-f]{64}")
_COPY_CHUNK = 1 << 20
_DIR_MODE = 0o750
_BLOB_MODE = 0o440  # blobs are immutable; group-readable so workers under another uid can share a volume


def check_digest(actual: str, expected: str | None) -> str:
    """``actual``, or DIGEST_MISMATCH when the client declared another digest for the bytes it sent."""
    if expected is not None and actual != expected:
        raise InvalidInputError(
            f"the body's SHA-256 is {actual}, not the {expected} its Content-Digest declared",
            code="DIGEST_MISMATCH",
            detail={"expected_sha256": expected, "actual_sha256": actual},
        )
    return actual


def _check_sha(sha256: str) -> str:
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise InvalidInputError(f"not a SHA-256 hex digest: {sha256!r:.80}", code="BLOB_ID_INVALID")
    return sha256


class BlobWriter:
    """One blob being written. Use through ``BlobStore.writer()``, which deletes it unless committed."""

    def __init__(self, store: BlobStore, max_bytes: int | None, expected_sha256: str | None = None) -> None:
        self._store = store
        self.max_bytes = max_bytes
        self.expected_sha256 = expected_sha256
        self.size = 0
        self._hash = hashlib.sha256()
        self._committed: str | None = None
        self.tmp_path = store.tmp_dir / f"upload-{secrets.token_hex(16)}.part"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        self._fd: int | None = os.open(self.tmp_path, flags, 0o600)

    @property
    def sha256(self) -> str:
        """The digest of the bytes written so far."""
        return self._hash.hexdigest()

    @property
    def committed(self) -> bool:
        return self._committed is not None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._fd is None:
            raise ValueError("blob writer is closed")
        if self.max_bytes is not None and self.size + len(data) > self.max_bytes:
            raise TooLargeError(
                f"upload exceeds the limit of {self.max_bytes} bytes",
                code="PAYLOAD_TOO_LARGE",
                detail={"limit_bytes": self.max_bytes},
            )
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self._hash.update(data)
        self.size += len(data)

    def commit(self) -> str:
        """Make the blob visible under its digest and return the digest. Idempotent per content."""
        if self._committed is not None:
            return self._committed
        if self._fd is None:
            raise ValueError("blob writer was aborted")
        sha = check_digest(self.sha256, self.expected_sha256)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        final = self._store._blob_path(sha)
        try:
            if final.exists():
                self.tmp_path.unlink(missing_ok=True)
                # Fresh again: retention never deletes a blob written within its grace period, so a job
                # being submitted with the same bytes as a deleted one keeps them (core/retention.py).
                os.utime(final)
            else:
                final.parent.mkdir(mode=_DIR_MODE, exist_ok=True)
                os.chmod(self.tmp_path, _BLOB_MODE)
                os.replace(self.tmp_path, final)
        except BaseException:
            self.tmp_path.unlink(missing_ok=True)
            raise
        self._committed = sha
        return sha

    def abort(self) -> None:
        """Delete the partial file. Safe to call more than once and after commit (no-op then)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._committed is None:
            self.tmp_path.unlink(missing_ok=True)


class BlobStore:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.tmp_dir = self.root / "tmp"
        self.tmp_dir.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)

    def _blob_path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    @contextlib.contextmanager
    def writer(
        self, max_bytes: int | None = None, *, expected_size: int | None = None, expected_sha256: str | None = None
    ) -> Iterator[BlobWriter]:
        """Stream a blob in; call ``commit()`` inside the block. Uncommitted bytes are deleted on exit.

        ``expected_size`` (e.g. from Content-Length) is checked against free disk space up front.
        ``expected_sha256`` (a client's Content-Digest): ``commit`` refuses other bytes (DIGEST_MISMATCH),
        and an object store writes straight to the blob's final key instead of copying it there.
        """
        if expected_size is not None:
            self.check_free_space(expected_size)
        blob = BlobWriter(self, max_bytes, None if expected_sha256 is None else _check_sha(expected_sha256))
        try:
            yield blob
        finally:
            blob.abort()

    def put_file(self, path: Path | str, max_bytes: int | None = None) -> str:
        """Copy a regular file (never through a symlink) into the store; returns its digest."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise InvalidInputError(f"cannot open {Path(path).name!r}: {exc.strerror}", code="FILE_INVALID") from exc
        with os.fdopen(fd, "rb") as src:
            if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
                raise InvalidInputError(f"{Path(path).name!r} is not a regular file", code="FILE_INVALID")
            with self.writer(max_bytes) as blob:
                while chunk := src.read(_COPY_CHUNK):
                    blob.write(chunk)
                return blob.commit()

    def put_bytes(self, data: bytes) -> str:
        with self.writer() as blob:
            blob.write(data)
            return blob.commit()

    def exists(self, sha256: str) -> bool:
        try:
            st = os.lstat(self._blob_path(_check_sha(sha256)))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode)

    def path(self, sha256: str) -> Path:
        """Path of a committed blob; a missing blob, or anything but a regular file, is not found."""
        if not self.exists(sha256):
            raise NotFoundError(f"blob {sha256} is not in the store", code="BLOB_NOT_FOUND")
        return self._blob_path(sha256)

    def local_path(self, sha256: str) -> Path | None:
        """The blob as a local file, to serve or read in place; None where blobs are not local files."""
        return self.path(sha256)

    def copy_to(self, sha256: str, dest: Path) -> Path:
        """Copy a blob to a local file (a job's scratch directory)."""
        with os.fdopen(self.open(sha256), "rb") as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, _COPY_CHUNK)
        return dest

    def read_chunks(self, sha256: str, chunk_size: int = _COPY_CHUNK) -> Iterator[bytes]:
        """The blob's bytes, a chunk at a time (NotFoundError before the first when missing)."""
        src = os.fdopen(self.open(sha256), "rb")

        def chunks() -> Iterator[bytes]:
            with src:
                while chunk := src.read(chunk_size):
                    yield chunk

        return chunks()

    def presigned_url(self, sha256: str, *, filename: str, media_type: str) -> str | None:
        """A URL the client may download the blob from directly, or None: the API serves it itself."""
        return None

    def open(self, sha256: str) -> int:
        """A read-only file descriptor of a blob, opened without following symlinks."""
        path = self.path(sha256)
        try:
            return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise NotFoundError(f"blob {sha256} is not in the store", code="BLOB_NOT_FOUND") from exc

    def age_seconds(self, sha256: str) -> float | None:
        """Seconds since the blob was last written (or re-uploaded); None when it is not in the store."""
        try:
            return time.time() - os.lstat(self._blob_path(_check_sha(sha256))).st_mtime
        except OSError:
            return None

    def delete(self, sha256: str) -> bool:
        """Remove a blob; False when it was not there. Callers check first that no job still needs it."""
        try:
            os.unlink(self._blob_path(_check_sha(sha256)))
        except FileNotFoundError:
            return False
        return True

    def iter_shas(self) -> Iterator[str]:
        """Every committed blob's digest (for the purge's sweep of files no job references)."""
        for prefix in os.scandir(self.root):
            if len(prefix.name) != 2 or not prefix.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(prefix.path):
                if _SHA256.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    yield entry.name

    def ping(self) -> None:
        """Check the store is writable (a probe file in tmp/ is created and deleted)."""
        try:
            self.tmp_dir.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
            probe = self.tmp_dir / f"ping-{secrets.token_hex(8)}"
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, b"ok")
            finally:
                os.close(fd)
                probe.unlink(missing_ok=True)
        except OSError as exc:
            raise UnavailableError(f"blob storage is not writable: {exc.strerror}", code="STORAGE_UNAVAILABLE") from exc

    def sweep_tmp(self, older_than_seconds: float) -> int:
        """Delete temp files left by crashed writers; returns how many went."""
        cutoff = time.time() - older_than_seconds
        removed = 0
        for entry in os.scandir(self.tmp_dir):
            try:
                if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed += 1
            except OSError:
                continue
        return removed

    def check_free_space(self, needed: int) -> None:
        free = shutil.disk_usage(self.tmp_dir).free
        if needed > free:
            raise UnavailableError(f"not enough free disk space for {needed} bytes", code="INSUFFICIENT_STORAGE")
