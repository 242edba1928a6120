"""workers/pipeline.py: the per-pass ledger, rollback, the regression gate, provenance, determinism.

Passes are TEST-ONLY classes from conftest.py, injected through ``PipelineRequest.pass_resolver``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from core.config import JobConfig
from core.errors import InvalidModelError, RegressionError
from core.inputs import generate_input_sets
from core.settings import PipelineSettings
from passes._infra import Pass
from tests.workers.conftest import MODELS, AddReluChain, Crash, DropReluChain, FlipSign, Idle, resolver
from workers.ledger import bisect_first_failing
from workers.pipeline import PipelineRequest, PipelineResult, run_pipeline

ROOT = Path(__file__).resolve().parents[2]


def _run(
    model: Path,
    out: Path,
    settings: PipelineSettings,
    *passes: Pass,
    job_id: str | None = None,
    progress: list[tuple[str, float]] | None = None,
    **config: object,
) -> PipelineResult:
    request = PipelineRequest(
        model_path=model,
        output_dir=out,
        config=JobConfig.parse(dict(config)),
        settings=settings,
        job_id=job_id,
        progress=(lambda stage, f: progress.append((stage, f))) if progress is not None else None,
        pass_resolver=resolver(*passes),
    )
    return run_pipeline(request)


def _outputs(path: Path, model_for_inputs: Path) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    feeds = generate_input_sets(onnx.load(str(model_for_inputs)), 1, seed=3)[0].feeds
    return sess.run(None, feeds)


def _by_name(result: PipelineResult) -> dict[str, dict]:
    return {p["name"]: p for p in result.report["passes"]}


def test_pipeline_rolls_back_wrong_pass_when_it_breaks_tolerance(
    tmp_path: Path, slow_mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    result = _run(slow_mlp_path, tmp_path, fast_settings, FlipSign(), DropReluChain())
    flip = _by_name(result)["test_flip_sign"]
    assert flip["status"] == "rolled_back" and flip["modified"] is True
    assert "broke tolerance" in flip["reason"] and "'y'" in flip["reason"]
    assert flip["verification"]["ok"] is False and flip["verification"]["mismatches"] > 0
    assert _by_name(result)["test_drop_relu_chain"]["status"] == "applied"
    assert not result.used_original and result.report["decision"]["result"] == "optimized"
    # The artifact computes exactly what the upload computes.
    for got, ref in zip(
        _outputs(result.model_path, slow_mlp_path), _outputs(slow_mlp_path, slow_mlp_path), strict=True
    ):
        assert np.array_equal(got, ref)
    assert result.report["summary"]["nodes_after"] == result.report["summary"]["nodes_before"] - 200


def test_pipeline_reports_why_when_pass_does_nothing(
    tmp_path: Path, mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    result = _run(mlp_path, tmp_path, fast_settings, Idle())
    idle = _by_name(result)["test_idle"]
    assert idle["status"] == "no_change" and idle["modified"] is False
    assert idle["reason"].startswith("did nothing because no Gelu pattern: Erf not found")
    assert idle["non_matches"][0]["node"] == "<script>alert(1)</script>"
    assert result.used_original and result.model_path.read_bytes() == mlp_path.read_bytes()
    assert "no pass was kept" in result.report["decision"]["reason"]


def test_pipeline_rolls_back_slow_pass_when_rollback_slower_is_on(
    tmp_path: Path, mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    result = _run(mlp_path, tmp_path, fast_settings, AddReluChain(), rollback_slower=True)
    slow = _by_name(result)["test_add_relu_chain"]
    assert slow["status"] == "rolled_back" and slow["reason"].startswith("slower beyond noise")
    assert slow["verification"]["ok"] is True  # exact, only slow
    assert slow["latency_ms_p50_after"] > slow["latency_ms_p50_before"]
    assert slow["nodes_after"] == slow["nodes_before"] + 200
    assert result.used_original


def test_pipeline_returns_original_when_final_model_is_slower(
    tmp_path: Path, mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    result = _run(mlp_path, tmp_path, fast_settings, AddReluChain(), rollback_slower=False)
    assert _by_name(result)["test_add_relu_chain"]["status"] == "applied"
    decision = result.report["decision"]
    assert result.used_original and decision["used_original"] and decision["result"] == "original"
    assert "slower" in decision["reason"] and decision["failed_pass"] == "test_add_relu_chain"
    assert decision["gate"]["slower"] is True
    assert result.model_path.read_bytes() == mlp_path.read_bytes()
    assert result.report["benchmark"]["slower"] is True


def test_pipeline_raises_regression_error_when_fail_on_regression_and_slower(
    tmp_path: Path, mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    with pytest.raises(RegressionError) as info:
        _run(mlp_path, tmp_path, fast_settings, AddReluChain(), rollback_slower=False, fail_on_regression=True)
    assert info.value.code == "PERFORMANCE_REGRESSION"
    assert info.value.pass_name == "test_add_relu_chain"
    assert not (tmp_path / "model.onnx").exists()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["decision"]["result"] == "failed" and report["artifact"] is None


def test_pipeline_records_failed_pass_and_continues_when_pass_raises(
    tmp_path: Path, slow_mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    result = _run(slow_mlp_path, tmp_path, fast_settings, Crash(), DropReluChain())
    crash = _by_name(result)["test_crash"]
    assert crash["status"] == "failed" and "boom in the pass" in crash["reason"]
    assert _by_name(result)["test_drop_relu_chain"]["status"] == "applied"
    assert result.report["summary"]["passes_failed"] == 1


def test_pipeline_writes_provenance_and_same_bytes_when_run_twice(
    tmp_path: Path, slow_mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    first = _run(slow_mlp_path, tmp_path / "a", fast_settings, DropReluChain(), job_id="job-1")
    second = _run(slow_mlp_path, tmp_path / "b", fast_settings, DropReluChain(), job_id="job-2")
    props = {p.key: p.value for p in onnx.load(str(first.model_path)).metadata_props}
    assert props["onnxforge.job_id"] == "job-1"
    assert props["onnxforge.preset"] == "test"
    assert props["onnxforge.source_sha256"] == first.report["source"]["sha256"]
    assert json.loads(props["onnxforge.passes"]) == [{"name": "test_drop_relu_chain", "options": {}}]
    assert props["onnxforge.version"]
    assert first.report["artifact"]["metadata_props"] == props
    a = first.model_path.read_bytes().replace(b"job-1", b"job-X")
    b = second.model_path.read_bytes().replace(b"job-2", b"job-X")
    assert a == b


def test_pipeline_reports_progress_stages_when_callback_given(
    tmp_path: Path, slow_mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    seen: list[tuple[str, float]] = []
    _run(slow_mlp_path, tmp_path, fast_settings, Idle(), DropReluChain(), progress=seen)
    stages = [s for s, _ in seen]
    for stage in ("loading", "passes", "verifying", "benchmarking", "reporting"):
        assert stage in stages
    assert ("passes", 0.5) in seen and seen[-1] == ("reporting", 1.0)


def test_pipeline_raises_invalid_model_when_file_is_not_onnx(tmp_path: Path, fast_settings: PipelineSettings) -> None:
    bad = tmp_path / "in" / "model.onnx"
    bad.parent.mkdir()
    bad.write_bytes(b"\x00not onnx")
    with pytest.raises(InvalidModelError) as info:
        _run(bad, tmp_path / "out", fast_settings, Idle())
    assert info.value.code == "INVALID_MODEL"


def test_bisect_first_failing_names_the_first_culprit_when_a_prefix_fails() -> None:
    for guilty in range(6):
        calls: list[int] = []

        def fails(k: int, guilty: int = guilty, calls: list[int] = calls) -> bool:
            calls.append(k)
            return k > guilty

        assert bisect_first_failing(6, fails) == guilty
        assert len(calls) <= 3


def test_pipeline_module_imports_neither_celery_nor_fastapi_when_imported() -> None:
    code = (
        "import sys, workers.pipeline, workers.verify, workers.benchmark, workers.report, workers.ledger\n"
        "banned = ('celery', 'fastapi', 'starlette', 'kombu')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in banned)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_pipeline_returns_original_with_its_external_data_when_no_pass_changes_it(
    tmp_path: Path, mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    source = tmp_path / "in"
    source.mkdir()
    onnx.save(
        onnx.load(str(mlp_path)),
        str(source / "net.onnx"),
        save_as_external_data=True,
        location="net.bin",
        size_threshold=0,
    )
    result = _run(source / "net.onnx", tmp_path / "out", fast_settings, Idle())
    assert result.used_original
    assert result.model_path.read_bytes() == (source / "net.onnx").read_bytes()
    assert result.external_data == [tmp_path / "out" / "net.bin"]
    assert result.external_data[0].read_bytes() == (source / "net.bin").read_bytes()
    assert result.report["source"]["external_data"] == ["net.bin"]
    assert result.report["artifact"]["external_data"] == ["net.bin"]
    assert result.report["artifact"]["sha256"] == result.report["source"]["sha256"]


def test_pipeline_keeps_upload_intact_when_output_dir_is_the_upload_dir(
    tmp_path: Path, mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(mlp_path.read_bytes())
    result = _run(model, tmp_path, fast_settings, Idle())
    assert result.used_original and model.read_bytes() == mlp_path.read_bytes()


def test_pipeline_verifies_and_times_unfuse_skip_layernorm_when_fast_fusions_made_skip_layernorms(
    tmp_path: Path, fast_settings: PipelineSettings
) -> None:
    """The fast preset's tail on a real export: fuse_transformer makes SkipLayerNormalization, the new pass takes
    every one apart, and the ledger verifies it (exact) and decides on its measured latency."""
    config = JobConfig(passes=["fuse_transformer", "unfuse_skip_layernorm"])
    result = run_pipeline(PipelineRequest(MODELS / "hf_bert_encoder.onnx", tmp_path / "out", config, fast_settings))
    entry = _by_name(result)["unfuse_skip_layernorm"]
    assert entry["verification"]["ok"] is True, entry
    assert entry["counts"]["skip_layernorms_unfused"] == 4  # two layers, two residual LayerNorms each
    assert entry["status"] in ("applied", "rolled_back"), entry
    if entry["status"] == "rolled_back":
        assert entry["reason"].startswith("slower beyond noise"), entry["reason"]
