"""Run one delivery of a job: claim, attempt directory, capped child, heartbeat, classify, commit.

``run_job`` is what the Celery task calls, and what tests call directly (no Celery needed):

1. ``store.claim`` (compare-and-set; increments ``attempts``). ``None`` means another delivery owns the
   job or it is finished: return, so a duplicate message is a no-op.
2. ``<work_dir>/<job>/attempt-<n>/`` gets ``input/`` (the model copied from the blob store, or an archive
   extracted by workers/archive.py; samples as ``samples.npz``), ``output/`` and ``job.json``.
3. ``python -m workers.child job.json`` runs in a new session with a minimal environment and rlimits
   (CPU, FSIZE, NOFILE, CORE=0, and AS for CPU targets) and dies with the worker (PDEATHSIG). About
   every second the runner reads ``progress.json`` and heartbeats (renewing the lease). A heartbeat
   answering ``None`` means a newer attempt owns the job: the child is killed and nothing is written.
   ``cancel_requested`` kills the child and marks the job canceled; the wall limit kills it and fails
   the job with ``TIMEOUT``.
4. The exit is classified (security.md "How a worker survives"): 0 with result.json commits; status 1 with
   error.json fails with its code; SIGSEGV/SIGABRT/SIGBUS/SIGILL/SIGFPE is ``MODEL_CRASHED``; SIGKILL that
   we did not send (kernel OOM killer, limits) and SIGXFSZ are ``RESOURCE_LIMIT_EXCEEDED``; SIGXCPU is
   ``TIMEOUT``. Model faults are terminal; only infrastructure exceptions propagate (and the reconciler
   re-enqueues the job once its lease expires).
5. Commit: output files are re-checked (regular, inside ``output/``, safe names), the artifact
   (``model.onnx``, or a deterministic zip with its external data) and both reports go to the blob store, then
   ``store.succeed`` (CAS: if another attempt already won, ours is dropped). The attempt directory is
   deleted whatever the outcome.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import InvalidModelError, NotFoundError, OnnxforgeError
from core.hardware import hardware_class
from core.jobtable import valid_id
from core.logs import bind
from workers.archive import SAFE_NAME, extract_archive
from workers.child import FAULT_ENV

if TYPE_CHECKING:
    from core.settings import Settings
    from core.storage import BlobStore
    from core.store import JobStore

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0
KILL_GRACE_SECONDS = 10.0
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}
_INTERRUPT_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}
_OOM_HINTS = ("MemoryError", "bad_alloc", "Cannot allocate memory", "Failed to allocate memory")
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
_PROJECT_ROOT = Path(__file__).resolve().parent.parent
_SERVICE_ONLY_CONFIG = frozenset({"callback_url", "use_cache"})
_REPORT_READ_MAX = 32 << 20


class ChildInterrupted(RuntimeError):
    """The child was stopped from outside (not by us, not by a limit): an infrastructure fault, retried."""


@dataclass
class Outcome:
    """How an attempt ended, before it is written to the store."""

    ok: bool
    code: str | None = None
    message: str = ""
    pass_name: str | None = None
    result: dict[str, Any] = field(default_factory=dict)


class Timings:
    """Wall-clock seconds per stage, for the job row."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self._stage: str | None = None
        self._since = time.monotonic()

    def enter(self, stage: str) -> None:
        now = time.monotonic()
        if self._stage is not None:
            self.values[self._stage] = round(self.values.get(self._stage, 0.0) + now - self._since, 4)
        self._stage, self._since = stage, now

    def done(self) -> dict[str, float]:
        self.enter("_end")
        self.values.pop("_end", None)
        return dict(self.values)


# ---------------------------------------------------------------------------------------------------------
# attempt directory


def attempt_dir(settings: Settings, job_id: str, attempt: int) -> Path:
    return settings.storage.work_dir / job_id / f"attempt-{attempt}"


def materialize_inputs(job: Any, settings: Settings, blobs: BlobStore, input_dir: Path) -> tuple[Path, Path | None]:
    """Copy or extract the job's model (and samples) from the blob store into ``input_dir``."""
    fmt = (job.model_format or "onnx").lower()
    if fmt == "onnx":
        model_path = blobs.copy_to(job.model_sha256, input_dir / "model.onnx")
    else:
        # Read in place when the blob is a local file; from object storage, fetched into the scratch first.
        source = blobs.local_path(job.model_sha256) or blobs.copy_to(
            job.model_sha256, input_dir.parent / f"upload.{fmt}"
        )
        model_path = extract_archive(source, input_dir, fmt, max_total_bytes=settings.api.max_upload_bytes)
    samples_path = None
    if job.samples_sha256:
        samples_path = blobs.copy_to(job.samples_sha256, input_dir / "samples.npz")
    return model_path, samples_path


