"""The per-attempt child: ``python -m workers.child JOB_JSON``. Every onnx/ORT call of a job runs here.

The runner (workers/runner.py) starts it in a new session, with a minimal environment and rlimits, and
reads back three files it writes next to ``job.json``:

* ``progress.json`` ``{"stage": str, "progress": float 0..1}``, replaced atomically on every update;
* ``result.json`` on success: ``{"used_original", "external_data", "summary"}``, exit status 0;
* ``error.json`` on a handled failure: ``{"code", "message", "pass"}``, exit status 1.

A crash (signal) writes neither; the runner classifies the signal. Tracebacks go to stderr (the runner's
log), never into the error message that reaches the client.

Test-only hook: when the environment variable ``ONNXFORGE_TEST_CHILD_FAULT`` is set (the runner forwards it
only if its own environment has it; nothing in production sets it), the child injects a fault before the
pipeline: ``segv``, ``abort``, ``kill`` (signal itself), ``oom`` (allocate past RLIMIT_AS),
``sleep:SECONDS`` (report progress and sleep, for cancel/timeout tests), ``exit:N``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from core.errors import OnnxforgeError

FAULT_ENV = "ONNXFORGE_TEST_CHILD_FAULT"


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)


class Progress:
    """The pipeline's progress callback: writes ``progress.json`` atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stage = "starting"
        self.progress = 0.0

    def __call__(self, stage: str | None = None, progress: float | None = None, *_: Any, **__: Any) -> None:
        if stage is not None:
            self.stage = str(stage)[:64]
        if progress is not None:
            self.progress = min(1.0, max(0.0, float(progress)))
        write_json_atomic(self.path, {"stage": self.stage, "progress": self.progress})


def _inject_fault(fault: str, progress: Progress) -> None:
    kind, _, arg = fault.partition(":")
    progress("fault-injection", 0.01)
    if kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "abort":
        os.abort()
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "oom":
        hog = []
        while True:  # 64 MiB at a time until RLIMIT_AS says no
            hog.append(bytearray(64 << 20))
    elif kind == "sleep":
        end = time.monotonic() + float(arg or 60)
        while time.monotonic() < end:
            progress("fault-injection", 0.5)
            time.sleep(0.2)
    elif kind == "exit":
        sys.exit(int(arg or 3))


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    summary = report.get("summary")
    return summary if isinstance(summary, dict) else {}


def run(job_path: Path, *, process_exits: bool = False) -> int:
    job = json.loads(job_path.read_text())
    base = job_path.parent
    progress = Progress(base / "progress.json")
    progress("starting", 0.0)
    fault = os.environ.get(FAULT_ENV)
    try:
        if fault:
            _inject_fault(fault, progress)

        from core.config import JobConfig
        from core.settings import PipelineSettings
        from workers.gc_policy import imports_frozen
        from workers.pipeline import PipelineRequest, run_pipeline
        from workers.validate import validate_model_dir

        request = PipelineRequest(
            model_path=Path(job["model_path"]),
            output_dir=Path(job["output_dir"]),
            config=JobConfig.parse(job["config"]),
            settings=PipelineSettings.model_validate(job["pipeline"]),
            samples_path=Path(job["samples_path"]) if job.get("samples_path") else None,
            job_id=job.get("job_id"),
            progress=progress,
            # Files named by pass options (prepost's tokenizer) come from the upload only, never the server.
            input_root=Path(job["model_path"]).parent,
        )
        progress("validating", 0.0)
        validate_model_dir(request.model_path, base)  # before any onnx/ORT parser (security.md T1-T10)
        # The pipeline imports every pass (its registry): now, after the upload's checks, so that they are frozen too.
        import passes.registry  # noqa: F401

        with imports_frozen(process_exits=process_exits):
            result = run_pipeline(request)
        output_dir = Path(job["output_dir"])
        write_json_atomic(
            base / "result.json",
            {
                "model": Path(result.model_path).name,
                "used_original": bool(result.used_original),
                "external_data": [Path(p).name for p in result.external_data],
                "side_files": [Path(p).name for p in result.side_files],
                "report_json": str(Path(result.report_json_path).relative_to(output_dir)),
                "report_html": str(Path(result.report_html_path).relative_to(output_dir)),
                "summary": _summary(result.report),
            },
        )
        return 0
    except OnnxforgeError as exc:
        error = {"code": exc.code, "message": exc.message, "pass": exc.pass_name}
    except MemoryError:
        error = {"code": "RESOURCE_LIMIT_EXCEEDED", "message": "the job ran out of memory", "pass": None}
    except Exception as exc:
        traceback.print_exc()
        error = {"code": "INTERNAL_ERROR", "message": f"{type(exc).__name__}: {exc}"[:2000], "pass": None}
    write_json_atomic(base / "error.json", error)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m workers.child JOB_JSON", file=sys.stderr)
        return 2
    faulthandler.enable()  # a native crash leaves a Python stack in the runner's log, then dies by its signal
    return run(Path(args[0]), process_exits=True)  # the process ends with the job


if __name__ == "__main__":
    sys.exit(main())
