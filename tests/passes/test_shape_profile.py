"""shape_profile: ranges, the decision rule, the recipe it writes, and one real run in fresh processes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from core import recipe as core_recipe
from core import runtime
from core.errors import InvalidPassOptionsError
from passes._infra import PassContext
from passes.session import shape_profile as sp
from passes.session.shape_profile import ShapeProfile

MODELS = Path(__file__).resolve().parent.parent / "models"
ENCODER = MODELS / "hf_bert_encoder.onnx"  # [batch, sequence] ids, mask, token types; 128 positions


def encoder() -> ir.Model:
    return ir.serde.deserialize_model(onnx.load(str(ENCODER)))


def fake_child(peaks: dict[str, float], times: dict[str, float]):
    """A stand-in for the measurement process: figures per candidate, found by its recipe."""

    def which(recipe: dict) -> str:
        for name, cand in {**sp.CPU_CANDIDATES, **sp.CUDA_CANDIDATES}.items():
            if sp._recipe(cand, recipe["warmup"]) == recipe:
                return name
        raise AssertionError(recipe)

    def run_child(spec, spec_path, timeout_s=600.0):
        name = which(spec["recipe"])
        calls = spec["calls"]
        latency = [times.get(name, 1.0) * 1000 / calls] * calls
        return {
            "latency_ms": latency,
            "first_seen": [True] * calls,
            "rss_mb": [peaks.get(name, 500.0)] * calls,
            "trace_s": times.get(name, 1.0),
            "load_s": 0.1,
            "base_rss_mb": 100.0,
            "peak_rss_mb": peaks.get(name, 500.0),
            "peak_gpu_mb": None,
        }

    return run_child


def test_pass_writes_the_recipe_that_lowers_peak_memory_without_slowing(monkeypatch, tmp_path):
    peaks = {"default": 500.0, "mem_pattern_off": 470.0, "cpu_arena_off": 430.0}
    times = {"default": 1.0, "mem_pattern_off": 1.0, "cpu_arena_off": 1.2}  # arena off: leaner but slower
    monkeypatch.setattr(sp, "run_child", fake_child(peaks, times))
    model = encoder()
    result = ShapeProfile({"calls": 5, "repeats": 2})(model, PassContext())
    assert result.modified
    assert result.counts == {"candidates_measured": len(sp.CPU_CANDIDATES), "recipes_written": 1}
    report = result.notes["shape_profile"]
    assert report["chosen"] == "mem_pattern_off"
    rows = {r["name"]: r for r in report["candidates"]}
    assert "slower" in rows["cpu_arena_off"]["reason"]
    assert rows["mem_pattern_off"]["memory_saving_mb"] == pytest.approx(30.0)
    assert rows["mem_pattern_off"]["time_ratio_best"] == pytest.approx(1.0)
    recipe = json.loads(model.metadata_props[sp.RECIPE_KEY])
    assert sorted(recipe) == ["provider_options", "session_config", "session_options", "warmup"]
    assert recipe["session_options"] == {"enable_mem_pattern": False}
    assert core_recipe.sanitize_recipe(recipe) == recipe  # everything it writes, the runtime applies
    assert len(model.graph) == len(encoder().graph)  # no node touched
    path = tmp_path / "profiled.onnx"
    ir.save(model, path)
    assert runtime.load(path).get_session_options().enable_mem_pattern is False


def test_pass_keeps_the_default_when_no_candidate_saves_memory_within_the_slowdown(monkeypatch):
    peaks = {"default": 500.0, "mem_pattern_off": 498.0, "cpu_arena_off": 400.0, "warmup_largest": 520.0}
    times = {"default": 1.0, "cpu_arena_off": 1.06}  # 6% slower: beyond max_slowdown 5% whatever the noise
    monkeypatch.setattr(sp, "run_child", fake_child(peaks, times))
    model = encoder()
    result = ShapeProfile({"calls": 4, "repeats": 1})(model, PassContext())
    assert not result.modified
    assert sp.RECIPE_KEY not in model.metadata_props
    assert result.notes["shape_profile"]["chosen"] == "default"
    assert "kept ORT's defaults" in result.notes["decision"]


def test_warmup_candidate_records_the_largest_shape(monkeypatch):
    monkeypatch.setattr(sp, "run_child", fake_child({"default": 500.0, "warmup_largest": 450.0}, {}))
    model = encoder()
    options = {
        "calls": 3,
        "repeats": 1,
        "candidates": ["warmup_largest"],
        "ranges": {"batch": [1, 3], "sequence": [8, 40]},
    }
    result = ShapeProfile(options)(model, PassContext())
    recipe = json.loads(model.metadata_props[sp.RECIPE_KEY])
    assert result.modified
    assert recipe["warmup"] == [{"input_ids": [3, 40], "attention_mask": [3, 40], "token_type_ids": [3, 40]}]


def test_ranges_default_to_batch_1_8_and_sequence_8_512_clamped_to_the_position_table():
    model = encoder()
    inputs = sp._graph_inputs(model)
    dynamic = sp._dynamic_dims(inputs)
    assert dynamic == {"batch": "batch", "sequence": "sequence"}
    assert sp._max_positions(model) == 128
    plan = sp._dim_plan(inputs, dynamic, ShapeProfile.Options(), [], None)
    assert plan["batch"]["range"] == [1, 8] and plan["batch"]["source"] == "default"
    assert plan["sequence"]["range"] == [8, 512]
    plan = sp._dim_plan(inputs, dynamic, ShapeProfile.Options(), [], 128)
    assert plan["sequence"]["range"] == [8, 128] and plan["sequence"]["clamped_to"] == 128


def test_ranges_come_from_the_samples_then_the_options():
    model = encoder()
    inputs = sp._graph_inputs(model)
    dynamic = sp._dynamic_dims(inputs)
    samples = [{"input_ids": np.zeros((2, 16), np.int64)}, {"input_ids": np.zeros((4, 64), np.int64)}]
    plan = sp._dim_plan(inputs, dynamic, ShapeProfile.Options(), samples, 128)
    assert plan["batch"] == {"role": "batch", "buckets": None, "range": [2, 4], "source": "samples"}
    assert plan["sequence"]["range"] == [16, 64]
    one = sp._dim_plan(inputs, dynamic, ShapeProfile.Options(), samples[:1], 128)  # one size is no range
    assert one["sequence"]["source"] == "default"
    options = ShapeProfile.Options(ranges={"sequence": (32, 48)}, buckets={"batch": [1, 4, 2]})
    plan = sp._dim_plan(inputs, dynamic, options, samples, 128)
    assert plan["sequence"]["range"] == [32, 48] and plan["sequence"]["source"] == "option"
    assert plan["batch"]["buckets"] == [1, 2, 4]
    rng = np.random.default_rng(0)
    assert {sp._draw(plan, rng)["batch"] for _ in range(50)} == {1, 2, 4}


def test_options_refuse_unknown_candidates_and_bad_ranges():
    with pytest.raises(InvalidPassOptionsError):
        ShapeProfile({"candidates": ["rm_rf"]})
    with pytest.raises(InvalidPassOptionsError):
        ShapeProfile({"ranges": {"batch": [4, 2]}})
    with pytest.raises(InvalidPassOptionsError):
        ShapeProfile({"calls": 1})


def test_cuda_candidates_only_when_the_cuda_ep_is_there():
    names = set(sp._candidates(ShapeProfile.Options(), "cuda"))
    has_cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    assert ("cuda_arena_same_as_requested" in names) == has_cuda
    assert not set(sp._candidates(ShapeProfile.Options(), "cpu")) & set(sp.CUDA_CANDIDATES)


def test_model_without_dynamic_axes_is_left_alone():
    model = encoder()
    for value in model.graph.inputs:
        value.shape = ir.Shape([1, 8])
    result = ShapeProfile()(model, PassContext())
    assert not result.modified
    assert result.notes["decision"].startswith("skipped")


def test_pass_measures_every_candidate_in_fresh_processes_on_a_short_trace():
    model = encoder()
    options = {"calls": 5, "repeats": 1, "ranges": {"batch": [1, 4], "sequence": [8, 64]}}
    result = ShapeProfile(options)(model, PassContext())
    report = result.notes["shape_profile"]
    names = [r["name"] for r in report["candidates"]]
    assert names[0] == "default" and set(names) == set(sp.CPU_CANDIDATES)
    assert report["chosen"] in names
    for row in report["candidates"]:
        assert not row["errors"], row
        assert row["peak_rss_mb"] > row["base_rss_mb"] > 0
        assert row["trace_s"] > 0 and row["load_s"] > 0
        assert len(row["trace_s_runs"]) == 1
    series = report["plot"]["latency"]["series"]
    assert {s["name"] for s in series} == set(names)
    assert all(len(s["latency_ms"]) == 5 and set(s["spikes"]) <= set(range(5)) for s in series)
    assert series[0]["first_seen"][0] == 0  # the first call always meets a new shape
    assert {b["name"] for b in report["plot"]["peak_memory"]["bars"]} == set(names)
    assert len(report["trace"]) == 5 and report["dims"]["sequence"]["range"] == [8, 64]
    json.dumps(result.notes)  # the report stores notes as JSON
    assert (sp.RECIPE_KEY in model.metadata_props) == result.modified


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(), reason="needs the CUDA EP")
def test_pass_measures_cuda_candidates_on_a_gpu():
    model = encoder()
    result = ShapeProfile({"calls": 4, "repeats": 1, "candidates": ["cuda_arena_same_as_requested"]})(
        model, PassContext(target="cuda")
    )
    rows = {r["name"]: r for r in result.notes["shape_profile"]["candidates"]}
    assert set(rows) == {"default", "cuda_arena_same_as_requested"}
    assert not rows["cuda_arena_same_as_requested"]["errors"]
