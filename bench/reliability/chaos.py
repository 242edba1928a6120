"""Chaos runs: SIGKILL workers and attempt children while jobs run (``chaos``), and SIGKILL ``redis-server``
under load and restart it (``redis``).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.reliability._stack import (
    FAST_PIPELINE,
    TERMINAL,
    BrokerProbe,
    Log,
    Proc,
    RedisServer,
    Stack,
    blob_path,
    canonical_sha,
    fetch_artifact,
    job_of_child,
    list_jobs,
    log_stderr,
    model_variants,
    reenqueue_count,
    submit,
    wait_terminal,
    workspace,
)

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
    log: Log = log_stderr,
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
            hashes_ok, mismatched, missing_blob, returned_upload = 0, [], [], []
            uploads = [canonical_sha(body) for body in bodies]
            for job_id in succeeded:
                sha, canonical = fetch_artifact(client, stack.url, job_id)
                # The gate hands the upload back when the artifact timed slower beyond noise, which on a host
                # this loaded can happen to any job, killed or not: that job is held to the upload instead.
                report = client.get(f"{stack.url}/v1/jobs/{job_id}/report", timeout=60).raise_for_status().json()
                expected = reference[variant_of[job_id]]
                if report["decision"]["used_original"]:
                    returned_upload.append(job_id)
                    expected = uploads[variant_of[job_id]]
                if canonical == expected:
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
            # A worker killed between its commit and its clean-up leaves its attempt directory to the next
            # reconciler round (workers/runner.py prune_attempt_dirs): give a few rounds before counting.
            leftover = _attempt_dirs(stack.data_dir / "work")
            settle = time.monotonic() + 3 * reconcile_seconds + 5
            while leftover and time.monotonic() < settle:
                time.sleep(0.5)
                leftover = _attempt_dirs(stack.data_dir / "work")
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
                failed_detail={
                    i: [
                        (final[i].get("error") or {}).get("code"),
                        str((final[i].get("error") or {}).get("message"))[:300],
                    ]
                    for i in ids
                    if final[i]["state"] == "failed"
                },
                max_attempts_seen=max(final[i]["attempts"] for i in ids),
                attempts_over_cap=[i for i in ids if final[i]["attempts"] > max_attempts],
                artifacts_matching_reference=hashes_ok,
                artifacts_mismatched=mismatched,
                upload_returned_by_the_gate=returned_upload,
                artifacts_missing_blob=missing_blob,
                recovery_seconds_max=round(max(recoveries), 2) if recoveries else None,
                recovery_seconds_p50=round(statistics.median(recoveries), 2) if recoveries else None,
                recoveries_measured=len(recoveries),
                unrecovered_kills=len(pending),
                leftover_attempt_dirs=len(leftover),
                leftover_attempt_dir_names=leftover,
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


def _attempt_dirs(work: Path) -> list[str]:
    return sorted(str(p.relative_to(work)) for p in work.glob("*/attempt-*")) if work.exists() else []


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
    job, attempt = job_of_child(child) if child is not None else (None, 0)
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
    log: Log = log_stderr,
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
