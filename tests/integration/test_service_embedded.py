"""Embedded mode: ``onnxforge serve`` with only a data directory configured (SQLite + filesystem queue +
worker processes it starts itself), and the CLI's local ``optimize`` producing the same graph."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from tests.conftest import FAST_PIPELINE, ROOT, Services, service_env
from tests.integration._flow import CONFIG, MODEL, check_job_flow, submit, wait

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _without_job_id(model: onnx.ModelProto) -> bytes:
    props = [p for p in model.metadata_props if not p.key.endswith("job_id")]
    del model.metadata_props[:]
    model.metadata_props.extend(props)
    return model.SerializeToString(deterministic=True)


def test_serve_embedded_optimizes_model_like_cli_when_nothing_else_configured(services: Services, tmp_path: Path):
    env = service_env(tmp_path / "data", **FAST_PIPELINE)

    api = services.serve(env, embedded=True)
    assert api.url
    artifact, report = check_job_flow(api.url, tmp_path)

    # The same model and config through `onnxforge optimize` gives the same graph.
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(CONFIG))
    local = tmp_path / "local.onnx"
    argv = ["optimize", str(MODEL), "-o", str(local), "--config", str(config_file)]
    result = subprocess.run(
        [sys.executable, "-m", "onnxforge.cli", *argv],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _without_job_id(onnx.load(str(local))) == _without_job_id(onnx.load(str(artifact)))
    assert report["job_id"]

    # `onnxforge submit` (onnxforge/client.py) against the same server: upload, follow, download.
    submitted = tmp_path / "submitted.onnx"
    argv = ["submit", str(MODEL), "--server", api.url, "--config", str(config_file), "-o", str(submitted)]
    result = subprocess.run(
        [sys.executable, "-m", "onnxforge.cli", *argv, "--report", str(tmp_path / "r.json")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "[succeeded]" in result.stderr
    assert _without_job_id(onnx.load(str(submitted))) == _without_job_id(onnx.load(str(artifact)))
    assert json.loads((tmp_path / "r.json").read_text())["passes"]

    # Both queues are consumed: a GPU-target job leaves the queue too (and fails cleanly on a CPU host).
    gpu_job = submit(api.url, config={"preset": "safe", "target": "cuda"})
    assert gpu_job["queue"] == "gpu"
    finished = wait(api.url, gpu_job["id"], timeout=60)
    assert finished["state"] in {"succeeded", "failed"}
    assert finished["attempts"] == 1