def _write_job_json(path: Path, job: Any, settings: Settings, *, model: Path, samples: Path | None, out: Path) -> None:
    path.write_text(
        json.dumps(
            {
                "job_id": str(job.id),
                "model_path": str(model),
                "samples_path": str(samples) if samples else None,
                "output_dir": str(out),
                # callback_url and use_cache are the service's business: never in the child, report or artifact.
                "config": {k: v for k, v in (job.config or {}).items() if k not in _SERVICE_ONLY_CONFIG},
                "pipeline": settings.pipeline.model_dump(mode="json"),
            },
            sort_keys=True,
        )
    )


# ---------------------------------------------------------------------------------------------------------
# the child process


def _capped(res: int, soft: int, hard: int | None = None) -> tuple[int, int]:
    """(soft, hard) no higher than this process's hard limit, so setrlimit cannot fail in the child."""
    ceiling = resource.getrlimit(res)[1]
    hard = soft if hard is None else hard
    if ceiling != resource.RLIM_INFINITY:
        soft, hard = min(soft, ceiling), min(hard, ceiling)
    return soft, hard


def _limits(settings: Settings, *, address_space: bool) -> Callable[[], None]:
    """The child's rlimits. ``address_space`` off for GPU targets: CUDA reserves huge virtual ranges
    (security.md "How a worker survives"), so RLIMIT_AS would fail it; cgroups bound memory there."""
    mib = 1 << 20
    cpu = settings.worker.child_cpu_seconds
    limits = [
        (resource.RLIMIT_CPU, _capped(resource.RLIMIT_CPU, cpu, cpu + 5)),  # SIGXCPU, SIGKILL 5 s later
        (resource.RLIMIT_FSIZE, _capped(resource.RLIMIT_FSIZE, settings.worker.child_file_mb * mib)),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_NOFILE, _capped(resource.RLIMIT_NOFILE, 256)),
    ]
    if address_space:
        limits.append((resource.RLIMIT_AS, _capped(resource.RLIMIT_AS, settings.worker.child_memory_mb * mib)))
    libc = None
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL(None, use_errno=True)

    def apply() -> None:  # runs between fork and exec: setrlimit/prctl only, values computed above
        for res, values in limits:
            resource.setrlimit(res, values)
        if libc is not None:
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the child dies with the worker

    return apply


def child_env(settings: Settings, home: Path) -> dict[str, str]:
    """A minimal environment: no credentials or broker/database settings reach the model's process."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "TMPDIR": str(home),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(_PROJECT_ROOT),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        # glibc reserves 64 MiB of address space per thread arena; under RLIMIT_AS that reservation, not
        # real use, would exhaust the limit on many-core hosts.
        "MALLOC_ARENA_MAX": "2",
    }
    threads = settings.pipeline.intra_op_threads
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if FAULT_ENV in os.environ:  # test-only fault injection, see workers/child.py
        env[FAULT_ENV] = os.environ[FAULT_ENV]
    return env


def _gpu_env(settings: Settings) -> dict[str, str]:
    """A GPU job's child: its pool slot's one GPU and the job's GPU memory limit (workers/gpu.py)."""
    from workers.gpu import child_gpu_env, pool_index

    return child_gpu_env(pool_index(), mem_limit_mb=settings.worker.gpu_mem_limit_mb)


