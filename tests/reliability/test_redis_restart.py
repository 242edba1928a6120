"""Redis SIGKILL and restart under load (security.md T17, checklist (b)): a private redis-server with AOF,
jobs submitted every second throughout; 503 BROKER_UNAVAILABLE (never 500) while it is down; every job
accepted with 202 ends terminal and the broker queue drains after the restart on the same port and dir.

The longer run is ``python -m bench.reliability redis``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.reliability import run_redis_restart

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def test_redis_sigkill_loses_no_accepted_job_and_answers_503_during_the_outage(redis_binary: str, tmp_path: Path):
    r = run_redis_restart(before=4.0, outage=6.0, after=4.0, interval=1.0, workers=2, drain_timeout=150, log=print,
                          tmp_parent=tmp_path)  # fmt: skip
    print(r)
    assert r["five_hundreds"] == 0 and r["server_errors"] == 0, r["statuses"]
    assert set(r["during_outage"]) <= {"503 BROKER_UNAVAILABLE"}, r["during_outage"]
    assert r["during_outage"].get("503 BROKER_UNAVAILABLE", 0) >= 3
    assert any(code == 503 for t, code in r["readyz"] if r["t_kill"] + 1 < t < r["t_restart"]), r["readyz"]
    assert r["accepted"] >= 5
    assert r["lost"] == [] and r["terminal"] == r["accepted"], r
    assert r["states"]["succeeded"] == r["accepted"], r["states"]
    assert r["api_recovery_seconds"] is not None and r["api_recovery_seconds"] <= 30
    assert r["broker_queue_length_after"] == 0
