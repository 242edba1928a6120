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
from core.inputs import InputSynthesis
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


def plan(model: ir.Model, options=None, samples=(), max_positions=None):
    synthesis = InputSynthesis(model)
    return sp._dim_plan(
        synthesis, synthesis.free_dims(), options or ShapeProfile.Options(), list(samples), max_positions
    )


def test_dim_plan_draws_a_serving_like_trace_up_to_the_position_table_when_no_samples_are_given():
    """Issue 17: the defaults come from the model (its 128 positions), batches weighted to 1, lengths
    log-uniform over the table rather than a narrow uniform band."""
    model = encoder()
    synthesis = InputSynthesis(model)
    assert synthesis.facts.max_positions == 128
    dims = plan(model, max_positions=synthesis.facts.max_positions)
    assert dims["batch"]["buckets"] == [1, 2, 4, 8] and dims["batch"]["source"] == "default"
    assert dims["sequence"]["range"] == [8, 128] and dims["sequence"]["distribution"] == "log-uniform"
    rng = np.random.default_rng(0)
    draws = [sp._draw(dims, rng) for _ in range(400)]
    lengths = np.array([d["sequence"] for d in draws])
    batches = np.array([d["batch"] for d in draws])
    assert lengths.min() >= 8 and lengths.max() <= 128 and lengths.max() > 96  # the whole table is reached
    assert np.median(lengths) < 48  # most calls are short, as served traffic is
    assert (batches == 1).mean() > (batches == 8).mean() * 2


def test_dim_plan_fits_past_and_new_tokens_in_the_table_when_the_model_has_a_cache():
    model = ir.load(MODELS / "roles_gpt2_past.onnx")  # 64 positions; mask spans past_sequence + sequence
    synthesis = InputSynthesis(model)
    dims = plan(model, max_positions=synthesis.facts.max_positions)
    assert set(dims) == {"batch", "sequence", "past_sequence"}  # the mask's dim is derived, not drawn
    assert dims["past_sequence"]["role"] == "past" and dims["past_sequence"]["range"][0] == 0
    rng = np.random.default_rng(1)
    for _ in range(20):
        sizes = sp._draw(dims, rng)
        assert sizes["sequence"] + sizes["past_sequence"] <= 64
        feeds = synthesis.feeds_for_sizes(sizes, rng)
        assert feeds["attention_mask"].shape[1] == sizes["sequence"] + sizes["past_sequence"]


def test_dim_plan_starts_audio_at_the_convolution_stack_minimum_when_the_input_is_raw_audio():
    dims = plan(ir.load(MODELS / "roles_wav2vec2.onnx"))
    assert dims["samples"]["range"] == [400, 400 * 64]


def test_ranges_come_from_the_samples_then_the_options():
    model = encoder()
    samples = [{"input_ids": np.zeros((2, 16), np.int64)}, {"input_ids": np.zeros((4, 64), np.int64)}]
    dims = plan(model, samples=samples, max_positions=128)
    assert dims["batch"] == {
        "role": "batch", "buckets": None, "range": [2, 4], "source": "samples", "distribution": "uniform"
    }  # fmt: skip
    assert dims["sequence"]["range"] == [16, 64]
    one = plan(model, samples=samples[:1], max_positions=128)  # one size is no range
    assert one["sequence"]["source"] == "default"
    options = ShapeProfile.Options(ranges={"sequence": (32, 48)}, buckets={"batch": [1, 4, 2]})
    dims = plan(model, options, samples, 128)
    assert dims["sequence"]["range"] == [32, 48] and dims["sequence"]["source"] == "option"
    assert dims["batch"]["buckets"] == [1, 2, 4]
    rng = np.random.default_rng(0)
    assert {sp._draw(dims, rng)["batch"] for _ in range(50)} == {1, 2, 4}


def test_pass_prefers_the_leaner_serving_memory_when_the_load_dominates_peak_rss(monkeypatch):
    """Issue 17: every candidate's process peak is the model load's (600 MiB); the trace's own peak above
    the pre-load RSS is what differs, and decides."""
    serving = {"default": 300.0, "cpu_arena_same_as_requested": 240.0}
    child = fake_child({}, {})

    def run_child(spec, spec_path, timeout_s=600.0):
        result = child(spec, spec_path, timeout_s)
        name = next(
            n for n, c in sp.CPU_CANDIDATES.items() if sp._recipe(c, spec["recipe"]["warmup"]) == spec["recipe"]
        )
        result.update(peak_rss_mb=600.0, loaded_rss_mb=200.0, trace_peak_rss_mb=100.0 + serving.get(name, 300.0))
        return result

    monkeypatch.setattr(sp, "run_child", run_child)
    model = encoder()
    result = ShapeProfile({"calls": 4, "repeats": 1})(model, PassContext())
    report = result.notes["shape_profile"]
    assert report["chosen"] == "cpu_arena_same_as_requested"
    rows = {r["name"]: r for r in report["candidates"]}
    assert rows["cpu_arena_same_as_requested"]["memory_saving_mb"] == pytest.approx(60.0)
    assert rows["default"]["arena_growth_mb"] == pytest.approx(200.0)
    assert report["plot"]["peak_memory"]["y"] == "serving_mb"


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
        assert row["serving_mb"] > 0 and row["arena_growth_mb"] >= 0  # the trace's own memory, load excluded
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
