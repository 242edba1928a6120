"""What fuse_transformer and fuse_gqa run per job, counted (issue 17, job time): no engine run whose result
cannot be chosen, no per-layer trace of a group with no unfused site, no full-model shape probe when no layer's
mask is causal. The counters wrap the real functions; the results are checked against the original (ORT) and
against the engine run that would have been chosen anyway."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes._infra import op_histogram
from passes.fusion import _layer_reasons as layer_reasons
from passes.fusion import fuse_gqa
from passes.fusion import fuse_transformer as ft
from passes.fusion.fuse_gqa import FuseGqa
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, assert_same_outputs


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
