"""Shared service fixtures: real Redis (own db and key prefix), PostgreSQL, uvicorn and Celery workers.

Nothing here mocks a service, and nothing needs to be started by hand. Redis: the one on
127.0.0.1:$TEST_REDIS_PORT (6379) when it answers PING, else a private ``redis-server`` started from the
system binary; tests use db 11 and a key prefix unique to the session, and cleanup deletes only keys under
that prefix. PostgreSQL: the one on 127.0.0.1:$TEST_POSTGRES_PORT (5432) when user ``postgres`` reaches
database ``test`` there without a password, else a private cluster made by Debian's ``initdb`` and run by
``pg_ctl`` in a temporary directory (as user ``postgres`` when the tests run as root, which initdb refuses);
tests work in schemas of their own that they drop afterwards. Pointing either variable at a port where
nothing listens makes the tests start their own server, which is how the private path is tested.

Subprocesses (``onnxforge serve``, ``onnxforge worker``) get their settings as ``ONNXFORGE_*`` environment
variables built by ``service_env``; every one started through ``Services`` is terminated at teardown.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "models"
REDIS_DB = 11
# Where a shared server is looked for before a private one is started (see the module docstring).
REDIS_PORT = int(os.environ.get("TEST_REDIS_PORT", "6379"))
POSTGRES_PORT = int(os.environ.get("TEST_POSTGRES_PORT", "5432"))
POSTGRES_DB = "test"
ONNXFORGE = [sys.executable, "-m", "onnxforge.cli"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------- Redis


class _PrivateRedis:
    """A throw-away ``redis-server`` on a free loopback port: no persistence, its directory removed at stop."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                f"no Redis answers on 127.0.0.1:{REDIS_PORT} and redis-server is not installed: "
                "apt-get install redis-server (make test does, as root)"
            )
        self.root = Path(tempfile.mkdtemp(prefix="onnxforge-test-redis-"))
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.root)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not _redis_answers(self.port):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                pytest.fail(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def stop(self) -> None:
        try:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """``redis://127.0.0.1:<port>`` of a Redis that answers PING (the shared one, or a private one)."""
    if _redis_answers(REDIS_PORT):
        yield f"redis://127.0.0.1:{REDIS_PORT}"
        return
    server = _PrivateRedis()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_prefix() -> str:
    return f"onnxforge-test-{uuid.uuid4().hex[:12]}:"


def _delete_keys(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_url(redis_server: str, redis_prefix: str) -> Iterator[str]:
    """The broker URL for tests (db 11). Every key under this session's prefix is deleted afterwards."""
    url = f"{redis_server}/{REDIS_DB}"
    yield url
    _delete_keys(url, redis_prefix)


@pytest.fixture
def redis_test_prefix(redis_url: str, redis_prefix: str) -> Iterator[str]:
    """A key prefix of this test's own under the session's: tests that count queue messages see only
    theirs. Its keys are deleted when the test ends."""
    own = f"{redis_prefix}{uuid.uuid4().hex[:8]}:"
    yield own
    _delete_keys(redis_url, own)


@pytest.fixture(scope="session")
def redis_broker(redis_url: str, redis_prefix: str) -> dict[str, str]:
    """``service_env`` keyword arguments for the test Redis broker (db 11, this session's key prefix)."""
    return {"broker_url": redis_url, "key_prefix": redis_prefix}


# -------------------------------------------------------------------------------------------- PostgreSQL


def _postgres_answers(url: str) -> bool:
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT 1"))
        return True
    except sqlalchemy.exc.OperationalError:
        return False
    finally:
        engine.dispose()


def _postgres_bin(name: str) -> str | None:
    """``name`` from PATH, else from Debian's versioned directory (which the postgresql package leaves off PATH)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(Path(p).parts[-3]))
    return candidates[-1] if candidates else None


class _PrivatePostgres:
    """A throw-away PostgreSQL cluster on a free loopback port: trust auth, fsync off, database ``test``."""

    def __init__(self) -> None:
        initdb, self.pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
        if initdb is None or self.pg_ctl is None:
            pytest.fail(
                f"no PostgreSQL answers on 127.0.0.1:{POSTGRES_PORT} and initdb/pg_ctl are not installed: "
                "apt-get install postgresql (make test does, as root)"
            )
        # initdb and postgres refuse to run as root; Debian's package creates the `postgres` user.
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = next((u for u in ("postgres", "nobody") if _user_exists(u)), None)
            if self.user is None:
                pytest.fail("running as root and neither user postgres nor nobody exists to run PostgreSQL")
        # Not under pytest's basetemp: that directory is 0700 and the postgres user could not enter it.
        self.root = Path(tempfile.mkdtemp(prefix="onnxforge-test-pg-"))
        self.data = self.root / "data"
        if self.user:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.port = free_port()
        self._run([initdb, "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C",
                   "--no-sync"])  # fmt: skip
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -F"
        self._run([self.pg_ctl, "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60",
                   "-o", options, "start"])  # fmt: skip
        import sqlalchemy

        engine = sqlalchemy.create_engine(
            f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres", isolation_level="AUTOCOMMIT"
        )
        try:
            with engine.connect() as conn:
                conn.execute(sqlalchemy.text(f'CREATE DATABASE "{POSTGRES_DB}"'))
        finally:
            engine.dispose()

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{POSTGRES_DB}"

    def _run(self, argv: list[str]) -> None:
        result = subprocess.run(
            argv, user=self.user, cwd=self.root, capture_output=True, text=True, timeout=120, check=False
        )
        if result.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            pytest.fail(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}{result.stderr}{tail}")

    def stop(self) -> None:
        try:
            if self.data.exists():
                subprocess.run(
                    [self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop"],
                    user=self.user, cwd=self.root, capture_output=True, timeout=60, check=False,
                )  # fmt: skip
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """SQLAlchemy URL of database ``test`` as user ``postgres`` (trust auth): the shared server, or a private one.

    Tests never write outside schemas of their own (see ``postgres_url``).
    """
    shared = f"postgresql+psycopg://postgres@127.0.0.1:{POSTGRES_PORT}/{POSTGRES_DB}"
    if _postgres_answers(shared):
        yield shared
        return
    server = _PrivatePostgres()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_url(postgres_server: str) -> Iterator[tuple[str, str]]:
    """(SQLAlchemy URL, schema name) for the services: a schema of this session's, dropped afterwards."""
    import sqlalchemy

    schema = f"onnxforge_test_{uuid.uuid4().hex[:10]}"
    try:
        yield postgres_server, schema
    finally:
        engine = sqlalchemy.create_engine(postgres_server, connect_args={"connect_timeout": 3})
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()


# ---------------------------------------------------------------------------------------------- settings


def service_env(
    data_dir: Path,
    *,
    broker_url: str | None = None,
    key_prefix: str | None = None,
    database_url: str | None = None,
    schema: str | None = None,
    **extra: Any,
) -> dict[str, str]:
    """The environment of a service subprocess: this one minus ONNXFORGE_*, plus the given settings.

    ``extra`` keys are ``section__field`` (``worker__lease_seconds=10``).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONNXFORGE_")}
    env["ONNXFORGE_STORAGE__DATA_DIR"] = str(data_dir)
    env["PYTHONUNBUFFERED"] = "1"
    if broker_url:
        env["ONNXFORGE_BROKER__URL"] = broker_url
    if key_prefix:
        env["ONNXFORGE_BROKER__KEY_PREFIX"] = key_prefix
    if database_url:
        env["ONNXFORGE_DATABASE__URL"] = database_url
    if schema:
        env["ONNXFORGE_DATABASE__SCHEMA_NAME"] = schema
    for key, value in extra.items():
        env[f"ONNXFORGE_{key.upper()}"] = str(value)
    return env


# A fast pipeline for service tests: few benchmark runs, short budgets.
FAST_PIPELINE = {
    "pipeline__benchmark_warmup": 1,
    "pipeline__benchmark_min_runs": 3,
    "pipeline__benchmark_max_seconds": 0.5,
    "pipeline__ledger_runs": 2,
    "pipeline__verify_shape_sets": 2,
}


# ------------------------------------------------------------------------------------------ subprocesses


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    url: str | None = None

    def log_tail(self, size: int = 6000) -> str:
        try:
            return self.log.read_bytes()[-size:].decode("utf-8", "replace")
        except OSError:
            return ""


@dataclass
class Services:
    """Starts service subprocesses and terminates them (SIGTERM, then SIGKILL) at teardown."""

    logs: Path
    started: list[Service] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str], url: str | None = None) -> Service:
        log = self.logs / f"{name}-{len(self.started)}.log"
        handle = log.open("wb")
        proc = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        handle.close()
        service = Service(name, proc, log, url)
        self.started.append(service)
        return service

    def serve(self, env: dict[str, str], *, embedded: bool) -> Service:
        """``onnxforge serve`` on a free loopback port; returns once /healthz answers."""
        port = free_port()
        env = {**env, "ONNXFORGE_API__HOST": "127.0.0.1", "ONNXFORGE_API__PORT": str(port)}
        service = self.start("serve" if embedded else "api", [*ONNXFORGE, "serve"], env, f"http://127.0.0.1:{port}")
        wait_healthy(service)
        return service

    def worker(self, env: dict[str, str], queues: str = "cpu,gpu") -> Service:
        """``onnxforge worker``; returns once Celery logged that it is ready."""
        service = self.start("worker", [*ONNXFORGE, "worker", "--queues", queues, "--concurrency", "1"], env)
        deadline = time.monotonic() + 60
        while "ready." not in service.log_tail(20000):
            if service.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"worker did not start:\n{service.log_tail()}")
            time.sleep(0.1)
        return service

    def stop(self, service: Service, grace: float = 15.0) -> None:
        if service.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.proc.pid, signal.SIGTERM)
            try:
                service.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(service.proc.pid, signal.SIGKILL)
                service.proc.wait(timeout=10)

    def stop_all(self) -> None:
        for service in reversed(self.started):
            self.stop(service)


def wait_healthy(service: Service, timeout: float = 60.0) -> None:
    assert service.url
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            pytest.fail(f"{service.name} exited with {service.proc.returncode}:\n{service.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{service.url}/healthz", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    pytest.fail(f"{service.name} did not answer /healthz within {timeout} s:\n{service.log_tail()}")


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    logs = tmp_path / "logs"
    logs.mkdir()
    running = Services(logs)
    try:
        yield running
    finally:
        running.stop_all()
