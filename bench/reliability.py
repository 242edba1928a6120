"""Reliability runs of security spec checklist (b): chaos, Redis restart, big upload, load, validator memory.

Every run starts its own processes on loopback and stops them: a private ``redis-server`` (system binary,
``appendonly yes`` in a temp dir, a free port), ``onnxforge serve`` and ``onnxforge worker`` subprocesses
with ``ONNXFORGE_*`` settings, and a temp data dir (SQLite job store) that is deleted afterwards. Nothing
touches the shared Redis or PostgreSQL. All loops are bounded in count and time.

    .venv/bin/python -m bench.reliability chaos --jobs 200
    .venv/bin/python -m bench.reliability redis
    .venv/bin/python -m bench.reliability oom
    .venv/bin/python -m bench.reliability upload --gb 2.2
    .venv/bin/python -m bench.reliability load --uploads 8 --upload-mb 100 --rps 200 --seconds 20
    .venv/bin/python -m bench.reliability validate --mb 300

Each prints a JSON result; ``--out FILE`` also writes it. tests/reliability/ runs the same functions with
small parameters and asserts on the results.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
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


def _log(msg: str) -> None:
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


# ------------------------------------------------------------------------------------------------- chaos


def run_chaos(
    *,
    jobs: int = 30,
    workers: int = 2,
    variants: int = 3,
    kill_every: tuple[float, float] = (3.0, 6.0),
    kinds: tuple[str, ...] = ("worker", "group", "child"),
    lease_seconds: int = 10,
    reconcile_seconds: int = 2,
    max_attempts: int = 3,
    child_sleep: float = 1.0,
    timeout: float = 240.0,
    seed: int = 0,
    log: Log = _log,
    tmp_parent: Path | None = None,
) -> dict[str, Any]:
    """Submit ``jobs`` jobs to ``workers`` workers and SIGKILL a worker main process, a worker's whole
    process group, or an attempt child at random every ``kill_every`` seconds (restarting killed workers)
    until every job is terminal. Kill-free reference artifacts of each model variant are made first."""
    rng = random.Random(seed)
    result: dict[str, Any] = {"jobs": jobs, "workers": workers, "lease_seconds": lease_seconds}
    result.update(reconcile_interval_seconds=reconcile_seconds, max_attempts=max_attempts)
    with workspace(parent=tmp_parent) as tmp:
        redis = RedisServer(tmp / "redis")
        redis.start()
        prefix = f"onnxforge-rel-{uuid.uuid4().hex[:10]}:"
        probe = BrokerProbe(redis.url, prefix)
        stack = Stack(
            tmp, broker_url=redis.url, key_prefix=prefix, cache__enabled=False, worker__lease_seconds=lease_seconds,
            worker__reconcile_interval_seconds=reconcile_seconds, worker__max_attempts=max_attempts,
            fault=f"sleep:{child_sleep}" if child_sleep else None, **FAST_PIPELINE,
        )  # fmt: skip
        try:
            stack.start_api()
            pool = [stack.start_worker() for _ in range(workers)]
            bodies = model_variants(variants)
            client = httpx.Client()

            # Kill-free reference run of every variant.
            started = time.monotonic()
            ref_ids = []
            for body in bodies:
                r = submit(client, stack.url, body)
                assert r.status_code == 202, r.text
                ref_ids.append(r.json()["id"])
            ref_jobs = wait_terminal(client, stack.url, ref_ids, 120)
            reference: list[str | None] = []
            for job_id in ref_ids:
                job = ref_jobs[job_id]
                reference.append(fetch_artifact(client, stack.url, job_id)[1] if job["state"] == "succeeded" else None)
            result["reference_seconds"] = round(time.monotonic() - started, 2)
            result["reference_states"] = [ref_jobs[i]["state"] for i in ref_ids]
            log(f"chaos: references {result['reference_states']} in {result['reference_seconds']} s")

            # Submit everything, then kill at random until all are terminal.
            variant_of: dict[str, int] = {}
            for n in range(jobs):
                r = submit(client, stack.url, bodies[n % variants])
                assert r.status_code == 202, r.text
                variant_of[r.json()["id"]] = n % variants
            ids = list(variant_of)
            t0 = time.monotonic()
            kills: list[dict[str, Any]] = []
            pending: list[dict[str, Any]] = []  # kills whose interrupted job has not moved on yet
            recoveries: list[float] = []
            next_kill = t0 + rng.uniform(*kill_every)
            next_progress = t0 + 60
            result["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
            deadline = t0 + timeout
            done_at = None
            while time.monotonic() < deadline:
                snapshot = list_jobs(client, stack.url)
                probe.sample(sum(1 for i in ids if snapshot[i]["state"] == "queued"))
                now = time.monotonic()
                if now >= next_progress:
                    done = sum(1 for i in ids if snapshot[i]["state"] in TERMINAL)
                    log(f"chaos: t={now - t0:.0f}s {done}/{jobs} terminal, {len(kills)} kills, "
                        f"{probe.max_waiting} max waiting messages, load {os.getloadavg()[0]:.1f}")  # fmt: skip
                    next_progress = now + 60
                for p in list(pending):  # recovered: the job finished, or another attempt is running it
                    job = snapshot.get(p["job"], {})
                    if job.get("state") in TERMINAL or (
                        job.get("attempts", 0) > p["attempts"] and job.get("state") == "running"
                    ):
                        recoveries.append(now - p["t"])
                        pending.remove(p)
                if all(snapshot[i]["state"] in TERMINAL for i in ids):
                    done_at = now
                    break
                if now >= next_kill:
                    kill = _chaos_kill(stack, pool, rng, kinds, snapshot)
                    if kill:
                        kill["t_rel"] = round(now - t0, 2)
                        kills.append(kill)
                        log(f"chaos: t={kill['t_rel']}s kill {kill['kind']} pid {kill['pid']} job {kill.get('job')}")
                        if kill.get("job"):
                            pending.append({"job": kill["job"], "attempts": kill["attempts"], "t": now})
                    next_kill = now + rng.uniform(*kill_every)
                for i, w in enumerate(pool):  # restart dead workers (without waiting: the loop keeps polling)
                    if not w.alive:
                        pool[i] = stack.start_worker(wait=False)
                time.sleep(0.5)

            final = wait_terminal(client, stack.url, ids, 5)
            lost = [i for i in ids if final[i]["state"] not in TERMINAL]
            succeeded = [i for i in ids if final[i]["state"] == "succeeded"]
            hashes_ok, mismatched, missing_blob = 0, [], []
            for job_id in succeeded:
                sha, canonical = fetch_artifact(client, stack.url, job_id)
                if canonical == reference[variant_of[job_id]]:
                    hashes_ok += 1
                else:
                    mismatched.append(job_id)
                if not blob_path(stack.data_dir, sha).is_file():
                    missing_blob.append(job_id)
            failed_codes: dict[str, int] = {}
            for i in ids:
                if final[i]["state"] == "failed":
                    code = (final[i].get("error") or {}).get("code") or "?"
                    failed_codes[code] = failed_codes.get(code, 0) + 1
            work = stack.data_dir / "work"
            leftover = sorted(str(p.relative_to(work)) for p in work.glob("*/attempt-*")) if work.exists() else []
            result.update(
                chaos_seconds=round((done_at or time.monotonic()) - t0, 2),
                drained=done_at is not None,
                kills=len(kills),
                kills_by_kind={k: sum(1 for x in kills if x["kind"] == k) for k in kinds},
                kill_log=kills,
                terminal=len(ids) - len(lost),
                lost=lost,
                lost_detail={i: [final[i]["state"], final[i]["attempts"], final[i].get("stage")] for i in lost},
                succeeded=len(succeeded),
                failed_codes=failed_codes,
                max_attempts_seen=max(final[i]["attempts"] for i in ids),
                attempts_over_cap=[i for i in ids if final[i]["attempts"] > max_attempts],
                artifacts_matching_reference=hashes_ok,
                artifacts_mismatched=mismatched,
                artifacts_missing_blob=missing_blob,
                recovery_seconds_max=round(max(recoveries), 2) if recoveries else None,
                recovery_seconds_p50=round(statistics.median(recoveries), 2) if recoveries else None,
                recoveries_measured=len(recoveries),
                unrecovered_kills=len(pending),
                leftover_attempt_dirs=len(leftover),
                children_left=len(stack.children()),
                broker_max_waiting=probe.max_waiting,
                broker_max_excess=probe.max_excess,
                broker_samples=probe.samples,
                broker_waiting_after=probe.waiting(),
                reconciler_reenqueued=reenqueue_count(stack.logs),
                loadavg_end=[round(x, 2) for x in os.getloadavg()],
            )
            client.close()
        finally:
            try:
                probe.close()
                stack.close()
            finally:
                redis.stop()
        result["children_after_close"] = len(stack.children())
    return result


def _job_of_child(proc: psutil.Process) -> tuple[str | None, int]:
    with contextlib.suppress(psutil.Error, IndexError, ValueError):
        job_json = Path(proc.cmdline()[-1])  # <work>/<job>/attempt-<n>/job.json
        return job_json.parent.parent.name, int(job_json.parent.name.split("-", 1)[1])
    return None, 0


def _chaos_kill(
    stack: Stack, pool: list[Proc], rng: random.Random, kinds: tuple[str, ...], snapshot: dict[str, dict[str, Any]]
) -> dict[str, Any] | None:
    ready = [w for w in pool if stack.ready(w)]
    if not ready:
        return None
    kind = rng.choice(kinds)
    worker = rng.choice(ready)
    # The attempt child this worker runs now, if any (descendant of the worker's pool process).
    child = None
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(worker.popen.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "workers.child" in p.cmdline():
                    child = p
    if kind == "child" and child is None:
        kind = "worker" if rng.random() < 0.5 else "group"
    job, attempt = _job_of_child(child) if child is not None else (None, 0)
    info: dict[str, Any] = {"kind": kind, "job": job, "attempts": attempt}
    if kind == "child":
        assert child is not None
        info["pid"] = child.pid
        with contextlib.suppress(psutil.Error):
            child.send_signal(signal.SIGKILL)
        info["job"] = None  # a child SIGKILLed from outside ends its job terminally (see docs/reliability.md)
        return info
    info["pid"] = worker.popen.pid
    with contextlib.suppress(ProcessLookupError):
        if kind == "group":
            os.killpg(worker.popen.pid, signal.SIGKILL)  # main + pool; the child follows by PDEATHSIG
        else:
            os.kill(worker.popen.pid, signal.SIGKILL)  # main only; the pool process is orphaned
    worker.popen.wait(10)
    if job is None or snapshot.get(job, {}).get("state") in TERMINAL:
        info["job"] = None
    return info


# ------------------------------------------------------------------------------------------ Redis crash


def run_redis_restart(
    *,
    before: float = 6.0,
    outage: float = 8.0,
    after: float = 6.0,
    interval: float = 0.25,
    workers: int = 1,
    lease_seconds: int = 10,
    reconcile_seconds: int = 2,
    drain_timeout: float = 150.0,
    log: Log = _log,
    tmp_parent: Path | None = None,
) -> dict[str, Any]:
    """Submit a job every ``interval`` s while SIGKILLing redis-server after ``before`` s and restarting it
    (same port, same AOF dir) ``outage`` s later; then wait until every accepted job is terminal."""
    result: dict[str, Any] = {"before_s": before, "outage_s": outage, "after_s": after, "interval_s": interval}
    result.update(workers=workers, lease_seconds=lease_seconds, loadavg_start=[round(x, 2) for x in os.getloadavg()])
    with workspace(parent=tmp_parent) as tmp:
        redis = RedisServer(tmp / "redis")
        redis.start()
        prefix = f"onnxforge-rel-{uuid.uuid4().hex[:10]}:"
        stack = Stack(
            tmp, broker_url=redis.url, key_prefix=prefix, cache__enabled=False, worker__lease_seconds=lease_seconds,
            worker__reconcile_interval_seconds=reconcile_seconds, **FAST_PIPELINE,
        )  # fmt: skip
        try:
            stack.start_api()
            for _ in range(workers):
                stack.start_worker()
            body = model_variants(1)[0]
            records: list[tuple[float, int, str | None, str | None]] = []  # (t, status, code, job id)
            ready_codes: list[tuple[float, int]] = []
            client = httpx.Client()
            t0 = time.monotonic()
            t_kill = t_restart = None
            count = int((before + outage + after) / interval)
            for n in range(count):
                target = t0 + n * interval
                now = time.monotonic()
                if now < target:
                    time.sleep(target - now)
                now = time.monotonic() - t0
                if t_kill is None and now >= before:
                    redis.kill()
                    t_kill = time.monotonic() - t0
                    log(f"redis: SIGKILL at {t_kill:.2f}s")
                if t_restart is None and t_kill is not None and now >= before + outage:
                    redis.start()
                    t_restart = time.monotonic() - t0
                    log(f"redis: restarted at {t_restart:.2f}s")
                try:
                    r = submit(client, stack.url, body)
                    code = r.json().get("code") if r.status_code != 202 else None
                    records.append(
                        (
                            time.monotonic() - t0,
                            r.status_code,
                            code,
                            r.json().get("id") if r.status_code == 202 else None,
                        )
                    )
                except httpx.HTTPError as exc:
                    records.append((time.monotonic() - t0, 0, type(exc).__name__, None))
                if n % 8 == 0:
                    with contextlib.suppress(httpx.HTTPError):
                        ready_codes.append(
                            (time.monotonic() - t0, client.get(f"{stack.url}/readyz", timeout=10).status_code)
                        )
            accepted = [r[3] for r in records if r[1] == 202 and r[3]]
            assert t_kill is not None and t_restart is not None
            during = [r for r in records if t_kill <= r[0] < t_restart]
            first_202 = next((r[0] for r in records if r[0] >= t_restart and r[1] == 202), None)
            statuses: dict[str, int] = {}
            for r in records:
                key = f"{r[1]} {r[2]}" if r[2] else str(r[1])
                statuses[key] = statuses.get(key, 0) + 1
            probe = BrokerProbe(redis.url, prefix)
            deadline = time.monotonic() + drain_timeout
            while True:  # wait_terminal, sampling the broker's queue on the way (the flood, bug 3)
                final = list_jobs(client, stack.url)
                probe.sample(sum(1 for i in accepted if final.get(i, {}).get("state") == "queued"))
                if all(final.get(i, {}).get("state") in TERMINAL for i in accepted) or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            t_drained = time.monotonic() - t0
            lost = [i for i in accepted if final.get(i, {}).get("state") not in TERMINAL]
            queue_len = probe.waiting()
            result.update(
                broker_max_waiting=probe.max_waiting,
                broker_max_excess=probe.max_excess,
                broker_unacked_after=probe.unacked(),
                reconciler_reenqueued=reenqueue_count(stack.logs),
                loadavg_end=[round(x, 2) for x in os.getloadavg()],
            )
            probe.close()
            server_errors = [r for r in records if r[1] >= 500 and r[2] != "BROKER_UNAVAILABLE"]
            result.update(
                submitted=len(records),
                accepted=len(accepted),
                statuses=statuses,
                during_outage={
                    k: sum(1 for r in during if f"{r[1]} {r[2]}" == k) for k in {f"{r[1]} {r[2]}" for r in during}
                },
                server_errors=len(server_errors),
                five_hundreds=sum(1 for r in records if r[1] == 500),
                readyz=ready_codes,
                t_kill=round(t_kill, 2),
                t_restart=round(t_restart, 2),
                api_recovery_seconds=round(first_202 - t_restart, 2) if first_202 is not None else None,
                drain_seconds_after_restart=round(t_drained - t_restart, 2),
                lost=lost,
                terminal=len(accepted) - len(lost),
                states={s: sum(1 for i in accepted if final.get(i, {}).get("state") == s) for s in TERMINAL},
                max_attempts_seen=max((final[i]["attempts"] for i in accepted if i in final), default=0),
                broker_queue_length_after=queue_len,
            )
            client.close()
        finally:
            try:
                stack.close()
            finally:
                redis.stop()
    return result


# ---------------------------------------------------------------------------------------------- OOM cap


def oom_model() -> bytes:
    """A tiny model whose first run allocates 64 GiB: ConstantOfShape of a shape hidden behind Identity, so no
    static check sees it and only the child's memory limit stops it (like T7's runtime memory bomb)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["shape"], ["shape2"], name="hide"),
            helper.make_node("ConstantOfShape", ["shape2"], ["big"], name="bomb"),
            helper.make_node("ReduceSum", ["big"], ["s"], name="sum", keepdims=0),
            helper.make_node("Add", ["x", "s"], ["y"], name="add"),
        ],
        "oom",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        initializer=[numpy_helper.from_array(np.array([1 << 34], np.int64), "shape")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def run_oom(
    *,
    max_attempts: int = 3,
    lease_seconds: int = 10,
    reconcile_seconds: int = 2,
    child_memory_mb: int = 4096,
    timeout: float = 300.0,
    log: Log = _log,
    tmp_parent: Path | None = None,
) -> dict[str, Any]:
    """The attempt cap (security.md T16) with one worker, lease ``lease_seconds``:

    A. a model whose run always exceeds the child's memory limit, then a good job behind it;
    B. a job whose every attempt takes its worker down with it, as when the kernel's OOM killer picks the
       worker rather than the child (no per-child cgroup yet, T7): the run SIGKILLs the worker's process
       group as soon as that job's attempt child appears, and restarts the worker; a good job waits behind.

    Each ends with the job's state, error code and attempts, and the good job's state."""
    result: dict[str, Any] = {"max_attempts": max_attempts, "lease_seconds": lease_seconds}
    result["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    with workspace(parent=tmp_parent) as tmp:
        redis = RedisServer(tmp / "redis")
        redis.start()
        stack = Stack(
            tmp, broker_url=redis.url, cache__enabled=False, worker__lease_seconds=lease_seconds,
            worker__reconcile_interval_seconds=reconcile_seconds, worker__max_attempts=max_attempts,
            worker__child_memory_mb=child_memory_mb, fault="sleep:1", **FAST_PIPELINE,
        )  # fmt: skip
        try:
            stack.start_api()
            worker = stack.start_worker()
            client = httpx.Client()
            good = model_variants(1)[0]

            # A: the child runs out of memory on every delivery.
            t0 = time.monotonic()
            oom_id = submit(client, stack.url, oom_model()).raise_for_status().json()["id"]
            after_oom = submit(client, stack.url, good).raise_for_status().json()["id"]
            final = wait_terminal(client, stack.url, [oom_id, after_oom], timeout)
            result["child_oom"] = {
                "state": final[oom_id]["state"],
                "error_code": (final[oom_id].get("error") or {}).get("code"),
                "attempts": final[oom_id]["attempts"],
                "next_job_state": final[after_oom]["state"],
                "seconds": round(time.monotonic() - t0, 2),
            }
            log(f"oom: child OOM {result['child_oom']}")

            # B: every attempt of one job kills its worker.
            t0 = time.monotonic()
            poison_id = submit(client, stack.url, good).raise_for_status().json()["id"]
            behind = submit(client, stack.url, good).raise_for_status().json()["id"]
            kills = 0
            deadline = t0 + timeout
            while time.monotonic() < deadline:
                jobs = list_jobs(client, stack.url)
                if jobs[poison_id]["state"] in TERMINAL and jobs[behind]["state"] in TERMINAL:
                    break
                if any(_job_of_child(c)[0] == poison_id for c in stack.children()) and worker.alive:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(worker.popen.pid, signal.SIGKILL)
                    worker.popen.wait(10)
                    kills += 1
                    log(f"oom: killed the worker running {poison_id} ({kills})")
                if not worker.alive:
                    worker = stack.start_worker()
                time.sleep(0.2)
            final = list_jobs(client, stack.url)
            result["worker_killed_every_attempt"] = {
                "state": final[poison_id]["state"],
                "error_code": (final[poison_id].get("error") or {}).get("code"),
                "attempts": final[poison_id]["attempts"],
                "worker_kills": kills,
                "next_job_state": final[behind]["state"],
                "seconds": round(time.monotonic() - t0, 2),
            }
            log(f"oom: worker killed every attempt {result['worker_killed_every_attempt']}")
            client.close()
        finally:
            try:
                stack.close()
            finally:
                redis.stop()
        result["children_after_close"] = len(stack.children())
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


# ----------------------------------------------------------------------------------------- big uploads


_BLOCK = os.urandom(1 << 20)


def write_big_archive(path: Path, data_bytes: int) -> tuple[int, int]:
    """A zip (stored) of ``model.onnx`` with one float32 initializer of ``data_bytes`` in ``weights.bin``,
    streamed to disk in 1 MiB blocks. Returns (archive size, model.onnx size)."""
    import onnx
    from onnx import TensorProto, helper

    data_bytes -= data_bytes % 4
    init = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[data_bytes // 4])
    init.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "weights.bin"), ("offset", "0"), ("length", str(data_bytes))):
        entry = init.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["w"], ["y"], keepdims=0)],
        "big",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        initializer=[init],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto = model.SerializeToString()
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        zf.writestr(zipfile.ZipInfo("model.onnx", date_time=(1980, 1, 1, 0, 0, 0)), proto)
        info = zipfile.ZipInfo("weights.bin", date_time=(1980, 1, 1, 0, 0, 0))
        with zf.open(info, "w", force_zip64=True) as out:
            left = data_bytes
            while left:
                n = min(left, len(_BLOCK))
                out.write(_BLOCK[:n])
                left -= n
    del onnx
    return path.stat().st_size, len(proto)


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


