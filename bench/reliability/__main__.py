"""``python -m bench.reliability <run>``: the command line of the reliability runs."""

import argparse
import json
from pathlib import Path

from bench import reliability
from bench.reliability.chaos import run_chaos, run_redis_restart
from bench.reliability.load import run_load
from bench.reliability.memory import run_oom, run_upload, run_validate

# --------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reliability", description=reliability.__doc__.split("\n")[0])
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
