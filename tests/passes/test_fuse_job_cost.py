"""What fuse_transformer and fuse_gqa run per job, counted (issue 17, job time): no engine run whose result
cannot be chosen, no per-layer trace of a group with no unfused site, no full-model shape probe when no layer's
mask is causal. The counters wrap the real functions; the results are checked against the original (ORT) and
against the engine run that would have been chosen anyway."""

from __future__ import annotations

import sys

import numpy as np
import onnx_ir as ir

from passes._infra import op_histogram
from passes.fusion import _layer_reasons as layer_reasons
from passes.fusion import fuse_gqa
from passes.fusion import fuse_transformer as ft
from passes.fusion.fuse_gqa import FuseGqa
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, assert_same_outputs
from tests.passes.test_fuse_torchscript_attention import assert_same_as_export


def const(value: np.ndarray, name: str) -> ir.Node:
    return ir.node("Constant", [], {"value": ir.tensor(value)}, name=name)


def counting(monkeypatch, module, name: str) -> list[tuple]:
    """Calls of ``module.name``, which still runs."""
    real, calls = getattr(module, name), []

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_fuse_transformer_runs_ort_only_on_the_original_when_onnxscript_outscores_what_ort_could_add(monkeypatch):
    # setup: BERT with the int8 preset's options: onnxscript makes 8 of the 9 expected fusions (not the embedding
    # norm) and packs each layer's Q/K/V (2): score 10, where ORT on that candidate could reach 9
    options = {"attention": "mha", "pack_qkv": True}
    ft._LAST.clear()
    alone = FuseTransformer({"engines": ["onnxscript"], **options})(ir.load(MODELS / "hf_bert_encoder.onnx"))
    ft._LAST.clear()
    ort_runs = counting(monkeypatch, ft, "_ort")
    # execute
    result = FuseTransformer(options)(ir.load(MODELS / "hf_bert_encoder.onnx"))
    # assert
    candidates = result.notes["candidates"]
    assert result.notes["chosen"] == "onnxscript" and candidates["onnxscript"]["packed_qkv"] == 2
    skipped = candidates["onnxscript+ort"]["skipped"]
    assert skipped == "onnxscript verified with score 10, more than ORT after onnxscript could reach (9)"
    assert len(ort_runs) == 1  # ORT alone, which could still reach 11: built as before
    assert "skipped" not in candidates["ort"]
    assert op_histogram(result.model) == op_histogram(alone.model)
    assert len(result.model.graph) == len(alone.model.graph)
    assert_same_outputs("bert_encoder", result.model)


def test_fuse_transformer_counts_attention_as_packed_projections_and_skips_ort_alone(monkeypatch):
    # setup: a TorchScript BERT under fast's options. onnxscript fuses each layer into com.microsoft::Attention,
    # whose Q/K/V projections are one GEMM on one packed weight: as many packings as pack_qkv could make of the
    # input. Counted as none, no candidate reached ORT alone's bound and its run (a wav2vec2 job's slowest
    # step) was made for a candidate that could at best tie.
    options = {"pack_qkv": True}
    ft._LAST.clear()
    ort_runs = counting(monkeypatch, ft, "_ort")
    # execute
    result = FuseTransformer(options)(ir.load(MODELS / "ts_bert_eager.onnx"))
    # assert
    candidates = result.notes["candidates"]
    chosen = result.notes["chosen"]
    assert op_histogram(result.model)["com.microsoft::Attention"] == 2 and result.notes["missing"] == {}
    assert candidates[chosen]["packed_in_attention"] == 2 and candidates[chosen]["packed_qkv"] == 0
    assert candidates["ort"]["skipped"].startswith(f"{chosen} verified with score 11, the most ORT alone")
    assert len(ort_runs) == 1  # onnxscript+ort, which may still tie with fewer nodes: built
    assert "skipped" not in candidates["onnxscript+ort"]
    # the choice ORT alone's run would have lost to
    ft._LAST.clear()
    every = FuseTransformer({**options, "engines": ["onnxscript", "onnxscript+ort"]})(
        ir.load(MODELS / "ts_bert_eager.onnx")
    )
    assert op_histogram(result.model) == op_histogram(every.model)
    assert_same_as_export("ts_bert_eager", result.model)


