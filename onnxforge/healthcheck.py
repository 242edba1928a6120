"""Container healthcheck: ``python -m onnxforge.healthcheck URL`` or ``... --worker``.

A module rather than curl because the slim and CUDA images ship no curl, and because the worker check needs
the same settings as the worker: it answers healthy only when the worker could take a job now, that is when
its database and broker answer.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m onnxforge.healthcheck",
        description="Exit 0 when the API answers 200 at URL, or (--worker) when the job database and the "
        "broker of the configured settings answer; exit 1 otherwise.",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("url", nargs="?", help="URL that must answer 200, e.g. http://127.0.0.1:8000/readyz")
    target.add_argument("--worker", action="store_true", help="check the worker's database and broker")
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds to wait (default 4)")
    return parser


def check_url(url: str, timeout: float) -> str | None:
    if not url.startswith(("http://", "https://")):
        return f"not an http(s) URL: {url}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return None if response.status == 200 else f"{url} answered {response.status}"
    except urllib.error.HTTPError as exc:
        return f"{url} answered {exc.code}"
    except OSError as exc:
        return f"{url} unreachable: {exc}"


def check_worker() -> str | None:
    from core.broker import Dispatcher
    from core.errors import OnnxforgeError
    from core.settings import get_settings
    from core.store import JobStore

    settings = get_settings()
    try:
        JobStore(settings.database_url, settings.database.schema_name).ping()
        dispatcher = Dispatcher(settings)
        try:
            dispatcher.ping()
        finally:
            dispatcher.close()
    except OnnxforgeError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check_worker() if args.worker else check_url(args.url, args.timeout)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
