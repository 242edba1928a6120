"""What every reliability run shares: a private Redis, the service stack (``onnxforge serve`` and
``onnxforge worker`` subprocesses on a temp data dir), and the HTTP client helpers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "models" / "mlp_cleanup.onnx"
# rollback_slower off: which passes are kept must not depend on timing noise, so artifacts are comparable.
CONFIG: dict[str, Any] = {"preset": "safe", "rollback_slower": False}
TERMINAL = {"succeeded", "failed", "canceled"}
ONNXFORGE = [sys.executable, "-m", "onnxforge.cli"]
FAULT_ENV = "ONNXFORGE_TEST_CHILD_FAULT"  # workers/child.py test-only hook (sleep before the pipeline)
# Same as tests/conftest.py FAST_PIPELINE: few benchmark runs, short budgets.
FAST_PIPELINE = {
    "pipeline__benchmark_warmup": 1,
    "pipeline__benchmark_min_runs": 3,
    "pipeline__benchmark_max_seconds": 0.5,
    "pipeline__ledger_runs": 2,
    "pipeline__verify_shape_sets": 2,
}

Log = Callable[[str], None]


def log_stderr(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


# ------------------------------------------------------------------------------------------------ Redis


class RedisServer:
    """A private redis-server with AOF on (appendfsync everysec, noeviction), restartable on the same port/dir."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self, timeout: float = 15.0) -> None:
        argv = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--protected-mode", "yes",
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--maxmemory-policy", "noeviction",
            "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown save, only what the AOF already has."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# ------------------------------------------------------------------------------------ the service stack


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    started: float = field(default_factory=time.monotonic)

    def tail(self, size: int = 20000) -> str:
        try:
            with self.log.open("rb") as f:
                f.seek(max(0, self.log.stat().st_size - size))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


