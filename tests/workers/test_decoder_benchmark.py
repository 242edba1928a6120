"""workers/decoder_benchmark.py: a decoder job's report carries prefill, decode, weights and memory of the
original and the returned model; other jobs say why they have none.

Jobs run through ``run_pipeline`` (no HTTP) with the ``safe`` preset on the committed tiny decoders of both
exporters, so the returned model is a real artifact. No timing is asserted: only that every figure is there,
positive and consistent, and that the decode loop fed each step a cache one position longer.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import numpy_helper

from core.config import DecoderBenchmark, JobConfig
from core.errors import InvalidConfigError
from core.inputs import cache_pairs
from core.settings import PipelineSettings
from tests.workers.conftest import MODELS, Idle, resolver
from workers.decoder_benchmark import decoder_section, make_plan, run_decoder_benchmark, weight_bytes
from workers.pipeline import PipelineRequest, PipelineResult, run_pipeline
from workers.report import validate_report

DECODERS = MODELS / "decoders"
SEQ2SEQ = DECODERS.parent / "seq2seq"
SMALL = {"prompt_lengths": [16, 48], "new_tokens": 8, "time_budget_s": 10}
JOBS = {
    "llama_past_ts.onnx": SMALL,
    "llama_past_dynamo.onnx": SMALL,
    "gpt2_past_ts.onnx": {"time_budget_s": 10},  # the defaults: 128 and 512 meet GPT-2's 128-row table
}
_RESULTS: dict[str, PipelineResult] = {}


@pytest.fixture
def settings() -> PipelineSettings:
    return PipelineSettings(
        verify_shape_sets=2,
        benchmark_warmup=1,
        benchmark_min_runs=5,
        benchmark_max_seconds=0.2,
        ledger_runs=5,
        intra_op_threads=1,
    )


def _job(name: str, tmp_path_factory: pytest.TempPathFactory, settings: PipelineSettings) -> PipelineResult:
    """One pipeline run per model for the whole module: the tests read different parts of its report."""
    if name not in _RESULTS:
        config = JobConfig.parse({"preset": "safe", "decoder_benchmark": JOBS[name]})
        request = PipelineRequest(DECODERS / name, tmp_path_factory.mktemp("decoder"), config, settings)
        _RESULTS[name] = run_pipeline(request)
    return _RESULTS[name]


def _initializer_bytes(path: Path) -> int:
    model = onnx.load(str(path))
    return sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


@pytest.mark.parametrize("name", list(JOBS))
def test_decoder_section_has_both_models_figures_when_a_kv_cache_decoder_is_optimized(
    name: str, tmp_path_factory: pytest.TempPathFactory, settings: PipelineSettings
) -> None:
    result = _job(name, tmp_path_factory, settings)
    report = result.report
    assert validate_report(report) == []
    section = report["decoder"]
    assert section["status"] == "measured", section
    assert section["reason"] is None
    assert report["timings"]["decoder_s"] >= section["duration_s"] > 0
    for entry in section["prefill"]:
        assert entry["past_length"] == 0  # both exporters take an empty past
        for label in ("original", "optimized"):
            assert entry[label]["p50_ms"] > 0 and entry[label]["runs"] >= 5
    assert [e["prompt_length"] for e in section["prefill"]] == section["prompt_lengths"]
    decode = section["decode"]
    tokens = decode["new_tokens"]
    for label in ("original", "optimized"):
        figures = decode[label]
        assert len(figures["per_position_ms"]) == tokens and all(v > 0 for v in figures["per_position_ms"])
        assert figures["ms_per_token"] == pytest.approx(np.mean(figures["per_position_ms"]))
        assert figures["tokens_per_s"] == pytest.approx(1000.0 / figures["ms_per_token"])
    assert decode["speedup"] == pytest.approx(decode["original"]["ms_per_token"] / decode["optimized"]["ms_per_token"])
    weights = section["weights"]
    assert weights["original"]["bytes"] == _initializer_bytes(DECODERS / name)
    assert weights["optimized"]["bytes"] == _initializer_bytes(result.model_path)
    memory = section["memory"]
    assert memory["reason"] is None, memory
    for label in ("original", "optimized"):
        rss = memory[label]
        assert rss["peak_rss_mb"] >= rss["loaded_rss_mb"] > rss["baseline_rss_mb"] > 0
        assert rss["session_peak_mb"] == pytest.approx(rss["peak_rss_mb"] - rss["baseline_rss_mb"])


@pytest.mark.parametrize("name", list(JOBS))
def test_decode_feeds_back_a_cache_one_position_longer_at_each_step_when_tokens_are_generated(
    name: str, tmp_path_factory: pytest.TempPathFactory, settings: PipelineSettings
) -> None:
    decode = _job(name, tmp_path_factory, settings).report["decoder"]["decode"]
    start, tokens = decode["prompt_length"], decode["new_tokens"]
    for label in ("original", "optimized"):
        assert decode[label]["past_lengths"] == list(range(start, start + tokens))


def test_prompt_lengths_are_clipped_to_the_position_table_when_the_graph_has_one(
    tmp_path_factory: pytest.TempPathFactory, settings: PipelineSettings
) -> None:
    section = _job("gpt2_past_ts.onnx", tmp_path_factory, settings).report["decoder"]
    assert section["prompt_lengths"] == [126]  # 128 rows, less the 2 rows core.inputs keeps free
    assert section["decode"]["new_tokens"] == 32
    assert section["decode"]["prompt_length"] + 32 <= 126
    assert any("clipped" in note for note in section["notes"])


def test_html_draws_the_decode_latency_of_both_models_when_the_section_is_measured(
    tmp_path_factory: pytest.TempPathFactory, settings: PipelineSettings
) -> None:
    result = _job("llama_past_ts.onnx", tmp_path_factory, settings)
    page = result.report_html_path.read_text(encoding="utf-8")
    chart = page[page.index("Decoder: prefill and decode") :]
    chart = chart[: chart.index("</svg>")]
    assert chart.count("<polyline") == 2  # original and optimized
    assert len(re.findall(r"<circle ", chart)) == 2 * 8  # one dot per generated token and model
    assert "past length" in chart and "ms per token" in chart
    for figure in ("prefill ms, 16 tokens", "prefill ms, 48 tokens", "decode tokens/s", "weights MiB", "peak RSS"):
        assert figure in page


def test_decoder_section_is_skipped_with_its_reason_when_the_model_has_no_cache(
    tmp_path: Path, settings: PipelineSettings, mlp_path: Path
) -> None:
    request = PipelineRequest(mlp_path, tmp_path, JobConfig(), settings, pass_resolver=resolver(Idle()))
    report = run_pipeline(request).report
    section = report["decoder"]
    assert section["status"] == "skipped"
    assert "no past key/value inputs" in section["reason"]
    assert section["decode"] is None and section["prefill"] is None
    assert validate_report(report) == []
    assert "no past key/value inputs" in (tmp_path / "report.html").read_text(encoding="utf-8")


def test_decoder_section_is_skipped_when_the_job_disables_it_or_the_benchmark() -> None:
    path = DECODERS / "llama_past_ts.onnx"
    config = JobConfig.parse({"decoder_benchmark": {"enabled": False}})
    skipped = decoder_section(path, path, config, PipelineSettings(), failed=False)
    assert skipped["status"] == "skipped" and "enabled is false" in skipped["reason"]
    off = decoder_section(path, path, JobConfig.parse({"benchmark": False}), PipelineSettings(), failed=False)
    assert off["status"] == "skipped" and "config.benchmark is false" in off["reason"]


def test_plan_refuses_with_a_reason_when_the_export_has_no_cache() -> None:
    assert "no past key/value inputs" in str(make_plan(ir.load(DECODERS / "llama_nopast_dynamo.onnx")))
    plan = make_plan(ir.load(DECODERS / "llama_past_dynamo.onnx"))
    assert not isinstance(plan, str)
    assert plan.cache == {f"past_key_values.{i}.{kv}": f"present.{i}.{kv}" for i in range(2) for kv in ("key", "value")}
    feeds = plan.feeds(5, 3, seed=0)
    assert feeds["attention_mask"].shape == (1, 8) and feeds["past_key_values.0.key"].shape[2] == 3
    assert feeds["position_ids"].tolist() == [[3, 4, 5, 6, 7]]


@pytest.mark.parametrize("arch", ["whisper", "t5", "bart"])
def test_plan_keeps_a_seq2seq_decoders_encoder_length_while_its_self_cache_grows(arch: str) -> None:
    """Optimum's decoder_with_past: the cross-attention cache, encoder states and encoder mask span the
    source, which does not grow with the generated tokens; only the self-attention cache and mask do."""
    plan = make_plan(ir.load(SEQ2SEQ / arch / "decoder_with_past_model.onnx"))
    assert not isinstance(plan, str), plan
    assert plan.encoder_dims and not set(plan.encoder_dims) & {*plan.mask_dims, plan.past_dim, plan.sequence_dim}
    plan.encoder_length = 20
    first, later = plan.feeds(1, 4, seed=0), plan.feeds(1, 9, seed=1)
    for feeds, past in ((first, 4), (later, 9)):
        assert all(v.shape[2] == 20 for k, v in feeds.items() if ".encoder." in k), arch
        assert all(v.shape[2] == past for k, v in feeds.items() if ".decoder." in k), arch
        for name in ("encoder_hidden_states", "encoder_attention_mask"):
            if name in feeds:
                assert feeds[name].shape[1] == 20, (arch, name)
    assert plan.cache and not any(".encoder." in past for past in plan.cache)


def test_cache_pairs_match_by_name_then_order_and_refuse_otherwise() -> None:
    pasts = ["past.0.k", "past.0.v"]
    assert cache_pairs(pasts, ["logits", "present.0.k", "present.0.v"]) == {
        "past.0.k": "present.0.k",
        "past.0.v": "present.0.v",
    }
    assert cache_pairs(["cache_a", "cache_b"], ["logits", "present_a", "present_b"]) == {
        "cache_a": "present_a",
        "cache_b": "present_b",
    }
    assert isinstance(cache_pairs(pasts, ["logits", "new_cache"]), str)


def test_weight_bytes_counts_external_data_without_reading_it(tmp_path: Path) -> None:
    model = ir.load(DECODERS / "llama_past_ts.onnx")
    inline = weight_bytes(model)
    ir.save(model, tmp_path / "m.onnx", external_data="m.onnx.data", size_threshold_bytes=0)
    external = weight_bytes(ir.load(tmp_path / "m.onnx"))
    assert external["bytes"] == inline["bytes"] == external["external_bytes"] > 0
    assert inline["external_bytes"] == 0 and external["initializers"] == inline["initializers"]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"prompt_lengths": [0, 128]}, "prompt_lengths"),
        ({"prompt_lengths": [128, 128]}, "prompt_lengths"),
        ({"prompt_lengths": []}, "prompt_lengths"),
        ({"new_tokens": 0}, "new_tokens"),
        ({"time_budget_s": 0}, "time_budget_s"),
        ({"tokens": 5}, "tokens"),
    ],
)
def test_config_refuses_bad_decoder_benchmark_values_naming_the_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidConfigError, match=rf"decoder_benchmark\.{field}"):
        JobConfig.parse({"decoder_benchmark": options})


def test_step_inputs_are_one_token_after_the_growing_past_when_planned() -> None:
    plan = make_plan(ir.load(DECODERS / "gpt2_past_dynamo.onnx"))
    assert not isinstance(plan, str)
    steps = plan.step_inputs(10, 3, seed=1)
    assert [s["position_ids"].tolist() for s in steps] == [[[10]], [[11]], [[12]]]
    assert [s["attention_mask"].shape for s in steps] == [(1, 11), (1, 12), (1, 13)]
    assert all(np.all(s["attention_mask"] == 1) for s in steps)
    assert not any(k.startswith("past_key_values") for s in steps for k in s)


def test_benchmark_stops_early_and_says_so_when_the_time_budget_is_spent() -> None:
    path = DECODERS / "qwen2_past_dynamo.onnx"
    section = run_decoder_benchmark(path, path, DecoderBenchmark(prompt_lengths=[8], new_tokens=4, time_budget_s=0.01))
    assert section["status"] == "measured"
    assert section["decode"]["blocks"] == 1 and section["decode"]["stopped_by"] == "time budget"
    assert section["prefill"][0]["stopped_by"] != "max_runs"  # the floor of blocks, then the budget
    assert section["memory"]["original"] is None and "time budget" in section["memory"]["reason"]
    assert any("time budget" in note for note in section["notes"])


def test_decode_reports_a_cache_that_stops_growing_when_the_model_keeps_a_sliding_window() -> None:
    """Mistral's 64-position sliding window: the present holds 63 positions whatever the prompt, and the
    series says so instead of pretending a growing cache."""
    path = DECODERS / "mistral_past_ts.onnx"
    section = run_decoder_benchmark(path, path, DecoderBenchmark(prompt_lengths=[80], new_tokens=4, time_budget_s=4))
    assert section["status"] == "measured"
    assert section["decode"]["original"]["past_lengths"] == [63] * 4
    assert any("holds 63 positions, not 80" in note for note in section["notes"])


def test_decoder_notes_that_both_columns_are_one_model_when_the_job_hands_the_upload_back(
    tmp_path: Path, settings: PipelineSettings
) -> None:
    config = JobConfig.parse({"decoder_benchmark": {"prompt_lengths": [8], "new_tokens": 2, "time_budget_s": 4}})
    request = PipelineRequest(
        DECODERS / "qwen2_past_ts.onnx", tmp_path, config, settings, pass_resolver=resolver(Idle())
    )
    report = run_pipeline(request).report
    assert report["decision"]["used_original"] is True
    section = report["decoder"]
    assert section["status"] == "measured" and "same model" in section["notes"][0]
    assert section["weights"]["original"] == section["weights"]["optimized"]


def test_validate_report_names_problems_in_the_decoder_section_when_keys_drift(
    tmp_path_factory: pytest.TempPathFactory, settings: PipelineSettings
) -> None:
    report = copy.deepcopy(_job("llama_past_dynamo.onnx", tmp_path_factory, settings).report)
    del report["decoder"]["decode"]["optimized"]["tokens_per_s"]
    report["decoder"]["memory"]["original"]["surprise_mb"] = 1.0
    report["decoder"]["status"] = "maybe"
    problems = validate_report(report)
    assert "decoder.decode.optimized: missing key 'tokens_per_s'" in problems
    assert "decoder.memory.original: undocumented key 'surprise_mb'" in problems
    assert any("decoder: status 'maybe'" in p for p in problems)
    older = {k: v for k, v in report.items() if k != "decoder"}
    assert validate_report(older) == []  # a report from before the section is still valid
