"""What a result depends on besides its inputs: tool versions and the class of hardware it was measured on.

The optimizer's output is not a pure function of model and configuration: a pass is rolled back when it is
slower *on this machine*, and the report carries this machine's latencies. So a cached result may only be
reused where a fresh run would have used the same kind of hardware and the same tools (app/services/cache.py).

* ``runtime_versions()``: onnxforge, onnx, onnx-ir, onnxruntime, plus a hash of the optimizer's own source
  (``passes/`` and the pipeline modules), so a fixed pass invalidates cached results even before the version
  number moves. The API puts it into every cache key.
* ``hardware_class(target)``: what the worker recording a result ran on. CPU: architecture, CPU model, the
  instruction-set flags ONNX Runtime dispatches on, and the CPUs available; GPU targets: the GPU names (from
  ``nvidia-smi`` or the driver's /proc entries) and ORT's providers. Plus the worker's own
  ``runtime_versions``, so a worker upgraded before the API does not reuse results of the old tools. The value
  is ``<target>:<cpu or gpu name>:<16 hex of a hash over all of it>``: readable, and equal only when
  everything is.

No Celery, no FastAPI, no onnxruntime import at module level: the API imports ``runtime_versions``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
from functools import cache
from importlib import metadata
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
# Source files whose behaviour decides the artifact and report.
_CODE = (
    "passes",
    "workers/pipeline.py",
    "workers/artifacts.py",
    "workers/ledger.py",
    "workers/auto_search.py",
    "workers/gate.py",
    "workers/measurement.py",
    "workers/report_builder.py",
    "workers/verify.py",
    "workers/sessions.py",
    "workers/benchmark.py",
    "workers/report.py",
    "core/inputs",
    "core/recipe.py",
    "core/verdict.py",
    "core/runtime.py",
    "core/config.py",
)
# x86 and Arm flags ONNX Runtime's kernels (MLAS) pick code paths on.
_ISA_FLAGS = frozenset(
    {
        "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
        "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile",
        "asimd", "asimddp", "asimdhp", "sve", "sve2", "i8mm", "bf16",
    }
)  # fmt: skip


def _version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


@cache
def code_fingerprint() -> str:
    digest = hashlib.sha256()
    for entry in _CODE:
        path = _ROOT / entry
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            if file.is_file():
                digest.update(file.relative_to(_ROOT).as_posix().encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@cache
def runtime_versions() -> dict[str, str | None]:
    from core.version import __version__

    return {
        "onnxforge": __version__,
        "code": code_fingerprint(),
        "onnx": _version("onnx"),
        "onnx_ir": _version("onnx-ir", "onnx_ir"),
        "onnxruntime": _version("onnxruntime", "onnxruntime-gpu"),
    }


def _cpu() -> tuple[str, list[str]]:
    """(CPU model, the ISA flags of interest present), from /proc/cpuinfo on Linux."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return model, []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and value.strip():
            model = value.strip()
        elif key in ("flags", "features"):
            flags.update(value.split())
    return model, sorted(flags & _ISA_FLAGS)


def _gpus() -> list[str]:
    binary = shutil.which("nvidia-smi")
    if binary is not None:
        try:
            out = subprocess.run(
                [binary, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=False,
            )  # fmt: skip
            if out.returncode == 0 and out.stdout.strip():
                return sorted(line.strip() for line in out.stdout.splitlines() if line.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    names = []
    for info in Path("/proc/driver/nvidia/gpus").glob("*/information"):
        match = re.search(r"^Model:\s*(.+)$", info.read_text(errors="replace"), re.MULTILINE)
        if match:
            names.append(match.group(1).strip())
    return sorted(names)


def _providers() -> list[str]:
    try:
        import onnxruntime as ort

        return list(ort.get_available_providers())
    except Exception:
        return []


@cache
def hardware_class(target: str) -> str:
    """``<target>:<device>:<hash>``; see the module docstring."""
    cpu_model, flags = _cpu()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    described: dict[str, object] = {
        "target": target,
        "machine": platform.machine(),
        "cpu": cpu_model,
        "isa": flags,
        "cpus": cpus,
        "versions": runtime_versions(),
    }
    device = cpu_model
    if target != "cpu":
        gpus = _gpus()
        described["gpus"] = gpus
        described["providers"] = _providers()
        device = gpus[0] if gpus else "no-gpu"
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
    device = re.sub(r"\s+", " ", device).strip()[:160]
    return f"{target}:{device}:{digest}"
