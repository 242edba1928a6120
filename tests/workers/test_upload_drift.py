"""The report measures how far ORT's own optimizations move the upload's outputs (issue 17).

Ultralytics' RT-DETR picks its 300 queries with a TopK over scores that rounding reorders: ORT's default level
moves its output by 0.7 against the reference (optimizations off), so every fusion was refused at 1e-4 and the
report said only "output 'output0' differs". ``verification.upload_at_default_level`` now gives that drift,
measured on the baseline's session, and the decision's reason says why no rewrite that changes rounding can
verify on such a model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from core.config import JobConfig, Tolerance
from core.inputs import make_input_sets
from core.settings import PipelineSettings
from tests.workers.conftest import DropReluChain, resolver
from workers import pipeline
from workers.benchmark import BenchmarkParams, SessionPool
from workers.pipeline import PipelineRequest, PipelineResult, run_pipeline
from workers.report import validate_report
from workers.verify import Verifier


def _outputs(verifier: Verifier, path: Path, by: float = 0.0):
    """Input set ``i``'s outputs of the upload at ORT's default level, moved by ``by`` (what ORT's rewrites do to a
    discontinuous model)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda i: [out + np.float32(by) for out in session.run(None, verifier.input_sets[i].feeds)]


def _verifier(mlp_path: Path) -> Verifier:
    import onnx

    sets = make_input_sets(onnx.load(str(mlp_path)), count=2, seed=0)
    return Verifier(mlp_path, sets, Tolerance(atol=1e-4, rtol=1e-3))


def _job(model: Path, out: Path, settings: PipelineSettings) -> PipelineResult:
    request = PipelineRequest(
        model_path=model,
        output_dir=out,
        config=JobConfig.parse({"rollback_slower": False}),
        settings=settings,
        pass_resolver=resolver(DropReluChain()),
    )
    return run_pipeline(request)


def test_drift_is_within_tolerance_for_the_upload_at_the_default_level(mlp_path: Path) -> None:
    verifier = _verifier(mlp_path)
    drift = verifier.drift(_outputs(verifier, mlp_path))
    assert drift["ok"] is True and drift["reason"] is None and drift["max_abs"] < 1e-4


def test_drift_beyond_tolerance_names_the_set_and_output(mlp_path: Path) -> None:
    verifier = _verifier(mlp_path)
    drift = verifier.drift(_outputs(verifier, mlp_path, 0.7))
    assert drift["ok"] is False and abs(drift["max_abs"] - 0.7) < 1e-3
    assert drift["reason"].startswith(f"output {verifier.output_names[0]!r} on {verifier.input_sets[0].name}: ")


def test_the_job_report_carries_the_drift_and_the_html_shows_it(
    tmp_path: Path, slow_mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    result = _job(slow_mlp_path, tmp_path, fast_settings)
    drift = result.report["verification"]["upload_at_default_level"]
    assert drift["ok"] is True and drift["max_abs"] is not None
    assert pipeline.UNSTABLE not in result.report["decision"]["reason"]
    assert validate_report(json.loads(result.report_json_path.read_text())) == []
    assert "as users run it (ORT's default level) against the reference" in result.report_html_path.read_text()


def test_a_moved_upload_is_named_in_the_decision(
    tmp_path: Path, slow_mlp_path: Path, fast_settings: PipelineSettings, monkeypatch
) -> None:
    real = Verifier.drift
    monkeypatch.setattr(Verifier, "drift", lambda self, outputs: real(self, _outputs(self, self.original_path, 0.7)))
    report = _job(slow_mlp_path, tmp_path, fast_settings).report
    assert report["verification"]["upload_at_default_level"]["ok"] is False
    assert pipeline.UNSTABLE in report["decision"]["reason"]


def test_the_drift_reads_the_baseline_sessions_first_runs_and_lets_them_go(mlp_path: Path) -> None:
    """The baseline's first run of each set is the drift's outputs (a run of Whisper's encoder's sets is ~1 s of
    its job); the pipeline drops them once read, and a session built without ``keep_outputs`` holds none."""
    verifier = _verifier(mlp_path)
    feeds = [s.feeds for s in verifier.input_sets]
    params = BenchmarkParams(warmup=1, min_runs=1, max_seconds=1.0)
    pool = SessionPool()
    runs, _ = pool.runs(mlp_path, feeds, params, keep_outputs=True)
    assert sorted(runs.first_outputs) == [0, 1]
    calls = []
    runs.session = _Counting(runs.session, calls)
    drift = pipeline._drift(verifier, runs)
    assert calls == [] and drift["ok"] is True and drift["max_abs"] < 1e-4
    assert runs.first_outputs == {}
    assert pipeline._drift(verifier, runs)["ok"] is True and len(calls) == 2  # run again once dropped
    other, _ = SessionPool().runs(mlp_path, feeds, params)
    assert other.first_outputs == {}


class _Counting:
    def __init__(self, session, calls: list) -> None:
        self.session, self.calls = session, calls

    def run(self, names, feeds):
        self.calls.append(names)
        return self.session.run(names, feeds)
