"""The S3 blob store (core/objectstore.py) against a real S3-compatible server: moto's server mode, started
here as a subprocess on a free port (``moto[server]`` from PyPI), one bucket per test."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import psutil
import pytest

from core.errors import InvalidInputError, NotFoundError, TooLargeError
from core.objectstore import S3BlobStore, open_blob_store
from core.retention import purge
from core.settings import RetentionSettings
from core.store import JobStore
from tests.s3server import s3_endpoint, s3_settings

__all__ = ["s3_endpoint"]  # the session fixture, imported so pytest finds it here

PART = 5 << 20  # S3's smallest multipart part


@pytest.fixture
def s3(s3_endpoint: str, tmp_path: Path) -> S3BlobStore:
    store = open_blob_store(s3_settings(s3_endpoint, tmp_path, s3_part_bytes=PART))
    assert isinstance(store, S3BlobStore)
    return store


def _keys(store: S3BlobStore, under: str = "") -> list[str]:
    listed = store.client.list_objects_v2(Bucket=store.bucket, Prefix=f"{store.prefix}{under}")
    return [item["Key"] for item in listed.get("Contents", [])]


def _uploads_in_progress(store: S3BlobStore) -> list[dict]:
    return list(store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []))


def _read(store: S3BlobStore, sha: str) -> bytes:
    return b"".join(store.read_chunks(sha))


@pytest.mark.integration
@pytest.mark.parametrize("size", [1000, 2 * PART + 123], ids=["one-put", "multipart"])
def test_s3_writer_commits_blob_under_its_digest_when_streamed(s3: S3BlobStore, size: int) -> None:
    data = os.urandom(size)
    with s3.writer() as blob:
        for start in range(0, size, 1 << 20):
            blob.write(data[start : start + (1 << 20)])
        sha = blob.commit()

    assert sha == hashlib.sha256(data).hexdigest()
    assert s3.exists(sha) and _read(s3, sha) == data
    assert _keys(s3) == [s3.key(sha)]  # no temp object left
    assert _uploads_in_progress(s3) == []


@pytest.mark.integration
def test_s3_writer_leaves_nothing_when_upload_fails_or_exceeds_cap(s3: S3BlobStore) -> None:
    with pytest.raises(RuntimeError), s3.writer() as blob:
        blob.write(os.urandom(PART + 10))  # one part already sent
        raise RuntimeError("client went away")
    with pytest.raises(TooLargeError), s3.writer(max_bytes=PART) as capped:
        capped.write(os.urandom(PART))
        capped.write(b"x")

    assert _keys(s3) == []
    assert _uploads_in_progress(s3) == []


@pytest.mark.integration
def test_s3_writer_sends_parts_to_the_final_key_when_digest_declared(s3: S3BlobStore) -> None:
    data = os.urandom(3 * PART + 5)
    sha = hashlib.sha256(data).hexdigest()
    with s3.writer(expected_sha256=sha) as blob:
        for start in range(0, len(data), 1 << 20):
            blob.write(data[start : start + (1 << 20)])
            # Parts go to the blob's own key: nothing under tmp/, nothing visible before commit.
            assert {u["Key"] for u in _uploads_in_progress(s3)} <= {s3.key(sha)}
            assert _keys(s3) == []
        assert blob.commit() == sha

    assert _read(s3, sha) == data
    assert _keys(s3) == [s3.key(sha)]
    assert _uploads_in_progress(s3) == []


@pytest.mark.integration
def test_s3_writer_leaves_nothing_when_declared_digest_differs(s3: S3BlobStore) -> None:
    data = os.urandom(2 * PART + 1)
    declared = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(InvalidInputError) as refused, s3.writer(expected_sha256=declared) as blob:
        blob.write(data)
        blob.commit()

    assert refused.value.code == "DIGEST_MISMATCH"
    assert _keys(s3) == []
    assert _uploads_in_progress(s3) == []


@pytest.mark.integration
def test_s3_store_puts_copies_presigns_and_deletes_when_asked(s3: S3BlobStore, tmp_path: Path) -> None:
    source = tmp_path / "model.onnx"
    source.write_bytes(os.urandom(PART + 77))
    sha = s3.put_file(source)

    copied = s3.copy_to(sha, tmp_path / "copy.onnx")
    url = s3.presigned_url(sha, filename="m.optimized.onnx", media_type="application/octet-stream")
    assert url is not None
    fetched = httpx.get(url, timeout=30)

    assert copied.read_bytes() == source.read_bytes()
    assert fetched.status_code == 200 and fetched.content == source.read_bytes()
    assert fetched.headers["content-disposition"] == 'attachment; filename="m.optimized.onnx"'
    assert list(s3.iter_shas()) == [sha]
    age = s3.age_seconds(sha)
    assert age is not None and age < 60
    assert s3.delete(sha) and not s3.exists(sha) and not s3.delete(sha)
    with pytest.raises(NotFoundError):
        s3.copy_to(sha, tmp_path / "gone.onnx")


@pytest.mark.integration
def test_purge_deletes_a_jobs_objects_from_the_object_store_when_its_retention_passed(
    s3: S3BlobStore, tmp_path: Path
) -> None:
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    store.create_schema()
    model = s3.put_bytes(b"model bytes")
    job = store.create(
        tenant="t", model_sha256=model, model_filename="m.onnx", model_format="onnx", model_size=11,
        samples_sha256=None, config={}, queue="cpu",
    )  # fmt: skip
    claimed = store.claim(job.id, "w", 60, max_attempts=3)
    assert claimed is not None
    store.succeed(
        job.id, claimed.attempts, artifact_sha256=s3.put_bytes(b"artifact"), artifact_format="onnx",
        report_sha256=s3.put_bytes(b"{}"), report_html_sha256=s3.put_bytes(b"<html>"), summary={}, timings={},
    )  # fmt: skip
    assert len(_keys(s3, "blobs/")) == 4

    stats = purge(
        store, s3, RetentionSettings(jobs_days=1, blob_grace_seconds=0), now=datetime.now(UTC) + timedelta(days=2)
    )

    assert (stats.jobs_deleted, stats.blobs_deleted) == (1, 4)
    assert _keys(s3) == []
    store.close()


@pytest.mark.integration
@pytest.mark.slow
def test_s3_store_round_trips_a_2gb_model_when_memory_grows_under_64mb(s3_endpoint: str, tmp_path: Path) -> None:
    """2 GiB streamed in (as an upload is) and fetched back to disk (as a worker does), with flat memory, at
    the default part size (storage.s3_part_bytes, 16 MiB)."""
    s3 = open_blob_store(s3_settings(s3_endpoint, tmp_path, s3_part_bytes=16 << 20))
    size, chunk = 2 << 30, 1 << 20
    block = os.urandom(chunk)
    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.02):
            peak = max(peak, process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    expected = hashlib.sha256()
    started = time.monotonic()
    try:
        with s3.writer() as blob:
            for i in range(size // chunk):
                piece = i.to_bytes(8, "little") + block[8:]  # every MiB differs
                expected.update(piece)
                blob.write(piece)
            sha = blob.commit()
        upload_seconds = time.monotonic() - started
        fetched = s3.copy_to(sha, tmp_path / "fetched.onnx")
        got = hashlib.sha256()
        with fetched.open("rb") as f:
            while data := f.read(chunk):
                got.update(data)
    finally:
        done.set()
        sampler.join()

    assert sha == expected.hexdigest() == got.hexdigest()
    assert fetched.stat().st_size == size
    growth = peak - baseline
    print(f"2 GiB: upload {size / upload_seconds / 1e6:.0f} MB/s into moto, RSS growth {growth / 2**20:.1f} MiB")
    assert growth < 64 << 20
