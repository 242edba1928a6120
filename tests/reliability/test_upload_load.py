"""Bounded-memory upload and status polling under upload load (checklist (b)), short versions.

The full runs: ``python -m bench.reliability upload --gb 2.2`` and ``... load --uploads 8 --upload-mb 100
--rps 200 --seconds 20``. Latency is only checked for hangs here (this suite shares 2 CPUs with
others); the measured figures are in docs/reliability.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.reliability import run_load, run_upload

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def test_upload_of_300_mb_zip_with_external_data_keeps_api_rss_within_64_mb(tmp_path: Path):
    r = run_upload(gb=0.3, log=print, tmp_parent=tmp_path)
    print(r)
    assert r["status"] == 202, r.get("error")
    assert r["model_format"] == "zip"
    assert r["sha256_matches"] is True
    assert r["api_rss_increase_mb"] <= 64, r
    assert r["throughput_mb_s"] >= 20, r
    v = r["validate"]
    assert v["outcome"] == "ok", v
    assert v["peak_increase_mb"] <= 64, v  # the 300 MB of weights are only stat()ed, never read


def test_status_polls_and_healthz_answer_during_concurrent_uploads_without_5xx_or_hangs(tmp_path: Path):
    # 4 uploaders on 3 upload slots: the fourth is refused with 429 while the others stream.
    r = run_load(uploads=4, upload_mb=20, rps=100, seconds=8, upload_slots=3, log=print, tmp_parent=tmp_path)
    print(r)
    assert r["api_alive"]
    assert r["five_xx"] == 0 and r["timeouts"] == 0 and not r["errors"], r
    assert r["codes"].get("upload 429", 0) >= 1, r["codes"]
    assert r["uploads_accepted"] >= 3
    assert r["status_requests"] >= 100
    # Answered, not hung (the client timeout is 10 s). The spec's p99 targets (100/250 ms) are not met on a
    # shared 2-CPU host: see docs/reliability.md for the measured figures.
    assert r["healthz_p99_ms"] < 10_000 and r["status_p99_ms"] < 10_000, r