def _killpg(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _tail(path: Path, size: int = 8192) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - size))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def classify_exit(returncode: int, base: Path) -> Outcome:
    """Map the child's exit to an outcome (security.md exit classification)."""
    stderr = _tail(base / "child.log")
    if returncode == 0:
        result = _read_json(base / "result.json")
        if result is None:
            return Outcome(False, "INTERNAL_ERROR", "the optimizer exited without a result")
        return Outcome(True, result=result)
    if returncode > 0:
        error = _read_json(base / "error.json")
        if error and isinstance(error.get("code"), str):
            return Outcome(False, error["code"], str(error.get("message") or ""), error.get("pass"))
        if any(hint in stderr for hint in _OOM_HINTS):
            return Outcome(False, "RESOURCE_LIMIT_EXCEEDED", "the job ran out of memory")
        return Outcome(False, "INTERNAL_ERROR", f"the optimizer exited with status {returncode}")
    sig = signal.Signals(-returncode) if -returncode in signal.valid_signals() else None
    name = sig.name if sig else f"signal {-returncode}"
    if sig in _CRASH_SIGNALS:
        if any(hint in stderr for hint in _OOM_HINTS):  # an allocation failure under RLIMIT_AS can abort
            return Outcome(False, "RESOURCE_LIMIT_EXCEEDED", f"the job ran out of memory ({name})")
        return Outcome(False, "MODEL_CRASHED", f"the optimizer crashed on this model ({name})")
    if sig in (signal.SIGKILL, signal.SIGXFSZ):
        return Outcome(False, "RESOURCE_LIMIT_EXCEEDED", f"the job exceeded a memory, file size or CPU limit ({name})")
    if sig == signal.SIGXCPU:
        return Outcome(False, "TIMEOUT", "the job exceeded its CPU-time limit")
    if sig in _INTERRUPT_SIGNALS:
        raise ChildInterrupted(f"the optimizer child was stopped from outside ({name})")
    return Outcome(False, "MODEL_CRASHED", f"the optimizer died on this model ({name})")


# ---------------------------------------------------------------------------------------------------------
# commit


def _safe_output(output_dir: Path, name: str) -> Path:
    if not SAFE_NAME.fullmatch(name):
        raise InvalidModelError(f"optimizer produced an unsafe file name {name[:100]!r}", code="OUTPUT_INVALID")
    path = output_dir / name
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or path.resolve().parent != output_dir.resolve():
        raise InvalidModelError(f"optimizer output {name!r} is not a plain file", code="OUTPUT_INVALID")
    return path


def deterministic_zip(dest: Path, files: list[Path]) -> None:
    """Zip ``files`` flat into ``dest`` with fixed timestamps and permissions: same input, same bytes."""
    with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED, allowZip64=True) as zf:
        for path in sorted(files, key=lambda p: p.name):
            info = zipfile.ZipInfo(path.name, date_time=_ZIP_EPOCH)
            info.external_attr = 0o100644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            with path.open("rb") as src, zf.open(info, "w", force_zip64=True) as out:
                shutil.copyfileobj(src, out, 1 << 20)


def _commit(
    job: Any,
    attempt: int,
    base: Path,
    result: dict[str, Any],
    *,
    store: JobStore,
    blobs: BlobStore,
    timings: dict[str, float],
) -> bool:
    output_dir = base / "output"
    model = _safe_output(output_dir, str(result.get("model") or "model.onnx"))
    data = [_safe_output(output_dir, str(name)) for name in result.get("external_data") or []]
    # Files a pass produced beside the model (extract_adapters: model.onnx_adapter) travel in the zip too.
    data += [_safe_output(output_dir, str(name)) for name in result.get("side_files") or []]
    if data:
        bundle = base / "artifact.zip"
        deterministic_zip(bundle, [model, *data])
        artifact_sha, artifact_format = blobs.put_file(bundle), "zip"
    else:
        artifact_sha, artifact_format = blobs.put_file(model), "onnx"
    report_json = _safe_output(output_dir, Path(str(result.get("report_json") or "report.json")).name)
    report_html = _safe_output(output_dir, Path(str(result.get("report_html") or "report.html")).name)
    summary = dict(result.get("summary") or {})
    summary.setdefault("used_original", bool(result.get("used_original")))
    summary["pass_seconds"] = _pass_seconds(report_json)
    return store.succeed(
        str(job.id),
        attempt,
        artifact_sha256=artifact_sha,
        artifact_format=artifact_format,
        report_sha256=blobs.put_file(report_json),
        report_html_sha256=blobs.put_file(report_html),
        summary=summary,
        timings=timings,
        hardware_class=hardware_class(str((job.config or {}).get("target") or "cpu")),
    )


