"""Granite SWA's cached exports through the ``fast`` preset's passes up to fuse_gqa (issues 17/19, held-out
decoders, round 7).

``tests/models/heldout/granite_swa_past_ts.onnx`` and ``granite_swa_past_dynamo.onnx``: ``python -m
bench.heldout_dec_round7 --only granite_swa --forms past --exporters ts_eager dynamo --presets --tiny`` (2 layers,
hidden 32, 4 heads of 8, 2 kv heads, a window of 64 keys on layer 0 then global attention, vocabulary 256,
Optimum's signature). Its attention sinks are written after the context, not as a softmax column (GPT-OSS's,
``test_heldout_attention_sinks.py``): ``MatMul(softmax(x), v) * sigmoid(logsumexp(x) - sink)``, the share of
each row the sink's column would have taken. No layer fused before (0/2: "expected Transpose after MatMul(probs,
v); found Mul"); now each is GroupQueryAttention with the sinks as its ``head_sink``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from passes._infra import op_histogram
from passes.fusion._gqa_match import match_sites
from tests.passes._decoder_replay import assert_decodes_like_export, fast_upto

HELDOUT = Path(__file__).resolve().parent.parent / "models" / "heldout"
LAYERS, HEADS = 2, 4
CASES = ("granite_swa_past_ts", "granite_swa_past_dynamo")


@pytest.fixture(scope="module", params=CASES)
def fused(request) -> tuple[str, ir.Model, dict[str, int]]:
    return request.param, *fast_upto(HELDOUT / f"{request.param}.onnx")


def _sinks(path: Path) -> list[np.ndarray]:
    """Each layer's sinks as the export holds them: the [1, H, 1] constants its ``Sub`` from the logsumexp reads."""
    model = onnx.load(path)
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    subs = [n for n in model.graph.node if n.op_type == "Sub" and n.input[1] in consts]
    return [consts[n.input[1]].reshape(-1) for n in subs if consts[n.input[1]].shape == (1, HEADS, 1)]


def test_every_attention_becomes_gqa_with_the_sinks_its_context_was_scaled_by(fused) -> None:
    name, model, counts = fused
    ops = op_histogram(model)
    assert counts.get("fuse_gqa.fused_gqa", 0) == LAYERS
    assert ops["com.microsoft::GroupQueryAttention"] == LAYERS
    assert not any(n.op_type in ("Softmax", "ReduceLogSumExp") and n.domain == "" for n in model.graph)
    nodes = sorted((n for n in model.graph if n.op_type == "GroupQueryAttention"), key=lambda n: n.name)
    got = sorted(tuple(ir.convenience.get_const_tensor(n.inputs[11]).numpy()) for n in nodes)
    want = sorted(map(tuple, _sinks(HELDOUT / f"{name}.onnx")))
    assert len(want) == LAYERS and got == want
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


@pytest.mark.parametrize("prompt", [6, 40])
def test_fused_decoder_computes_what_the_export_does_on_a_growing_cache(fused, prompt) -> None:
    name, model, _ = fused
    assert_decodes_like_export(HELDOUT / f"{name}.onnx", model, batch=1 if prompt > 6 else 2, prompt=prompt)


def _scaled_context(gate_reads: str) -> ir.Model:
    """Attention whose context is scaled by ``sigmoid(logsumexp(...) - sink)``, the logsumexp reading
    ``gate_reads`` (the Softmax's own input, or the scores before their mask)."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scores"]),
        helper.make_node("Add", ["scores", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["context"]),
        helper.make_node("ReduceLogSumExp", [gate_reads, "last"], ["lse"], keepdims=0),
        helper.make_node("Sub", ["lse", "sink"], ["shifted"]),
        helper.make_node("Sigmoid", ["shifted"], ["share"]),
        helper.make_node("Unsqueeze", ["share", "last"], ["gate"]),
        helper.make_node("Mul", ["context", "gate"], ["scaled"]),
        helper.make_node("Transpose", ["scaled"], ["out"], perm=[0, 2, 1, 3]),
    ]
    inits = [
        helper.make_tensor("scale", f, [], [0.25]),
        helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("sink", f, [1, 2, 1], [0.5, -0.5]),
    ]
    shape = ["b", 2, "s", 8]
    inputs = [helper.make_tensor_value_info(n, f, shape) for n in ("q", "k", "v")]
    inputs.append(helper.make_tensor_value_info("mask", f, ["b", 1, "s", "s"]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("out", f, None)], inits)
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_the_scale_is_read_as_sinks_only_when_its_logsumexp_reads_what_the_softmax_reads() -> None:
    sites, _ = match_sites(_scaled_context("masked").graph)
    assert len(sites) == 1 and sites[0].sink.tolist() == [0.5, -0.5]
    assert sites[0].out.name == "out"
    sites, declined = match_sites(_scaled_context("scores").graph)  # the unmasked scores: no softmax's share
    assert not sites
    assert "expected MatMul(probs, v) to feed one Transpose; found Mul" in declined[0].reason
