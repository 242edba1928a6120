"""workers/pipeline.py and workers/ledger.py: job time. A pass that changed nothing is neither verified nor
timed, benchmark sessions are built once per model and reused, and the report says where the time went.

Passes are TEST-ONLY classes from conftest.py (and one here), injected through ``PipelineRequest.pass_resolver``.
"""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
import pytest

from core.config import JobConfig
from core.settings import PipelineSettings
from passes._infra import Pass, PassContext, PassResult
from tests.workers.conftest import DropReluChain, FlipSign, Idle, OneUlp, resolver
from workers.benchmark import TIE_STOP
from workers.pipeline import STAGES, PipelineRequest, PipelineResult, run_pipeline
from workers.report import validate_report


class ClaimsChange(Pass):
    """Says it modified the model and hands it back untouched (a pass whose rewrite rules all declined)."""

    name = "test_claims_change"
    summary = "test only: modified=True, same graph"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        return PassResult(model, True, counts={"nodes_rewritten": 0})


class DocString(Pass):
    """Exact, and a change: the graph's doc string (other bytes, same function)."""

    name = "test_doc_string"
    summary = "test only: changes bytes, not the function"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        model.graph.doc_string = "documented by a test pass"
        return PassResult(model, True, counts={"doc_strings": 1})


def _run(model: Path, out: Path, settings: PipelineSettings, *passes: Pass) -> PipelineResult:
    request = PipelineRequest(
        model_path=model,
        output_dir=out,
        config=JobConfig(),
        settings=settings,
        pass_resolver=resolver(*passes),
    )
    return run_pipeline(request)


@pytest.fixture(scope="module")
def timed(tmp_path_factory: pytest.TempPathFactory, slow_mlp_path: Path) -> PipelineResult:
    settings = PipelineSettings(
        verify_shape_sets=2,
        benchmark_warmup=1,
        benchmark_min_runs=10,
        benchmark_max_seconds=0.2,
        ledger_runs=7,
        intra_op_threads=1,
    )
    # ClaimsChange before the group: a pass that changes nothing on a pending group runs again when it falls back
    passes = (Idle(), ClaimsChange(), DropReluChain(), FlipSign(), DocString())
    return _run(slow_mlp_path, tmp_path_factory.mktemp("timed"), settings, *passes)


def test_ledger_records_no_change_without_verifying_or_timing_when_the_returned_model_is_the_received_one(
    timed: PipelineResult,
) -> None:
    records = {p["name"]: p for p in timed.report["passes"]}
    steps = {t["name"]: t for t in timed.report["timings"]["passes"]}
    claimed = records["test_claims_change"]
    assert claimed["modified"] is True and claimed["status"] == "no_change"
    assert claimed["reason"].startswith("did nothing because") and "the one it received" in claimed["reason"]
    assert claimed["verification"] is None and claimed["latency"] is None
    assert steps["test_claims_change"]["verify_s"] == steps["test_claims_change"]["benchmark_s"] == 0.0
    assert steps["test_claims_change"]["write_s"] > 0.0  # its fingerprint, compared in memory: nothing written
    assert steps["test_idle"]["verify_s"] == steps["test_idle"]["benchmark_s"] == steps["test_idle"]["write_s"] == 0
    # The passes that changed something were verified, and timed unless verification refused them.
    assert steps["test_drop_relu_chain"]["verify_s"] > 0 and steps["test_drop_relu_chain"]["benchmark_s"] > 0
    assert steps["test_flip_sign"]["verify_s"] > 0 and steps["test_flip_sign"]["benchmark_s"] == 0.0
    assert records["test_doc_string"]["latency"] is not None


def test_pipeline_builds_each_benchmark_session_once_when_models_are_timed_again(timed: PipelineResult) -> None:
    # Timed models: the upload (baseline, A of the first timed pass, A of the gate), the drop-relu stage (B, then
    # A of the doc-string pass), the doc-string stage (B) and the artifact (B of the gate): four sessions.
    assert timed.report["decision"]["gate"]["benchmark_mode"] == "full"
    sessions = timed.report["timings"]["sessions"]
    assert sessions["built"] == 4
    assert sessions["reused"] >= 3


def test_report_timings_cover_every_stage_and_pass_when_a_job_runs(timed: PipelineResult) -> None:
    report = timed.report
    timings = report["timings"]
    assert validate_report(report) == []
    assert [t["name"] for t in timings["passes"]] == [p["name"] for p in report["passes"]]
    assert all(timings[f"{stage}_s"] is not None and timings[f"{stage}_s"] >= 0 for stage in STAGES)
    assert timings["total_s"] == report["duration_s"]
    assert sum(timings[f"{stage}_s"] for stage in STAGES) <= timings["total_s"]
    for record, steps in zip(report["passes"], timings["passes"], strict=True):
        parts = sum(v for k, v in steps.items() if k not in ("name", "total_s"))
        assert steps["total_s"] == record["duration_s"] and parts <= steps["total_s"]
    assert "Time by stage" in timed.report_html_path.read_text(encoding="utf-8")


