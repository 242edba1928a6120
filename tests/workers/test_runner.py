"""runner.run_job end to end, in-process (no Celery), with a real child process and a real SQLite job store.

Faults are injected in the child through the test-only ``ONNXFORGE_TEST_CHILD_FAULT`` variable (see
workers/child.py); everything else is the production path.
"""

from __future__ import annotations

import io
import tarfile
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.settings import Settings
from core.storage import BlobStore
from core.store import JobStore
from workers.archive import extract_archive
from workers.child import FAULT_ENV
from workers.runner import classify_exit, deterministic_zip, prune_attempt_dirs, run_job

MODEL = Path(__file__).resolve().parents[1] / "models" / "mlp_cleanup.onnx"
FAST = {"benchmark_warmup": 1, "benchmark_min_runs": 3, "benchmark_max_seconds": 0.3, "ledger_runs": 2}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        storage={"data_dir": tmp_path / "data"},
        worker={"lease_seconds": 30, "child_memory_mb": 2048},
        pipeline=FAST,
    )


@pytest.fixture
def store(settings: Settings) -> JobStore:
    s = JobStore(settings.database_url)
    s.create_schema()
    return s


@pytest.fixture
def blobs(settings: Settings) -> BlobStore:
    return BlobStore(settings.storage.blobs_dir)


def _submit(store: JobStore, blobs: BlobStore, path: Path = MODEL, fmt: str = "onnx", **config: Any) -> str:
    job = store.create(
        tenant="t",
        model_sha256=blobs.put_file(path),
        model_filename=path.name,
        model_format=fmt,
        model_size=path.stat().st_size,
        samples_sha256=None,
        config={"rollback_slower": False, **config},
        queue="cpu",
    )
    return job.id


def _blob_count(blobs: BlobStore) -> int:
    return sum(1 for p in blobs.root.glob("??/*") if p.is_file())


def _run_in_thread(job_id: str, settings: Settings, store: JobStore, blobs: BlobStore) -> threading.Thread:
    thread = threading.Thread(target=run_job, args=(job_id, settings, store, blobs), daemon=True)
    thread.start()
    return thread