def test_fuse_transformer_leaves_ort_residual_norm_fusions_out_when_onnxscript_fused_every_expected_one(monkeypatch):
    # setup: a TorchScript BERT, whose 4 residual norms onnxscript fuses. ORT's two skip-norm fusions (LayerNorm,
    # RMSNorm) each run its symbolic shape inference over the whole graph, with nothing left for them to fuse.
    import onnxruntime.transformers.optimizer  # noqa: F401  (puts ORT's transformers folder on sys.path)

    # ORT's optimizer imports its modules by their bare names: this is the class its fusions call
    inferences = counting(monkeypatch, sys.modules["onnx_model"].OnnxModel, "infer_runtime_shape")
    options = {"pack_qkv": True, "engines": ["onnxscript", "onnxscript+ort"]}
    real = ft._ort
    monkeypatch.setattr(ft, "_ort", lambda *a, **k: real(*a, **{**k, "skip_norms": True}))
    ft._LAST.clear()
    with_norms = FuseTransformer(options)(ir.load(MODELS / "ts_bert_eager.onnx"))
    monkeypatch.setattr(ft, "_ort", real)
    forced = len(inferences)
    ft._LAST.clear()
    # execute
    result = FuseTransformer(options)(ir.load(MODELS / "ts_bert_eager.onnx"))
    # assert
    candidate = result.notes["candidates"]["onnxscript+ort"]
    assert candidate["ort_skip_norm_fusion"] == "not run: onnxscript fused all 4 expected"
    assert len(inferences) - forced == forced - 2  # the two norm fusions' inferences are gone
    assert result.notes["chosen"] == with_norms.notes["chosen"] == "onnxscript+ort"
    assert op_histogram(result.model) == op_histogram(with_norms.model)
    assert op_histogram(result.model)["com.microsoft::SkipLayerNormalization"] == 4
    assert_same_as_export("ts_bert_eager", result.model)


def test_fuse_transformer_still_builds_onnxscript_plus_ort_when_it_could_tie():
    # setup: without pack_qkv, onnxscript+ort can tie onnxscript's fusions and win the tie on fewer nodes
    ft._LAST.clear()
    # execute
    result = FuseTransformer()(ir.load(MODELS / "hf_gpt2.onnx"))
    # assert
    assert "skipped" not in result.notes["candidates"]["onnxscript+ort"]
    assert result.notes["candidates"]["onnxscript+ort"]["achieved"]["attention"] == 2


def test_layer_reasons_traces_only_the_groups_left_unfused(monkeypatch):
    # setup: layer 1's tanh GELU has a cubic coefficient of 0.05: only that GELU stays, attention and norms fuse
    model = ir.load(MODELS / "ts_gpt2_eager.onnx")
    tanh = [n for n in model.graph if n.op_type == "Tanh"][1]
    inner = tanh.inputs[0].producer().inputs[0].producer()
    cubic = next(v.producer() for v in inner.inputs if v.producer().op_type == "Mul")
    other = const(np.array(0.05, np.float32), "probe/cubic")
    model.graph.insert_before(cubic, [other])
    cubic.replace_input_with(1, other.outputs[0])
    traces = counting(monkeypatch, layer_reasons.adapter, "trace_roots")
    ft._LAST.clear()
    # execute
    result = FuseTransformer({"engines": ["onnxscript"]})(model)
    # assert: one trace, of the GELU rule sets; the reason is the one the per-layer test pins
    assert [args[1][:2] for args in traces] == [["gelu", "bias_gelu"]]
    (reason,) = [nm.reason for nm in result.non_matches if nm.node == tanh.name]
    assert reason.endswith("(CONDITION_FAILED): cubic is 0.05, expected 0.044715: not the tanh GELU")


def test_fuse_gqa_probes_each_mask_once_and_runs_no_shape_probe_when_no_mask_is_causal(monkeypatch):
    # setup: BART (TorchScript eager): encoder padding masks, decoder self-attention causal but blind to the fed
    # attention_mask, cross-attention: no layer's mask is causal plus key padding
    model = ir.load(MODELS / "corpus" / "bart_ts_eager.onnx")
    softmaxes = sum(n.op_type == "Softmax" for n in model.graph)
    before = op_histogram(model)
    shape_probes = counting(monkeypatch, fuse_gqa, "measure_shapes")
    mask_probes = counting(monkeypatch, fuse_gqa, "probe_mask")
    # execute
    result = FuseGqa()(model)
    # assert
    assert not result.modified and op_histogram(result.model) == before
    assert shape_probes == []
    assert len(mask_probes) == len({id(args[2]) for args in mask_probes}) <= 3  # encoder, decoder self, cross
    assert len(result.non_matches) == softmaxes
    for layer, declined in enumerate(result.non_matches):
        assert declined.reason.startswith(f"attention layer {layer} ")
        assert "not causal self-attention" in declined.reason


def test_fuse_gqa_still_measures_shapes_once_when_a_mask_is_causal(monkeypatch):
    # setup
    model = ir.load(MODELS / "corpus" / "llama_dynamo.onnx")
    layers = sum(n.op_type == "Softmax" for n in model.graph)
    shape_probes = counting(monkeypatch, fuse_gqa, "measure_shapes")
    mask_probes = counting(monkeypatch, fuse_gqa, "probe_mask")
    # execute
    result = FuseGqa()(model)
    # assert: every layer shares one mask, probed once
    assert result.counts["fused_gqa"] == layers
    assert len(shape_probes) == 1 and len(mask_probes) == 1