def _pass_seconds(report_json: Path) -> dict[str, float]:
    """Seconds per pass name (summed when a pass runs twice), from the report, for the duration metrics."""
    if report_json.stat().st_size > _REPORT_READ_MAX:
        return {}
    report = _read_json(report_json) or {}
    seconds: dict[str, float] = {}
    for record in report.get("passes") or []:
        if isinstance(record, dict) and isinstance(record.get("name"), str):
            value = record.get("duration_s")
            if isinstance(value, int | float):
                seconds[record["name"]] = round(seconds.get(record["name"], 0.0) + float(value), 4)
    return seconds


# ---------------------------------------------------------------------------------------------------------
# the loop


def _supervise(
    job_id: str,
    attempt: int,
    proc: subprocess.Popen[bytes],
    base: Path,
    *,
    settings: Settings,
    store: JobStore,
    timings: Timings,
) -> Outcome | str:
    """Watch the child until it exits. Returns its outcome, or "lost"/"canceled" when we stopped it."""
    lease = settings.worker.lease_seconds
    deadline = time.monotonic() + settings.worker.child_wall_seconds
    last_ok = time.monotonic()
    last_stage = None
    while True:
        try:
            proc.wait(timeout=HEARTBEAT_SECONDS)
            break
        except subprocess.TimeoutExpired:
            pass
        progress = _read_json(base / "progress.json") or {}
        stage = str(progress.get("stage") or "starting")
        if stage != last_stage:
            timings.enter(stage)
            last_stage = stage
        try:
            fraction = float(progress.get("progress") or 0.0)
        except (TypeError, ValueError):
            fraction = 0.0
        try:
            job = store.heartbeat(job_id, attempt, stage=stage, progress=fraction, lease_seconds=lease)
            last_ok = time.monotonic()
        except Exception:
            # A database blip: keep the child running while the lease still covers us, then give up.
            if time.monotonic() - last_ok > lease / 2:
                _killpg(proc, KILL_GRACE_SECONDS)
                raise
            log.warning("heartbeat of job %s failed; retrying", job_id, exc_info=True)
            continue
        if job is None:
            log.warning("job %s attempt %d lost its lease to another attempt; stopping", job_id, attempt)
            _killpg(proc, KILL_GRACE_SECONDS)
            return "lost"
        if getattr(job, "cancel_requested", False):
            _killpg(proc, KILL_GRACE_SECONDS)
            return "canceled"
        if time.monotonic() > deadline:
            _killpg(proc, KILL_GRACE_SECONDS)
            return Outcome(False, "TIMEOUT", f"the job ran longer than {settings.worker.child_wall_seconds} s")
    return classify_exit(proc.returncode, base)


def run_job(job_id: str, settings: Settings, store: JobStore, blobs: BlobStore, worker_name: str | None = None) -> None:
    """Run one delivery of ``job_id`` to its end (see the module docstring)."""
    worker = worker_name or f"{os.uname().nodename}:{os.getpid()}"
    job = store.claim(
        job_id, worker, lease_seconds=settings.worker.lease_seconds, max_attempts=settings.worker.max_attempts
    )
    if job is None:
        log.info("job %s: nothing to do (finished, canceled or owned by another attempt)", job_id)
        with contextlib.suppress(OnnxforgeError):
            if store.get(job_id).terminal:  # e.g. failed WORKER_LOST just now: its last attempt left files
                shutil.rmtree(settings.storage.work_dir / job_id, ignore_errors=True)
        return
    bind(team=job.tenant)  # the job's lines name its team from here on (core/logs.py)
    log.info("job %s: attempt %d claimed by %s (team %s)", job_id, job.attempts, worker, job.tenant)
    attempt = int(job.attempts)
    base = attempt_dir(settings, job_id, attempt)
    _remove_earlier_attempts(base.parent, attempt)
    timings = Timings()
    try:
        _run_attempt(job, attempt, base, settings=settings, store=store, blobs=blobs, timings=timings)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        with contextlib.suppress(OSError):
            base.parent.rmdir()  # only if no other attempt directory is left