class Stack:
    """API and worker subprocesses on one data dir. ``close()`` stops everything it started, and every
    attempt child (found by this stack's work dir in its command line) left by a killed worker."""

    def __init__(self, workdir: Path, *, broker_url: str | None = None, key_prefix: str | None = None, **settings: Any):
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self.api: Proc | None = None
        self.url = ""
        self.fault: str | None = settings.pop("fault", None)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONNXFORGE_")}
        env.pop(FAULT_ENV, None)
        env["PYTHONUNBUFFERED"] = "1"
        env["ONNXFORGE_STORAGE__DATA_DIR"] = str(self.data_dir)
        if broker_url:
            env["ONNXFORGE_BROKER__URL"] = broker_url
            env["ONNXFORGE_BROKER__KEY_PREFIX"] = key_prefix or f"onnxforge-rel-{uuid.uuid4().hex[:10]}:"
        for key, value in settings.items():
            env[f"ONNXFORGE_{key.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
        if self.fault:
            env[FAULT_ENV] = self.fault
        self.env = env

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> Proc:
        log = self.logs / f"{name}-{len(self.procs)}.log"
        with log.open("wb") as handle:
            popen = subprocess.Popen(
                argv, env=env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def start_api(self, timeout: float = 60.0) -> Proc:
        port = free_port()
        env = {**self.env, "ONNXFORGE_API__HOST": "127.0.0.1", "ONNXFORGE_API__PORT": str(port)}
        self.api = self._start("api", [*ONNXFORGE, "serve"], env)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.api.alive:
                raise RuntimeError(f"API exited {self.api.popen.returncode}:\n{self.api.tail(4000)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self.api
            time.sleep(0.1)
        raise RuntimeError(f"API did not answer /healthz within {timeout} s:\n{self.api.tail(4000)}")

    def start_worker(self, *, wait: bool = True, timeout: float = 60.0) -> Proc:
        worker = self._start("worker", [*ONNXFORGE, "worker", "--queues", "cpu,gpu", "--concurrency", "1"], self.env)
        if wait:
            self.wait_ready(worker, timeout)
        return worker

    @staticmethod
    def ready(worker: Proc) -> bool:
        return worker.alive and " ready." in worker.tail(50000)

    def wait_ready(self, worker: Proc, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready(worker):
            if not worker.alive or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{worker.tail(4000)}")
            time.sleep(0.1)

    def children(self) -> list[psutil.Process]:
        """Live attempt children of this stack (``workers.child <work_dir>/...``)."""
        marker = str(self.data_dir / "work")
        found = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info.get("cmdline") or []
            if "workers.child" in cmd and any(marker in part for part in cmd):
                found.append(p)
        return found

    def close(self) -> None:
        for proc in reversed(self.procs):  # the API last started is first to go; then every worker group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.popen.pid, signal.SIGTERM)  # the group outlives a SIGKILLed leader (orphans)
        deadline = time.monotonic() + 15
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)
        for child in self.children():
            with contextlib.suppress(psutil.Error):
                child.kill()


@contextlib.contextmanager
def workspace(keep: bool = False, parent: Path | None = None) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="onnxforge-rel-", dir=parent))
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ client


def model_variants(count: int) -> list[bytes]:
    """``count`` distinct copies of the small test model (doc_string differs, so the SHA-256 differs)."""
    import onnx

    out = []
    for i in range(count):
        model = onnx.load(str(MODEL))
        model.doc_string = f"onnxforge reliability variant {i}"
        out.append(model.SerializeToString())
    return out


def submit(
    client: httpx.Client, url: str, body: bytes, name: str = "model.onnx", config: dict[str, Any] | None = None
) -> httpx.Response:
    return client.post(
        f"{url}/v1/jobs",
        files={"model": (name, body, "application/octet-stream")},
        data={"config": json.dumps(config or CONFIG)},
        timeout=60,
    )


def list_jobs(client: httpx.Client, url: str) -> dict[str, dict[str, Any]]:
    jobs: dict[str, dict[str, Any]] = {}
    offset = 0
    for _ in range(1000):
        page = (
            client.get(f"{url}/v1/jobs", params={"limit": 200, "offset": offset}, timeout=30).raise_for_status().json()
        )
        for job in page["jobs"]:
            jobs[job["id"]] = job
        offset += len(page["jobs"])
        if not page["jobs"] or offset >= page["total"]:
            break
    return jobs


def wait_terminal(client: httpx.Client, url: str, ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        jobs = list_jobs(client, url)
        if all(jobs.get(i, {}).get("state") in TERMINAL for i in ids) or time.monotonic() > deadline:
            return jobs
        time.sleep(0.5)


def canonical_sha(data: bytes) -> str:
    """SHA-256 of an artifact without its ``onnxforge.job_id`` metadata (the one field that differs by job
    by design); a zip artifact (external data) is hashed as is."""
    import onnx

    if data[:2] == b"PK":
        return hashlib.sha256(data).hexdigest()
    model = onnx.load_model_from_string(data)
    keep = [p for p in model.metadata_props if p.key != "onnxforge.job_id"]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


def fetch_artifact(client: httpx.Client, url: str, job_id: str) -> tuple[str, str]:
    """(SHA-256 of the downloaded artifact, its canonical SHA-256)."""
    r = client.get(f"{url}/v1/jobs/{job_id}/artifact", timeout=60).raise_for_status()
    return hashlib.sha256(r.content).hexdigest(), canonical_sha(r.content)


def blob_path(data_dir: Path, sha: str) -> Path:
    from core.storage import BlobStore

    return Path(BlobStore(data_dir / "blobs").path(sha))


class BrokerProbe:
    """Counts the Celery messages in a private Redis: waiting in the ``cpu``/``gpu`` queues, and delivered
    but not acknowledged. The reconciler flood (docs/reliability.md, bug 3) shows as waiting messages far
    above the number of queued jobs."""

    def __init__(self, url: str, prefix: str) -> None:
        import redis as redis_lib

        self.client = redis_lib.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self.prefix = prefix
        self.max_waiting = 0
        self.max_excess = 0  # waiting messages minus queued jobs, at the worst sample
        self.samples = 0

    def sample(self, queued_jobs: int) -> None:
        try:
            waiting = self.waiting()
        except Exception:  # redis killed on purpose (the Redis run) or busy: skip this sample
            return
        self.samples += 1
        self.max_waiting = max(self.max_waiting, waiting)
        self.max_excess = max(self.max_excess, waiting - queued_jobs)

    def waiting(self) -> int:
        return sum(int(self.client.llen(f"{self.prefix}{q}")) for q in ("cpu", "gpu"))

    def unacked(self) -> int:
        return int(self.client.hlen(f"{self.prefix}unacked"))

    def close(self) -> None:
        self.client.close()


def reenqueue_count(logs: Path) -> int:
    """How many messages the workers' reconcilers enqueued (their ``re-enqueued`` log lines)."""
    count = 0
    for log_file in logs.glob("worker-*.log"):
        with contextlib.suppress(OSError):
            count += log_file.read_bytes().count(b"reconciler: re-enqueued")
    return count


UPLOAD_BLOCK = os.urandom(1 << 20)


class RssSampler:
    """Samples a process's RSS every ``period`` s in a thread; ``peak`` and ``baseline`` in bytes."""

    def __init__(self, pid: int, period: float = 0.05) -> None:
        self.proc = psutil.Process(pid)
        self.period = period
        self.baseline = self.proc.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def api_process(stack: Stack) -> psutil.Process:
    """The uvicorn process (``onnxforge serve`` itself in embedded mode with no workers)."""
    assert stack.api is not None
    return psutil.Process(stack.api.popen.pid)


def job_of_child(proc: psutil.Process) -> tuple[str | None, int]:
    with contextlib.suppress(psutil.Error, IndexError, ValueError):
        job_json = Path(proc.cmdline()[-1])  # <work>/<job>/attempt-<n>/job.json
        return job_json.parent.parent.name, int(job_json.parent.name.split("-", 1)[1])
    return None, 0