def _wait_state(store: JobStore, job_id: str, state: str, timeout: float = 30.0, stage: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = store.get(job_id)
        if job.state == state and (stage is None or job.stage == stage):
            return
        time.sleep(0.1)
    raise AssertionError(f"job did not reach {state}/{stage}: {store.get(job_id)}")


# ---------------------------------------------------------------------------------------------- success


def test_run_job_commits_artifact_and_reports_once_when_delivered_twice(settings, store, blobs):
    job_id = _submit(store, blobs)

    run_job(job_id, settings, store, blobs)
    job = store.get(job_id)
    assert job.state == "succeeded", (job.error_code, job.error_message)
    assert job.attempts == 1
    assert job.artifact_format == "onnx"
    model = onnx.load(str(blobs.path(job.artifact_sha256)))
    assert len(model.graph.node) < len(onnx.load(str(MODEL)).graph.node)
    assert blobs.exists(job.report_sha256)
    assert blobs.exists(job.report_html_sha256)
    assert job.timings and "materialize" in job.timings
    blobs_after_first = _blob_count(blobs)

    run_job(job_id, settings, store, blobs)  # a duplicate delivery

    again = store.get(job_id)
    assert (again.state, again.attempts, again.artifact_sha256) == ("succeeded", 1, job.artifact_sha256)
    assert _blob_count(blobs) == blobs_after_first
    assert not (settings.storage.work_dir / job_id).exists()


def test_run_job_is_noop_when_delivered_while_another_attempt_runs(settings, store, blobs, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "sleep:3")
    job_id = _submit(store, blobs)
    thread = _run_in_thread(job_id, settings, store, blobs)
    _wait_state(store, job_id, "running", stage="fault-injection")

    run_job(job_id, settings, store, blobs)  # lease is live: claim must refuse

    assert store.get(job_id).attempts == 1
    thread.join(30)


# ---------------------------------------------------------------------------------------------- faults


@pytest.mark.parametrize(
    "case",
    [
        ("segv", "MODEL_CRASHED"),
        ("abort", "MODEL_CRASHED"),
        ("kill", "RESOURCE_LIMIT_EXCEEDED"),
        ("oom", "RESOURCE_LIMIT_EXCEEDED"),
        ("exit:3", "INTERNAL_ERROR"),
    ],
)
def test_run_job_fails_classified_when_child_dies(settings, store, blobs, monkeypatch, case):
    fault, code = case
    monkeypatch.setenv(FAULT_ENV, fault)
    settings = settings.model_copy(update={"worker": settings.worker.model_copy(update={"child_memory_mb": 512})})
    job_id = _submit(store, blobs)
    blobs_before = _blob_count(blobs)

    run_job(job_id, settings, store, blobs)  # returns: the worker survives the child's death

    job = store.get(job_id)
    assert (job.state, job.error_code) == ("failed", code), job.error_message
    assert job.artifact_sha256 is None
    assert _blob_count(blobs) == blobs_before
    assert not (settings.storage.work_dir / job_id).exists()


def test_run_job_cancels_when_cancel_requested_mid_run(settings, store, blobs, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "sleep:60")
    job_id = _submit(store, blobs)
    thread = _run_in_thread(job_id, settings, store, blobs)
    _wait_state(store, job_id, "running", stage="fault-injection")
    started = time.monotonic()

    store.request_cancel(job_id, None)
    thread.join(30)

    assert not thread.is_alive()
    assert time.monotonic() - started < 15
    assert store.get(job_id).state == "canceled"


def test_run_job_stops_child_when_ownership_lost(settings, store, blobs, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "sleep:60")
    job_id = _submit(store, blobs)
    thread = _run_in_thread(job_id, settings, store, blobs)
    _wait_state(store, job_id, "running", stage="fault-injection")

    store.fail(job_id, None, code="ADMIN", message="failed by an operator")  # attempt 1 no longer owns it
    thread.join(30)

    assert not thread.is_alive()
    assert store.get(job_id).error_code == "ADMIN"


def test_run_job_fails_timeout_when_wall_limit_passes(settings, store, blobs, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "sleep:60")
    # Below the validated minimum (10 s) on purpose, to keep the test short.
    settings = settings.model_copy(update={"worker": settings.worker.model_copy(update={"child_wall_seconds": 2})})
    job_id = _submit(store, blobs)

    run_job(job_id, settings, store, blobs)

    assert store.get(job_id).error_code == "TIMEOUT"


# --------------------------------------------------------------------------------------------- archives


def _zip(path: Path, members: dict[str, bytes], symlink: str | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        if symlink:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = 0o120777 << 16
            zf.writestr(info, "/etc/passwd")
    return path


def _tar(path: Path, members: dict[str, bytes], symlink: str | None = None) -> Path:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        if symlink:
            info = tarfile.TarInfo(symlink)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tf.addfile(info)
    return path


@pytest.mark.parametrize(
    "case",
    [
        ("zip", {"../evil.onnx": b"x"}, None),
        ("zip", {"model.onnx": b"x"}, "weights.bin"),
        ("tar", {"../../evil.onnx": b"x"}, None),
        ("tar", {"/abs.onnx": b"x"}, None),
        ("tar", {"model.onnx": b"x"}, "weights.bin"),
        ("tar", {"dir/model.onnx": b"x"}, None),
        ("zip", {"a.onnx": b"x", "b.onnx": b"y"}, None),
        ("zip", {"weights.bin": b"x"}, None),
    ],
)
def test_run_job_fails_archive_invalid_when_archive_is_unsafe(settings, store, blobs, tmp_path, case):
    fmt, members, symlink = case
    archive = (_zip if fmt == "zip" else _tar)(tmp_path / f"bad.{fmt}", members, symlink)
    job_id = _submit(store, blobs, archive, fmt)

    run_job(job_id, settings, store, blobs)

    job = store.get(job_id)
    assert (job.state, job.error_code) == ("failed", "ARCHIVE_INVALID"), job.error_message
    assert not (tmp_path / "evil.onnx").exists()


def test_extract_archive_refuses_bomb_when_ratio_exceeds_limit(tmp_path):
    archive = tmp_path / "bomb.zip"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("model.onnx", b"\0" * (8 << 20))
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(Exception, match="compression ratio") as info:
        extract_archive(archive, dest, "zip", max_total_bytes=1 << 30)
    assert getattr(info.value, "code", None) == "ARCHIVE_INVALID"
    assert list(dest.iterdir()) == []


def test_extract_archive_refuses_when_members_exceed_limit(tmp_path):
    archive = _tar(tmp_path / "many.tar", {f"f{i}.bin": b"x" for i in range(100)} | {"m.onnx": b"x"})
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(Exception, match="more than 64 members"):
        extract_archive(archive, dest, "tar", max_total_bytes=1 << 30)


def test_run_job_commits_zip_when_model_has_external_data(settings, store, blobs, tmp_path):
    # A model no pass changes, so the artifact is the upload itself, external weights included.
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 100
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        "ext",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        initializer=[numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    bundle_dir = tmp_path / "bundle"
    bundle_dir.mkdir()
    onnx.save(model, str(bundle_dir / "net.onnx"), save_as_external_data=True, location="net.data", size_threshold=0)
    archive = tmp_path / "net.zip"
    deterministic_zip(archive, [bundle_dir / "net.onnx", bundle_dir / "net.data"])
    job_id = _submit(store, blobs, archive, "zip", passes=["identity_elimination"])

    run_job(job_id, settings, store, blobs)

    job = store.get(job_id)
    assert job.state == "succeeded", (job.error_code, job.error_message)
    assert job.artifact_format == "zip"
    with zipfile.ZipFile(blobs.path(job.artifact_sha256)) as zf:
        assert sorted(zf.namelist()) == ["model.onnx", "net.data"]
        assert all(info.date_time == (1980, 1, 1, 0, 0, 0) for info in zf.infolist())
        assert zf.read("net.data") == (bundle_dir / "net.data").read_bytes()


def test_deterministic_zip_is_byte_identical_when_built_twice(tmp_path):
    a, b = tmp_path / "model.onnx", tmp_path / "model.onnx.data"
    a.write_bytes(b"graph")
    b.write_bytes(b"weights" * 1000)

    deterministic_zip(tmp_path / "one.zip", [b, a])
    time.sleep(1.1)  # a zip stamped with the clock would differ now
    deterministic_zip(tmp_path / "two.zip", [a, b])

    assert (tmp_path / "one.zip").read_bytes() == (tmp_path / "two.zip").read_bytes()
    with zipfile.ZipFile(tmp_path / "one.zip") as zf:
        assert zf.namelist() == ["model.onnx", "model.onnx.data"]


def test_classify_exit_maps_signals_when_child_killed(tmp_path):
    assert classify_exit(-11, tmp_path).code == "MODEL_CRASHED"
    assert classify_exit(-9, tmp_path).code == "RESOURCE_LIMIT_EXCEEDED"
    assert classify_exit(-24, tmp_path).code == "TIMEOUT"  # SIGXCPU
    assert classify_exit(0, tmp_path).code == "INTERNAL_ERROR"  # exit 0 without result.json


def test_prune_attempt_dirs_keeps_only_the_live_attempt(settings: Settings, store: JobStore, blobs: BlobStore):
    # What a worker killed between its commit and its clean-up leaves: nobody claims that job again.
    running, finished = _submit(store, blobs), _submit(store, blobs)
    for _ in range(2):
        claimed = store.claim(running, "w", lease_seconds=0, max_attempts=3)  # lease 0: claimable again at once
        assert claimed is not None
    assert store.claim(finished, "w", lease_seconds=30, max_attempts=3) is not None
    store.fail(finished, 1, code="INVALID_MODEL", message="x")
    gone = "0b8a2d1e-6a47-4c0e-9d5f-1f0a5e7c3b21"  # a job the retention sweep already deleted
    work = settings.storage.work_dir
    made = [work / running / "attempt-1", work / running / "attempt-2", work / finished / "attempt-1"]
    made += [work / gone / "attempt-3", work / "not-a-job" / "attempt-1"]
    for d in made:
        (d / "input").mkdir(parents=True)
        (d / "input" / "model.onnx").write_bytes(b"x" * 10)

    assert prune_attempt_dirs(settings, store) == 3
    assert sorted(str(p.relative_to(work)) for p in work.glob("*/attempt-*")) == [
        f"{running}/attempt-2",
        "not-a-job/attempt-1",  # not named like a job: not ours to judge
    ]
    assert not (work / finished).exists() and not (work / gone).exists()
    assert prune_attempt_dirs(settings, store) == 0
