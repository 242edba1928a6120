"""`make test` on a fresh machine: the suite starts the Redis and PostgreSQL it needs when none answers.

tests/conftest.py uses the servers on 127.0.0.1 ($TEST_REDIS_PORT, $TEST_POSTGRES_PORT) when they answer,
else private ones from the installed binaries. Both paths are exercised here on this machine, whatever it
runs: the private servers directly, and a child pytest run pointed at ports where nothing listens, which
must start its own servers, pass, and leave no server or directory behind.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from core.store import JobStore
from tests.conftest import ROOT, _PrivatePostgres, _PrivateRedis, _redis_answers, free_port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.integration
def test_private_postgres_serves_the_job_store_then_leaves_nothing_behind():
    server = _PrivatePostgres()
    root = server.root
    try:
        assert server.port != 5432 and _listening(server.port)
        store = JobStore(server.url, schema=f"onnxforge_test_{uuid.uuid4().hex[:8]}")
        store.create_schema()
        job = store.create(
            tenant="default", model_sha256="a" * 64, model_filename="m.onnx", model_format="onnx",
            model_size=1, samples_sha256=None, config={}, queue="cpu",
        )  # fmt: skip
        assert store.get(job.id).tenant == "default"
        store.close()
    finally:
        server.stop()
    assert not _listening(server.port)
    assert not root.exists()


@pytest.mark.integration
def test_private_redis_answers_then_leaves_nothing_behind():
    server = _PrivateRedis()
    try:
        assert _redis_answers(server.port)
    finally:
        server.stop()
    assert not _redis_answers(server.port)
    assert not server.root.exists()


@pytest.mark.integration
@pytest.mark.slow
def test_suite_starts_its_own_servers_when_nothing_answers_on_the_configured_ports():
    dead_redis, dead_postgres = free_port(), free_port()
    # The child's temporary directory, traversable by the postgres user (pytest's own is 0700): its private
    # servers live there, so what they leave behind is seen here and nowhere else.
    scratch = Path(tempfile.mkdtemp(prefix="onnxforge-fresh-"))
    scratch.chmod(0o755)
    env = {**os.environ, "TMPDIR": str(scratch), "TEST_REDIS_PORT": str(dead_redis),
           "TEST_POSTGRES_PORT": str(dead_postgres)}  # fmt: skip
    # The PostgreSQL job-store tests, and a distributed job over Redis with the store on PostgreSQL, through
    # the session fixtures.
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k", "postgresql",
             "tests/test_store.py", "tests/integration/test_service_redis.py"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        left = sorted(p.name for p in scratch.glob("onnxforge-test-*"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, f"{result.stdout[-4000:]}{result.stderr[-2000:]}"
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary and "error" not in summary, summary
    assert not _listening(dead_redis) and not _listening(dead_postgres)
    assert not left, f"private server directories left behind: {left}"


def _make_dry_run(target: str) -> str:
    """What ``make <target>`` would run from scratch (-B: as if no stamp existed)."""
    result = subprocess.run(
        ["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_make_run_installs_only_what_serving_needs():
    installs = [line for line in _make_dry_run("run").splitlines() if "pip install" in line and " -e " in line]
    assert installs == [".venv/bin/python -m pip install --quiet -e '.[cpu,prepost]'"]


def test_make_test_installs_the_test_extra_and_the_servers_it_needs():
    commands = _make_dry_run("test")
    assert ".venv/bin/python -m pip install --quiet -e '.[test]'" in commands
    assert "apt-get install" in commands and "redis-server" in commands and "postgresql" in commands


def test_make_servers_installs_redis_and_postgresql_with_apt_when_missing(tmp_path: Path):
    # A PATH with none of the server binaries, and an apt-get that records what it is asked for.
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    for tool in ("id", "ls"):
        (fakebin / tool).symlink_to(shutil.which(tool))
    calls = tmp_path / "apt-calls"
    (fakebin / "apt-get").write_text(f'#!/bin/bash\necho "$*" >> {calls}\n')
    (fakebin / "apt-get").chmod(0o755)
    env = {**os.environ, "PATH": str(fakebin)}
    result = subprocess.run(
        [shutil.which("make"), "servers"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    if os.geteuid() != 0:
        assert not calls.exists() and "install them as root" in result.stderr
        return
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("update")
    assert lines[1].split()[-4:] == ["redis-server", "redis-tools", "postgresql", "postgresql-client"]