def multipart_stream(
    path: Path, boundary: str, config: dict[str, Any], name: str = "model.zip"
) -> tuple[int, Iterator[bytes]]:
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="config"\r\n\r\n{json.dumps(config)}\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"; filename="{name}"\r\n'
        "Content-Type: application/zip\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    size = len(head) + path.stat().st_size + len(tail)

    def chunks() -> Iterator[bytes]:
        yield head
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                yield block
        yield tail

    return size, chunks()


def api_process(stack: Stack) -> psutil.Process:
    """The uvicorn process (``onnxforge serve`` itself in embedded mode with no workers)."""
    assert stack.api is not None
    return psutil.Process(stack.api.popen.pid)


def run_upload(*, gb: float = 2.2, log: Log = _log, tmp_parent: Path | None = None) -> dict[str, Any]:
    """Upload a zip of model.onnx + ``gb`` GB of external data over loopback (streamed, with Content-Length);
    measure throughput and the API process's RSS increase; then validate the extracted model in a
    subprocess and report its peak RSS."""
    result: dict[str, Any] = {"data_gb": gb, "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    with workspace(parent=tmp_parent) as tmp:
        archive = tmp / "big.zip"
        t = time.monotonic()
        size, proto_size = write_big_archive(archive, int(gb * 1e9))
        result["archive_bytes"] = size
        result["generate_seconds"] = round(time.monotonic() - t, 2)
        log(f"upload: archive {size / 1e9:.2f} GB written in {result['generate_seconds']} s")
        stack = Stack(tmp, worker__embedded_workers=0, api__max_upload_bytes=max(4 << 30, size + (1 << 20)))
        try:
            stack.start_api()
            with httpx.Client() as c:  # warm the app (imports, DB) before the baseline
                submit(c, stack.url, MODEL.read_bytes())
            time.sleep(0.5)
            boundary = uuid.uuid4().hex
            length, body = multipart_stream(archive, boundary, CONFIG)
            with archive.open("rb") as f:  # streamed: the archive may be larger than this machine's free memory
                digest = hashlib.file_digest(f, "sha256")
            with RssSampler(api_process(stack).pid) as rss:
                t = time.monotonic()
                r = httpx.post(
                    f"{stack.url}/v1/jobs",
                    content=body,
                    headers={
                        "Content-Type": f"multipart/form-data; boundary={boundary}",
                        "Content-Length": str(length),
                    },
                    timeout=600,
                )
                elapsed = time.monotonic() - t
            result.update(
                status=r.status_code,
                upload_seconds=round(elapsed, 2),
                throughput_mb_s=round(length / elapsed / 1e6, 1),
                api_rss_baseline_mb=round(rss.baseline / 2**20, 1),
                api_rss_peak_mb=round(rss.peak / 2**20, 1),
                api_rss_increase_mb=round((rss.peak - rss.baseline) / 2**20, 1),
            )
            if r.status_code == 202:
                job = r.json()
                result["sha256_matches"] = job["model"]["sha256"] == digest.hexdigest()
                result["model_format"] = job["model"]["format"]
            else:
                result["error"] = r.text[:500]
            log(
                f"upload: {r.status_code} {result.get('throughput_mb_s')} MB/s, "
                f"API RSS +{result['api_rss_increase_mb']} MB"
            )
        finally:
            stack.close()
        # Validation: extract (as the worker does) and validate in a fresh process; peak RSS from VmHWM.
        extract = tmp / "job" / "attempt-1" / "input"
        extract.mkdir(parents=True)
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(extract)
        archive.unlink()
        result["validate"] = validate_peak(extract / "model.onnx", tmp / "job")
        result["validate"]["model_onnx_bytes"] = proto_size
    return result


_VALIDATE_PROBE = r"""
import json, resource, sys, time
from pathlib import Path
from workers.validate import validate_model_dir
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before = hwm()
t = time.monotonic()
try:
    validate_model_dir(Path(sys.argv[1]), Path(sys.argv[2]))
    outcome = "ok"
except Exception as exc:
    outcome = getattr(exc, "code", type(exc).__name__)
seconds = round(time.monotonic() - t, 3)
print(json.dumps({"outcome": outcome, "seconds": seconds, "hwm_before": before, "hwm_after": hwm()}))
"""


def validate_peak(model: Path, job_dir: Path) -> dict[str, Any]:
    """Run workers.validate.validate_model_dir in a subprocess; peak RSS (VmHWM) before and after."""
    out = subprocess.run(
        [sys.executable, "-c", _VALIDATE_PROBE, str(model), str(job_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    data = json.loads(out.stdout.strip().splitlines()[-1])
    size = model.stat().st_size
    data["model_onnx_mb"] = round(size / 2**20, 2)
    data["peak_increase_mb"] = round((data["hwm_after"] - data["hwm_before"]) / 2**20, 1)
    data["peak_increase_over_model"] = round((data["hwm_after"] - data["hwm_before"]) / size, 2)
    return data


def run_validate(*, mb: float = 300.0, tmp_parent: Path | None = None) -> dict[str, Any]:
    """Validator peak memory on a model.onnx of ``mb`` MB of inline weights (the 1.5x target of (b))."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    with workspace(parent=tmp_parent) as tmp:
        folder = tmp / "job" / "attempt-1" / "input"
        folder.mkdir(parents=True)
        n = int(mb * 1e6) // 4
        w = numpy_helper.from_array(np.frombuffer(_BLOCK * (n * 4 // len(_BLOCK) + 1), dtype=np.float32)[:n], "w")
        graph = helper.make_graph(
            [helper.make_node("ReduceSum", ["w"], ["y"], keepdims=0)],
            "inline",
            [],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
            initializer=[w],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        (folder / "model.onnx").write_bytes(model.SerializeToString())
        del model, graph, w, onnx
        return validate_peak(folder / "model.onnx", tmp / "job")


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
            n = min(left, len(_BLOCK))
            yield _BLOCK[:n]
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
    log: Log = _log,
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


# --------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reliability", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("chaos", help="SIGKILL workers and attempt children while jobs run")
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--kill-min", type=float, default=5.0)
    p.add_argument("--kill-max", type=float, default=20.0)
    p.add_argument("--lease", type=int, default=10)
    p.add_argument("--reconcile", type=int, default=2)
    p.add_argument("--child-sleep", type=float, default=1.0, help="test hook: seconds each attempt sleeps first")
    p.add_argument("--timeout", type=float, default=3000.0)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("redis", help="SIGKILL redis-server under load and restart it")
    p.add_argument("--before", type=float, default=10.0)
    p.add_argument("--outage", type=float, default=15.0)
    p.add_argument("--after", type=float, default=10.0)
    p.add_argument("--interval", type=float, default=0.2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--drain-timeout", type=float, default=150.0, help="seconds to wait for accepted jobs to end")
    p = sub.add_parser("oom", help="the attempt cap: a job that always runs out of memory or kills its worker")
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--lease", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300.0)
    p = sub.add_parser("upload", help="one big zip (model.onnx + external data) upload")
    p.add_argument("--gb", type=float, default=2.2)
    p = sub.add_parser("load", help="concurrent uploads plus status polling")
    p.add_argument("--uploads", type=int, default=8)
    p.add_argument("--upload-mb", type=float, default=100)
    p.add_argument("--rps", type=float, default=200)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--slots", type=int, default=None, help="per-tenant upload cap (default: --uploads)")
    p = sub.add_parser("validate", help="validator peak memory on a big inline model.onnx")
    p.add_argument("--mb", type=float, default=300)
    args = parser.parse_args(argv)

    if args.cmd == "chaos":
        result = run_chaos(
            jobs=args.jobs, workers=args.workers, kill_every=(args.kill_min, args.kill_max), lease_seconds=args.lease,
            reconcile_seconds=args.reconcile, child_sleep=args.child_sleep, timeout=args.timeout, seed=args.seed,
        )  # fmt: skip
    elif args.cmd == "redis":
        result = run_redis_restart(
            before=args.before, outage=args.outage, after=args.after, interval=args.interval, workers=args.workers,
            drain_timeout=args.drain_timeout,
        )  # fmt: skip
    elif args.cmd == "oom":
        result = run_oom(max_attempts=args.max_attempts, lease_seconds=args.lease, timeout=args.timeout)
    elif args.cmd == "upload":
        result = run_upload(gb=args.gb)
    elif args.cmd == "load":
        result = run_load(
            uploads=args.uploads, upload_mb=args.upload_mb, rps=args.rps, seconds=args.seconds, upload_slots=args.slots
        )
    else:
        result = run_validate(mb=args.mb)
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
