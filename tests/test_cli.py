"""The ``onnxforge`` command line: help texts, ``passes --json``, and a local ``optimize`` run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from core import migrations
from onnxforge.cli import main

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "models" / "mlp_cleanup.onnx"
FAST_ENV = {
    "ONNXFORGE_PIPELINE__BENCHMARK_WARMUP": "1",
    "ONNXFORGE_PIPELINE__BENCHMARK_MIN_RUNS": "3",
    "ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS": "0.3",
    "ONNXFORGE_PIPELINE__LEDGER_RUNS": "2",
}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ONNXFORGE_")} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "onnxforge.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def test_cli_help_lists_every_command_when_run_without_arguments(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("serve", "worker", "optimize", "passes", "submit"):
        assert command in out


@pytest.mark.parametrize("command", ["serve", "worker", "optimize", "passes", "submit"])
def test_cli_command_help_describes_options_when_asked(capsys, command):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: onnxforge" in out
    assert len(out.splitlines()) > 4


def test_cli_passes_json_lists_passes_and_presets_when_asked(capsys):
    assert main(["passes", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = {p["name"] for p in data["passes"]}
    assert {"identity_elimination", "dead_node_elimination"} <= names
    assert "safe" in {p["name"] for p in data["presets"]}
    assert all("options_schema" in p for p in data["passes"])


def test_cli_optimize_writes_equivalent_model_and_report_when_model_is_valid(tmp_path):
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"

    result = _cli("optimize", str(MODEL), "-o", str(out), "--preset", "safe", "--report", str(report), env=FAST_ENV)

    assert result.returncode == 0, result.stderr
    assert "identity_elimination" in result.stdout and "->" in result.stdout
    optimized = onnx.load(str(out))
    assert len(optimized.graph.node) < len(onnx.load(str(MODEL)).graph.node)
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    ref = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert [p["name"] for p in json.loads(report.read_text())["passes"]]


def test_cli_optimize_exits_2_with_close_match_when_pass_name_is_misspelled(tmp_path):
    result = _cli("optimize", str(MODEL), "-o", str(tmp_path / "o.onnx"), "--passes", "identity_elimnation")

    assert result.returncode == 2
    assert "error: UNKNOWN_PASS" in result.stderr
    assert "did you mean identity_elimination" in result.stderr
    assert not (tmp_path / "o.onnx").exists()


def test_cli_optimize_exits_2_when_model_file_is_missing(tmp_path):
    assert main(["optimize", str(tmp_path / "nope.onnx"), "-o", str(tmp_path / "o.onnx")]) == 2


def test_cli_exits_2_when_arguments_are_invalid():
    assert main(["optimize"]) == 2


def test_cli_migrate_creates_schema_and_check_passes_when_database_new(tmp_path):
    env = {"ONNXFORGE_STORAGE__DATA_DIR": str(tmp_path / "data")}

    before = _cli("migrate", "--check", env=env)
    created = _cli("migrate", env=env)
    after = _cli("migrate", "--check", env=env)

    assert before.returncode == 2
    assert "SCHEMA_OUT_OF_DATE" in before.stderr
    assert created.returncode == 0, created.stderr
    assert f"revision none -> {migrations.head()}" in created.stdout
    assert after.returncode == 0, after.stderr


def test_cli_migrate_leaves_newer_schema_alone_and_check_names_its_floor(tmp_path):
    """A rollout in progress: a newer version migrated the database this older CLI points at."""
    import sqlite3

    env = {"ONNXFORGE_STORAGE__DATA_DIR": str(tmp_path / "data")}
    assert _cli("migrate", env=env).returncode == 0
    with sqlite3.connect(tmp_path / "data" / "onnxforge.db") as db:
        db.execute("UPDATE alembic_version SET version_num = '9999'")
        db.execute(f"UPDATE {migrations.FLOOR_TABLE} SET revision = '9999', oldest_compatible = '9998'")

    check = _cli("migrate", "--check", env=env)
    upgrade = _cli("migrate", env=env)

    assert check.returncode == 2 and "SCHEMA_NEWER" in check.stderr and "9998" in check.stderr
    assert upgrade.returncode == 2 and "SCHEMA_NEWER" in upgrade.stderr
    with sqlite3.connect(tmp_path / "data" / "onnxforge.db") as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [("9999",)]


def test_cli_serve_refuses_old_schema_when_auto_migrate_is_off(tmp_path):
    env = {"ONNXFORGE_STORAGE__DATA_DIR": str(tmp_path / "data"), "ONNXFORGE_DATABASE__AUTO_MIGRATE": "false"}
    assert _cli("migrate", env=env).returncode == 0
    assert _cli("migrate", "--revision", "0001", env=env).returncode == 0

    refused = _cli("serve", "--port", "0", env=env)

    assert refused.returncode == 2
    assert f"schema revision 0001, this version needs {migrations.head()}" in refused.stderr
