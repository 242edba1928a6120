"""SIGKILL chaos (security.md T16, checklist (b)): 2 workers, random SIGKILLs of a worker main process,
a worker's whole process group or an attempt child every few seconds, until every job is terminal.

The full run is ``python -m bench.reliability chaos --jobs 200``; this one is small enough for ``make test``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.reliability import run_chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

JOBS = 12
LEASE = 10
RECONCILE = 2
MAX_ATTEMPTS = 3
# Each attempt sleeps this long in its child, so the backlog outlasts two leases by the sleeps alone
# (12 jobs / 2 workers x 3.5 s = 21 s > 2 x 10 s), however fast the pipeline itself gets.
CHILD_SLEEP = 3.5
# Outcomes a kill may cause: a child SIGKILLed from outside looks like the kernel's OOM killer
# (RESOURCE_LIMIT_EXCEEDED, terminal); a job killed max_attempts times fails WORKER_LOST.
KILL_OUTCOMES = {"RESOURCE_LIMIT_EXCEEDED", "WORKER_LOST"}


@pytest.fixture(scope="module")
def chaos(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_chaos(
        jobs=JOBS, workers=2, variants=2, kill_every=(4.0, 7.0), lease_seconds=LEASE, reconcile_seconds=RECONCILE,
        max_attempts=MAX_ATTEMPTS, child_sleep=CHILD_SLEEP, timeout=200.0, seed=1234, log=print,
        tmp_parent=Path(tmp_path_factory.mktemp("chaos")),
    )  # fmt: skip


def test_chaos_every_job_reaches_a_terminal_state_when_workers_are_killed(chaos: dict[str, Any]):
    assert chaos["reference_states"] == ["succeeded", "succeeded"]
    assert chaos["kills"] >= 3, chaos["kill_log"]
    assert chaos["drained"], chaos
    assert chaos["lost"] == []
    assert chaos["terminal"] == JOBS


def test_chaos_commits_one_artifact_identical_to_a_kill_free_run_per_succeeded_job(chaos: dict[str, Any]):
    assert chaos["succeeded"] >= 1, chaos
    assert chaos["artifacts_matching_reference"] == chaos["succeeded"], chaos["artifacts_mismatched"]
    assert chaos["artifacts_missing_blob"] == []
    assert chaos["attempts_over_cap"] == [] and chaos["max_attempts_seen"] <= MAX_ATTEMPTS
    assert set(chaos["failed_codes"]) <= KILL_OUTCOMES, chaos["failed_detail"]
    assert chaos["failed_codes"].get("RESOURCE_LIMIT_EXCEEDED", 0) <= chaos["kills_by_kind"]["child"]


def test_chaos_recovers_each_interrupted_job_within_the_lease_plus_a_minute(chaos: dict[str, Any]):
    # Recovery: from the kill until the interrupted job runs again (a later attempt) or is terminal. It is
    # bounded by the lease (10 s), the reconcile interval (2 s), a worker restart and the queue ahead of it.
    assert chaos["unrecovered_kills"] == 0
    if chaos["recoveries_measured"]:
        assert chaos["recovery_seconds_max"] <= LEASE + 60, chaos


def test_chaos_leaves_no_process_behind(chaos: dict[str, Any]):
    assert chaos["children_after_close"] == 0


def test_chaos_leaves_no_attempt_directory_of_killed_attempts(chaos: dict[str, Any]):
    assert chaos["leftover_attempt_dirs"] == 0, chaos["leftover_attempt_dir_names"]


def test_chaos_enqueues_again_only_what_kills_lost_when_backlog_outlasts_two_leases(chaos: dict[str, Any]):
    # 12 jobs on 2 workers take far longer than 2 x lease, so every queued job goes stale while its message
    # waits. Re-enqueueing on staleness alone added each of them to the queue again every round (bug 3 in
    # docs/reliability.md); now only a message that a killed worker took with it is enqueued again.
    assert JOBS / 2 * CHILD_SLEEP > 2 * LEASE  # the premise, by construction
    assert chaos["chaos_seconds"] > 2 * LEASE
    worker_kills = chaos["kills_by_kind"]["worker"] + chaos["kills_by_kind"]["group"]
    assert chaos["reconciler_reenqueued"] <= worker_kills, chaos["reconciler_reenqueued"]
    assert chaos["broker_max_excess"] <= worker_kills, (chaos["broker_max_excess"], chaos["broker_max_waiting"])
    assert chaos["broker_waiting_after"] == 0
