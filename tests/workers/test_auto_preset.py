"""Preset auto (candidates benchmarked, fastest within tolerance kept), presets int8/fp16, the dynamic-axes
check, fix_shapes input sets and the tune_session recipe in the pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

from core.config import JobConfig, PassSpec
from core.settings import PipelineSettings
from passes import registry
from passes._infra import Pass, PassContext, PassResult
from passes.session.fix_shapes import FixShapes
from passes.session.tune_session import TuneSession
from tests.workers.conftest import MODELS, resolver
from workers.pipeline import PipelineRequest, resolve_passes, run_pipeline
from workers.report import validate_report


def _run(path: Path, out: Path, config: JobConfig, settings: PipelineSettings, pass_resolver=None):
    return run_pipeline(PipelineRequest(path, out, config, settings, pass_resolver=pass_resolver))


@pytest.fixture
def auto_settings(fast_settings: PipelineSettings) -> PipelineSettings:
    """Lighter still: auto runs three ledgers, so one input set and short quick measurements."""
    return fast_settings.model_copy(update={"verify_shape_sets": 1, "ledger_runs": 5, "benchmark_min_runs": 9})


def _problems(report: dict) -> list[str]:
    """validate_report's problems with the keys these tests cover (others' keys have their own tests)."""
    return [p for p in validate_report(report) if p.startswith(("report:", "candidates", "session", "decision"))]


def _check_auto(report: dict) -> dict:
    candidates = report["candidates"]
    assert candidates and candidates[0]["name"] == "safe"
    assert {c["status"] for c in candidates} <= {"chosen", "measured", "rejected", "skipped"}
    measured = [c for c in candidates if c["status"] in ("chosen", "measured")]
    chosen = [c for c in candidates if c["status"] == "chosen"]
    assert len(chosen) == 1
    assert chosen[0]["speedup"] == max(c["speedup"] for c in measured)  # the fastest within tolerance
    assert all(c["verification"]["ok"] for c in measured)
    # Never slower than the upload: whether the gate measured the chosen candidate slower depends on this
    # shared machine's noise, but when it did, the upload must be what comes back.
    if report["decision"]["gate"]["slower"]:
        assert report["decision"]["used_original"] and report["decision"]["result"] == "original"
    assert _problems(report) == []
    return chosen[0]


def test_auto_preset_lists_candidates_and_keeps_the_fastest_when_run_on_mlp(
    tmp_path: Path, mlp_path: Path, auto_settings: PipelineSettings
) -> None:
    # execute
    result = _run(mlp_path, tmp_path / "out", JobConfig(preset="auto", time_budget_s=60), auto_settings)
    # assert
    chosen = _check_auto(result.report)
    names = [c["name"] for c in result.report["candidates"]]
    assert names == ["safe", "fast", "fast+fuse_transformer"]  # exact tolerance: no int8, cpu: no fp16
    assert result.report["preset"] == "auto"
    if not result.used_original:
        assert [p["name"] for p in result.report["passes"] if p["status"] == "applied"] == chosen["passes"]


def test_auto_preset_skips_candidates_when_the_time_budget_is_spent_on_roberta(
    tmp_path: Path, auto_settings: PipelineSettings
) -> None:
    # A budget no first candidate fits in (passes, verification and a benchmark take far longer than 10 ms), so
    # the test does not depend on how fast this host runs the first one.
    result = _run(
        MODELS / "hf_roberta_cls.onnx", tmp_path / "out", JobConfig(preset="auto", time_budget_s=0.01), auto_settings
    )
    candidates = result.report["candidates"]
    assert candidates[0]["status"] in ("chosen", "rejected")
    assert all(c["status"] == "skipped" and "time budget" in c["reason"] for c in candidates[1:])
    if candidates[0]["status"] == "chosen":
        _check_auto(result.report)


def test_resolve_passes_offers_int8_to_auto_when_tolerance_is_as_loose_as_int8s(fast_settings) -> None:
    loose = registry.PRESETS["int8"].tolerance
    names = [n for n, _ in resolve_passes(JobConfig(preset="auto", tolerance=loose), fast_settings).variants or []]
    assert "int8" in names and "fp16" not in names  # fp16 only on GPU targets
    exact = [n for n, _ in resolve_passes(JobConfig(preset="auto"), fast_settings).variants or []]
    assert "int8" not in exact


def test_int8_and_fp16_presets_resolve_with_pass_options_when_named(fast_settings) -> None:
    int8 = resolve_passes(JobConfig(preset="int8"), fast_settings)
    names = [p.name for p in int8.passes]
    assert names.index("fuse_transformer") < names.index("quantize_dynamic")
    fuse = next(p for p in int8.passes if p.name == "fuse_transformer")
    # Stops at MultiHeadAttention with Q/K/V packed: the projections stay MatMuls that quantize_dynamic turns
    # into one DynamicQuantizeMatMul (QAttention has no attention_bias input).
    assert fuse.options.attention == "mha" and fuse.options.pack_qkv is True
    assert int8.tolerance == registry.PRESETS["int8"].tolerance
    fp16 = resolve_passes(JobConfig(preset="fp16"), fast_settings)
    assert "mixed_precision" in [p.name for p in fp16.passes]
    specs = registry.get_preset("int8").to_dict()["pass_specs"]
    assert next(s for s in specs if s["name"] == "fuse_transformer") == PassSpec(
        name="fuse_transformer", options={"attention": "mha", "pack_qkv": True}
    ).model_dump(mode="json")


class FreezeBatch(Pass):
    """WRONG for a dynamic model: declares the batch axis of every input static (2)."""

    name = "test_freeze_batch"
    summary = "test only: loses a dynamic axis"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        for value in model.graph.inputs:
            if value.shape is not None and len(value.shape):
                value.shape = ir.Shape([2, *list(value.shape)[1:]])
        return PassResult(model, True)


def test_pipeline_rolls_back_a_pass_that_makes_a_dynamic_axis_static(
    tmp_path: Path, mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    result = _run(mlp_path, tmp_path / "out", JobConfig(), fast_settings, resolver(FreezeBatch()))
    record = result.report["passes"][0]
    assert record["status"] == "rolled_back" and "made dynamic axes static" in record["reason"]


def test_pipeline_applies_fix_shapes_and_verifies_at_the_fixed_shape_when_requested(
    tmp_path: Path, mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    proto = onnx.load(str(mlp_path))
    dim = next(d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim if d.dim_param)
    result = _run(mlp_path, tmp_path / "out", JobConfig(), fast_settings, resolver(FixShapes({"dims": {dim: 3}})))
    record = result.report["passes"][0]
    assert record["status"] in ("applied", "rolled_back"), record["reason"]
    assert "dynamic axes" not in (record["reason"] or "")
    assert all(s["shapes"][proto.graph.input[0].name][0] == 3 for s in result.report["input_sets"])


def test_pipeline_reports_and_benchmarks_the_session_recipe_when_tune_session_applies(
    tmp_path: Path, mlp_path: Path, fast_settings: PipelineSettings
) -> None:
    tune = TuneSession({"runs": 3, "threads": [0, 1], "optimization_levels": False, "write_default": True})
    result = _run(mlp_path, tmp_path / "out", JobConfig(), fast_settings, resolver(tune))
    assert result.report["passes"][0]["status"] == "applied", result.report["passes"][0]["reason"]
    if not result.used_original:
        props = result.report["artifact"]["metadata_props"]
        recipe = json.loads(props["onnxforge.session"])
        assert result.report["session"]["session_options"] == recipe["session_options"]
    assert _problems(result.report) == []


@pytest.mark.parametrize("name", ["int8", "fp16", "auto"])
def test_new_presets_resolve_when_named(name: str) -> None:
    assert registry.get_preset(name).name == name