def test_validate_report_accepts_a_report_without_timings_when_it_predates_them(timed: PipelineResult) -> None:
    older = {k: v for k, v in timed.report.items() if k != "timings"}
    assert validate_report(older) == []
    broken = {**timed.report, "timings": {**timed.report["timings"], "surprise_s": 1.0}}
    assert "timings: undocumented key 'surprise_s'" in validate_report(broken)


def test_baseline_is_the_gates_timing_of_the_upload_when_the_gate_timed_it(timed: PipelineResult) -> None:
    """The upload is timed once: the gate's interleaved runs of it on the job's input sets are the baseline."""
    report = timed.report
    baseline, benchmark = report["baseline"], report["benchmark"]
    assert baseline["timed_by"] == "gate"
    assert baseline["p50_ms"] == pytest.approx(benchmark["p50_ms_original"])
    for mine, gate in zip(baseline["input_sets"], benchmark["shapes"], strict=True):
        assert mine["name"] == gate["input_set"]
        assert {k: v for k, v in mine.items() if k != "name"} == gate["original"]
    # The first pass was given the upload's latency as its "before" once the gate had timed it.
    assert report["passes"][0]["latency_ms_p50_before"] == baseline["p50_ms"]


def test_baseline_times_the_upload_alone_when_no_pass_is_kept(tmp_path: Path, slow_mlp_path: Path) -> None:
    settings = PipelineSettings(verify_shape_sets=2, benchmark_warmup=1, ledger_runs=10, intra_op_threads=1)
    result = _run(slow_mlp_path, tmp_path, settings, Idle())
    baseline = result.report["baseline"]
    assert result.used_original and result.report["benchmark"] is None
    assert baseline["timed_by"] == "alone"
    # Decided without it: the quick floor of 5 runs each, not ledger_runs.
    assert [s["runs"] for s in baseline["input_sets"]] == [5, 5]
    assert result.report["timings"]["sessions"]["built"] == 1
    assert validate_report(result.report) == []


def _tie_job(model: Path, out: Path, config: JobConfig) -> PipelineResult:
    settings = PipelineSettings(
        verify_shape_sets=2, benchmark_warmup=1, benchmark_min_runs=10, benchmark_max_seconds=0.5, ledger_runs=5,
        intra_op_threads=1,
    )  # fmt: skip
    request = PipelineRequest(model, out, config, settings, pass_resolver=resolver(OneUlp()))
    return run_pipeline(request)


def test_fast_gate_hands_back_the_upload_and_says_so_when_it_stops_on_a_tie(tmp_path: Path, mlp_path: Path) -> None:
    """One ulp changes a weight, not speed: the gate's answer is a tie (at the floor, or a later turn under load)
    or already settled (a quiet host); either way what the report says matches what came back."""
    result = _tie_job(mlp_path, tmp_path, JobConfig(preset="fast"))
    report, decision = result.report, result.report["decision"]
    shapes = report["benchmark"]["shapes"]
    assert validate_report(report) == []
    if report["benchmark"]["tie"]:
        assert decision["result"] == "original" and decision["used_original"] and decision["gate"]["tie"] is True
        assert decision["failed_pass"] is None and "no faster than the uploaded model" in decision["reason"]
        assert result.model_path.read_bytes() == mlp_path.read_bytes()
        assert TIE_STOP in [s["stopped_by"] for s in shapes]
        # Each set stopped at its floor or, on a loaded host whose first 10 pairs left it open, at a later turn;
        # paired blocks either way.
        assert all(s["original"]["runs"] == s["optimized"]["runs"] >= 10 for s in shapes)
    else:
        assert TIE_STOP not in [s["stopped_by"] for s in shapes] and "tie" not in decision["gate"]


def test_gate_never_stops_on_a_tie_when_the_job_is_not_a_fast_preset(tmp_path: Path, mlp_path: Path) -> None:
    """Passes named by the job (no preset): a tie is timed to its end and the artifact kept when not slower."""
    result = _tie_job(mlp_path, tmp_path, JobConfig())
    report = result.report
    assert report["benchmark"]["tie"] is False and "tie" not in report["decision"]["gate"]
    assert TIE_STOP not in [s["stopped_by"] for s in report["benchmark"]["shapes"]]
