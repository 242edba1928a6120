"""Reliability tests (measured in docs/reliability.md): the runs live in bench/reliability/, with their own
redis-server (AOF on, free port), API and worker subprocesses and temp data dirs; these tests call them
with small parameters and assert on what they measured. Nothing here touches the shared Redis."""

from __future__ import annotations

import shutil

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: apt-get install redis-server")
    return binary
