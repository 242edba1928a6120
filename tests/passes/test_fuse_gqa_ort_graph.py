"""The graph ORT runs from a `fast` decoder, not the file on disk: after ORT's session optimizations
(``ORT_ENABLE_ALL``, the level users run) a corpus decoder's `fast` artifact is the decoder and nothing
else: per layer the packed projection and its Split, two RotaryEmbedding, GroupQueryAttention and the MLP;
once per graph the 6 nodes of seqlens_k / total_sequence_length (what onnxruntime-genai's builder has too);
no shape arithmetic, Reshape, Transpose, Expand or Where left. The TorchScript and dynamo exports of one
model optimize to the same node sequence (issue 19: their `fast` rows once measured 0.93x and 1.04x the
builder's fp32; bench/README.md, decoders-genai notes). Slower than the pass tests: two whole jobs per
family (a few seconds each), so two families: llama, and mistral with its sliding-window cache crops (qwen2
and phi3 optimize the same way, qwen2 with one more Add per layer for its q/k/v bias)."""

from __future__ import annotations

import json
from collections import Counter

import onnx
import onnxruntime as ort
import pytest

from core.config import JobConfig
from core.settings import PipelineSettings
from tests.models.build_decoders import OUT
from workers.pipeline import PipelineRequest, run_pipeline

MANIFEST = json.loads((OUT / "manifest.json").read_text())
# Per layer (the 2 Adds are the residuals); the mistral exports also crop the present cache to the sliding
# window with a Slice on each of key and value (their crop of the past into attention is GQA's window's job).
PER_LAYER = {
    "Add": 2,
    "MatMul": 4,
    "Split": 2,
    "RotaryEmbedding": 2,
    "GroupQueryAttention": 1,
    "QuickGelu": 1,
    "Mul": 1,
    "SimplifiedLayerNormalization": 2,
}
SEQLENS = {"Shape": 1, "Gather": 1, "Cast": 2, "ReduceSum": 1, "Sub": 1, "Max": 1}  # Max: an all-zero mask row


def _ort_graph(name: str, tmp_path) -> list[str]:
    settings = PipelineSettings(
        verify_shape_sets=3, benchmark_warmup=1, benchmark_min_runs=5, benchmark_max_seconds=0.1, ledger_runs=5,
        intra_op_threads=1,
    )  # fmt: skip
    config = JobConfig(preset="fast", rollback_slower=False, benchmark=False)
    result = run_pipeline(PipelineRequest(OUT / f"{name}.onnx", tmp_path / name, config, settings))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / f"{name}.ort.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(result.model_path), options, providers=["CPUExecutionProvider"])
    return [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_fast_decoder_is_only_the_decoder_after_ort_optimizations_when_either_exporter(family, tmp_path):
    # setup
    layers = MANIFEST["families"][family]["layers"]
    # execute
    torchscript, dynamo = _ort_graph(f"{family}_past_ts", tmp_path), _ort_graph(f"{family}_past_dynamo", tmp_path)
    # assert: one graph from both exporters, and nothing in it but the decoder and its seqlens
    assert torchscript == dynamo
    want = Counter({op: n * layers for op, n in PER_LAYER.items()})
    want.update(SEQLENS)
    want.update({"Gather": 1, "SimplifiedLayerNormalization": 1, "MatMul": 1})  # embedding, final norm, lm_head
    if family == "mistral":  # the present's crop to the window (the graph's outputs are defined cropped)
        want["Slice"] = 2 * layers
    assert Counter(torchscript) == want
