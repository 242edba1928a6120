"""workers/gate.py: an artifact that fails to run in the benchmark is refused, not the job's end.

The verification runs the artifact with ORT's optimizations off; the gate's benchmark runs it at ORT's default
level, which trusts the graph's value_info. A fused Wav2Vec2-Conformer carried a shape ORT's symbolic inference
had assumed (bench/heldout_round2_encoders.py): MultiHeadAttention refused its bias in the benchmark, the
exception left the gate and the whole job failed. The gate now returns the upload with the reason (or, with
fail_on_regression, fails the job naming the last kept pass, as for an artifact out of tolerance).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

from core.config import JobConfig
from core.errors import RegressionError
from core.settings import PipelineSettings
from tests.workers.conftest import AddReluChain, resolver
from workers import gate
from workers.pipeline import PipelineRequest, run_pipeline

MESSAGE = "Input 'attention_bias' dimension 2 should be same as sequence_length, got 29"


def _refusing(*args, **kwargs):
    raise ort_errors.InvalidArgument(MESSAGE)


def _run(model: Path, out: Path, settings: PipelineSettings, **config: object):
    request = PipelineRequest(
        model_path=model,
        output_dir=out,
        config=JobConfig.parse({"rollback_slower": False, **config}),
        settings=settings,
        pass_resolver=resolver(AddReluChain()),
    )
    return run_pipeline(request)


def test_gate_returns_the_upload_when_the_artifact_fails_in_the_benchmark(
    tmp_path: Path, mlp_path: Path, fast_settings: PipelineSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gate, "compare", _refusing)
    result = _run(mlp_path, tmp_path, fast_settings)
    decision = result.report["decision"]
    assert result.used_original and decision["result"] == "original"
    assert MESSAGE in decision["gate"]["benchmark_error"] and "failed to run" in decision["reason"]
    assert result.model_path.read_bytes() == mlp_path.read_bytes()


def test_gate_fails_the_job_naming_the_pass_when_fail_on_regression(
    tmp_path: Path, mlp_path: Path, fast_settings: PipelineSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gate, "compare", _refusing)
    with pytest.raises(RegressionError) as info:  # the job's own error, not ORT's
        _run(mlp_path, tmp_path, fast_settings, fail_on_regression=True)
    assert info.value.pass_name == "test_add_relu_chain" and MESSAGE in str(info.value)
