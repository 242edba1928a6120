"""Layering: the pipeline, its helpers and every pass import neither Celery nor FastAPI.

Each check runs in a fresh interpreter, so modules imported by other tests cannot hide a violation.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PIPELINE_MODULES = ["workers.pipeline", "workers.verify", "workers.benchmark", "workers.report"]
_PASS_FILES = sorted(p.stem for p in (ROOT / "passes").glob("*.py") if p.stem != "__init__")
PASS_MODULES = ["passes", *(f"passes.{stem}" for stem in _PASS_FILES)]
# The child runs model code; the CLI's local optimize path must not need a broker either.
OTHER_MODULES = ["workers.child", "workers.runner", "workers.archive", "onnxforge.cli", "onnxforge.client"]


@pytest.mark.parametrize("module", PIPELINE_MODULES + PASS_MODULES + OTHER_MODULES)
def test_module_imports_neither_celery_nor_fastapi_when_imported_alone(module):
    code = (
        f"import {module}, sys; "
        "bad = sorted(m for m in ('celery', 'fastapi', 'kombu', 'starlette') if m in sys.modules); "
        "assert not bad, bad"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