def prune_attempt_dirs(settings: Settings, store: JobStore) -> int:
    """Delete attempt directories no attempt will clean up; returns how many went.

    An attempt removes its own directory when it ends, and a later attempt the ones before it. A worker
    killed between its commit and that clean-up (or holding the last attempt a WORKER_LOST cap ends) leaves
    one that nobody would. Every reconciler round calls this. It removes ``attempt-<n>`` when the job is
    terminal, gone, or claimed again since (``attempts > n``): the live attempt's directory is made only
    after its claim, so it always has ``n == attempts``, and an attempt that lost its claim can never commit.
    """
    work = settings.storage.work_dir
    try:
        job_dirs = [e for e in os.scandir(work) if e.is_dir(follow_symlinks=False) and valid_id(e.name)]
    except OSError:
        return 0
    removed = 0
    for job_dir in job_dirs:
        attempts = _attempt_dirs(Path(job_dir.path))
        if not attempts:
            continue
        try:
            job = store.get(job_dir.name)
            live = None if job.terminal else int(job.attempts)
        except NotFoundError:
            live = None
        for number, path in attempts:
            if number != live:
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
        with contextlib.suppress(OSError):
            os.rmdir(job_dir.path)  # only if no attempt directory is left
    if removed:
        log.info("removed %d attempt directories left by killed attempts", removed)
    return removed


def _attempt_dirs(job_dir: Path) -> list[tuple[int, Path]]:
    """``(n, path)`` of each ``attempt-<n>`` directory in ``job_dir`` (``attempt_dir``'s layout)."""
    found = [(p.name.removeprefix("attempt-"), p) for p in job_dir.glob("attempt-*")]
    return [(int(suffix), path) for suffix, path in found if suffix.isdigit()]


def _remove_earlier_attempts(job_dir: Path, attempt: int) -> None:
    """Delete the directories of attempts killed before they could clean up. Safe: once this attempt holds
    the claim, an earlier attempt can never commit (succeed/fail are compare-and-set on the attempt)."""
    for number, earlier in _attempt_dirs(job_dir):
        if number < attempt:
            shutil.rmtree(earlier, ignore_errors=True)


def _run_attempt(
    job: Any,
    attempt: int,
    base: Path,
    *,
    settings: Settings,
    store: JobStore,
    blobs: BlobStore,
    timings: Timings,
) -> None:
    job_id = str(job.id)
    if base.exists():
        shutil.rmtree(base)
    input_dir, output_dir = base / "input", base / "output"
    input_dir.mkdir(parents=True)
    output_dir.mkdir()

    timings.enter("materialize")
    try:
        model_path, samples_path = materialize_inputs(job, settings, blobs, input_dir)
    except OnnxforgeError as exc:
        store.fail(
            job_id,
            attempt,
            code=exc.code,
            message=exc.message,
            pass_name=exc.pass_name,
            timings=timings.done(),
        )
        return
    _write_job_json(base / "job.json", job, settings, model=model_path, samples=samples_path, out=output_dir)

    timings.enter("starting")
    cpu_only = str((job.config or {}).get("target") or "cpu") == "cpu"
    with (base / "child.log").open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.child", str(base / "job.json")],
            cwd=base,
            env=child_env(settings, base) if cpu_only else {**child_env(settings, base), **_gpu_env(settings)},
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_limits(settings, address_space=cpu_only),  # noqa: PLW1509 - setrlimit/prctl only
            close_fds=True,
        )
        try:
            outcome = _supervise(job_id, attempt, proc, base, settings=settings, store=store, timings=timings)
        finally:
            if proc.poll() is None:  # an exception (soft time limit, DB down) must not orphan the child
                _killpg(proc, 1.0)
    if proc.returncode not in (0, None) and isinstance(outcome, Outcome) and not outcome.ok:
        log.warning(
            "job %s attempt %d: child exited %s; log tail:\n%s",
            job_id,
            attempt,
            proc.returncode,
            _tail(base / "child.log", 4096),
        )

    if outcome == "lost":
        return
    if outcome == "canceled":
        store.mark_canceled(job_id, attempt)
        return
    assert isinstance(outcome, Outcome)
    if not outcome.ok:
        store.fail(
            job_id,
            attempt,
            code=outcome.code,
            message=outcome.message,
            pass_name=outcome.pass_name,
            timings=timings.done(),
        )
        return
    timings.enter("commit")
    try:
        committed = _commit(job, attempt, base, outcome.result, store=store, blobs=blobs, timings=timings.done())
    except (InvalidModelError, FileNotFoundError) as exc:
        message = exc.message if isinstance(exc, OnnxforgeError) else f"optimizer output missing: {exc.filename}"
        store.fail(job_id, attempt, code="OUTPUT_INVALID", message=message, timings=timings.done())
        return
    if not committed:
        log.info("job %s attempt %d: another attempt committed first; dropping ours", job_id, attempt)
