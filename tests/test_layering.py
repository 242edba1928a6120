"""Layering: the floors contract holds, and the engine and every pass load without Celery or FastAPI.

The import-linter contracts in pyproject.toml are the rule (floors, no framework in the engine, no circles);
the first test runs them as ``make lint`` does, and proves that they would catch an upward import. The
import checks run each module in a fresh interpreter, so modules imported by other tests cannot hide a
violation that only happens at run time.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
PIPELINE_MODULES = [
    "workers.pipeline",
    "workers.artifacts",
    "workers.ledger",
    "workers.auto_search",
    "workers.gate",
    "workers.measurement",
    "workers.report_builder",
    "workers.verify",
    "workers.sessions",
    "workers.benchmark",
    "workers.report",
    "core.inputs",
]
PASS_MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "passes").rglob("*.py")
)
# The child runs model code; the CLI's local optimize path must not need a broker either.
OTHER_MODULES = ["workers.child", "workers.runner", "workers.archive", "onnxforge.cli", "onnxforge.client"]


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )


def test_floors_contract_is_kept_when_linted():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("core/errors.py", "import app.errors", "Floors"),  # ground importing a floor above it
        ("workers/report.py", "import app.schemas", "Floors"),  # workers and app must not know each other
        ("passes/_match.py", "import celery", "neither HTTP nor Celery"),
        ("core/keys.py", "import core.settings", "No import circles"),  # settings -> keys -> settings
    ],
)
def test_floors_contract_is_broken_when_a_module_imports_across_it(tmp_path, module, line, contract):
    copy = tmp_path / "tree"
    copy.mkdir()
    for name in ("pyproject.toml", "app", "workers", "passes", "core", "onnxforge"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, copy / name)
    target = copy / module
    target.write_text(target.read_text() + f"\n{line}\n")
    result = _lint_imports(copy)
    assert result.returncode != 0
    assert f"{contract}" in result.stdout and "BROKEN" in result.stdout


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
