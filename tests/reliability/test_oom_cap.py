"""The attempt cap (security.md T16, checklist (b) "OOM cap"): a job that always runs out of memory reaches
FAILED after at most ``max_attempts`` deliveries, and the job queued behind it still runs.

Two ways a job can run out of memory: its child hits the memory limit (classified, terminal at once), or
the kernel's OOM killer takes the worker down with it on every delivery, which only the attempt counter
stops. The second is staged by SIGKILLing the worker's process group whenever that job's child appears.
The longer run is ``python -m bench.reliability oom``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.reliability import run_oom

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_ATTEMPTS = 3


@pytest.fixture(scope="module")
def oom(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_oom(
        max_attempts=MAX_ATTEMPTS, lease_seconds=5, reconcile_seconds=1, timeout=240.0, log=print,
        tmp_parent=Path(tmp_path_factory.mktemp("oom")),
    )  # fmt: skip


def test_oom_job_fails_at_its_first_delivery_when_the_child_runs_out_of_memory(oom: dict[str, Any]):
    child = oom["child_oom"]
    # ORT's allocator may refuse the 64 GiB first (MODEL_RUN_FAILED) or the child's RLIMIT_AS stop it.
    assert (child["state"], child["attempts"]) == ("failed", 1), child
    assert child["error_code"] in {"RESOURCE_LIMIT_EXCEEDED", "MODEL_RUN_FAILED"}, child
    assert child["next_job_state"] == "succeeded"


def test_oom_job_fails_worker_lost_after_max_attempts_when_every_attempt_kills_its_worker(oom: dict[str, Any]):
    lost = oom["worker_killed_every_attempt"]
    assert (lost["state"], lost["error_code"]) == ("failed", "WORKER_LOST"), lost
    assert lost["attempts"] == MAX_ATTEMPTS == lost["worker_kills"]
    assert lost["next_job_state"] == "succeeded"
    assert oom["children_after_close"] == 0
