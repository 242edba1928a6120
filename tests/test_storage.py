"""BlobStore: streamed, hashed, capped writes that leave either a whole blob or nothing."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from core.errors import InvalidInputError, NotFoundError, TooLargeError
from core.storage import BlobStore


@pytest.fixture
def blobs(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")


def _tmp_files(blobs: BlobStore) -> list[str]:
    return os.listdir(blobs.tmp_dir)


def test_writer_commits_blob_under_its_sha256_when_streamed_in_chunks(blobs: BlobStore) -> None:
    chunks = [b"a" * 1000, b"b" * 70_000, b"", b"c"]
    with blobs.writer(max_bytes=1 << 20) as blob:
        for chunk in chunks:
            blob.write(chunk)
        sha = blob.commit()
    expected = hashlib.sha256(b"".join(chunks)).hexdigest()
    assert sha == expected
    assert blobs.path(sha) == blobs.root / sha[:2] / sha
    assert blobs.path(sha).read_bytes() == b"".join(chunks)
    assert blobs.exists(sha)
    assert _tmp_files(blobs) == []


def test_writer_raises_too_large_and_deletes_partial_file_when_cap_exceeded(blobs: BlobStore) -> None:
    with pytest.raises(TooLargeError) as info, blobs.writer(max_bytes=100) as blob:
        blob.write(b"x" * 60)
        assert len(_tmp_files(blobs)) == 1
        blob.write(b"x" * 60)
    assert info.value.code == "PAYLOAD_TOO_LARGE"
    assert _tmp_files(blobs) == []


def test_writer_deletes_partial_file_when_block_raises(blobs: BlobStore) -> None:
    with pytest.raises(RuntimeError), blobs.writer() as blob:
        blob.write(b"partial")
        raise RuntimeError("client went away")
    assert _tmp_files(blobs) == []
    assert not blobs.exists(hashlib.sha256(b"partial").hexdigest())


def test_writer_leaves_nothing_when_not_committed(blobs: BlobStore) -> None:
    with blobs.writer() as blob:
        blob.write(b"never committed")
    assert _tmp_files(blobs) == []
    assert not blobs.exists(hashlib.sha256(b"never committed").hexdigest())


def test_commit_is_idempotent_when_blob_already_exists(blobs: BlobStore) -> None:
    first = blobs.put_bytes(b"same bytes")
    second = blobs.put_bytes(b"same bytes")
    assert first == second
    assert blobs.path(first).read_bytes() == b"same bytes"
    assert _tmp_files(blobs) == []


def test_put_file_copies_and_hashes_regular_file(blobs: BlobStore, tmp_path: Path) -> None:
    source = tmp_path / "model.onnx"
    source.write_bytes(os.urandom(3 << 20))
    sha = blobs.put_file(source)
    assert sha == hashlib.sha256(source.read_bytes()).hexdigest()
    assert blobs.path(sha).read_bytes() == source.read_bytes()


def test_put_file_refuses_symlink(blobs: BlobStore, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("canary")
    link = tmp_path / "model.onnx"
    link.symlink_to(secret)
    with pytest.raises(InvalidInputError):
        blobs.put_file(link)


@pytest.mark.parametrize("bad", ["", "abc", "../" + "a" * 61, "A" * 64, "g" * 64, "a" * 63 + "/", "a" * 65])
def test_path_refuses_bad_sha_when_not_64_lowercase_hex(blobs: BlobStore, bad: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        blobs.path(bad)
    assert info.value.code == "BLOB_ID_INVALID"


def test_path_raises_not_found_when_blob_missing(blobs: BlobStore) -> None:
    with pytest.raises(NotFoundError) as info:
        blobs.path("0" * 64)
    assert info.value.code == "BLOB_NOT_FOUND"


def test_path_raises_not_found_when_blob_is_a_symlink(blobs: BlobStore, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("canary")
    sha = hashlib.sha256(b"canary").hexdigest()
    (blobs.root / sha[:2]).mkdir()
    (blobs.root / sha[:2] / sha).symlink_to(secret)
    with pytest.raises(NotFoundError):
        blobs.path(sha)


def test_ping_passes_when_writable_and_leaves_nothing(blobs: BlobStore) -> None:
    blobs.ping()
    assert _tmp_files(blobs) == []


def test_sweep_tmp_removes_only_old_temp_files(blobs: BlobStore) -> None:
    old = blobs.tmp_dir / "upload-old.part"
    old.write_bytes(b"x")
    os.utime(old, (1, 1))
    fresh = blobs.tmp_dir / "upload-fresh.part"
    fresh.write_bytes(b"y")
    assert blobs.sweep_tmp(3600) == 1
    assert _tmp_files(blobs) == ["upload-fresh.part"]
