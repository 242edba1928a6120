"""GPT-OSS's cached exports through the ``fast`` preset's passes up to fuse_gqa (issues 17/19, held-out decoders,
round 3).

``tests/models/heldout/gpt_oss_past_ts.onnx`` and ``gpt_oss_past_dynamo.onnx``: ``python -m
bench.heldout_dec_round3 --only gpt_oss --forms past --exporters ts_eager dynamo --presets --tiny`` (2 layers,
hidden 32, 4 heads of 16, 2 kv heads, a window of 64 keys on layer 1 then global attention, 4 experts top-2,
vocabulary 256, Optimum's signature). Two forms no earlier export had, so neither layer fused:

* attention sinks: a learned logit per head joins each row of scores, ``Softmax(Concat(scores + mask,
  sink) - max)[..., :-1]``: now GroupQueryAttention with that logit as its ``head_sink``;
* rope over ``torch.chunk(x, 2, -1)``: ``Concat(x1*c - x2*s, x2*c + x1*s)`` with half-width factors (two Slices
  from TorchScript, one Split from dynamo): now ``RotaryEmbedding(interleaved=0)`` of x.
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
CASES = ("gpt_oss_past_ts", "gpt_oss_past_dynamo")


@pytest.fixture(scope="module", params=CASES)
def fused(request) -> tuple[str, ir.Model, dict[str, int]]:
    return request.param, *fast_upto(HELDOUT / f"{request.param}.onnx")


def _sinks(path: Path) -> list[np.ndarray]:
    """Each layer's learned sinks, read from the export's own weights (whatever the exporter named them)."""
    model = onnx.load(path)
    found = [onnx.numpy_helper.to_array(t).reshape(-1) for t in model.graph.initializer if "sinks" in t.name]
    if not found:  # TorchScript folds them into the [1, H, 1, 1] constants its Expand reads
        found = [
            onnx.numpy_helper.to_array(t).reshape(-1)
            for t in model.graph.initializer
            if list(t.dims) == [1, HEADS, 1, 1] and t.data_type == TensorProto.FLOAT
        ]
    return found


def test_every_attention_becomes_gqa_with_its_sinks_and_every_rope_a_rotary_embedding(fused) -> None:
    name, model, counts = fused
    ops = op_histogram(model)
    assert counts.get("fuse_gqa.fused_gqa", 0) == LAYERS
    assert ops["com.microsoft::GroupQueryAttention"] == LAYERS
    assert counts.get("fuse_rotary.rotary_embeddings", 0) == 2 * LAYERS
    assert ops["com.microsoft::RotaryEmbedding"] == 2 * LAYERS
    assert not any(n.op_type in ("Sin", "Cos", "ReduceMax") for n in model.graph)
    assert ops["Softmax"] == LAYERS  # the MoE routers' only
    nodes = sorted((n for n in model.graph if n.op_type == "GroupQueryAttention"), key=lambda n: n.name)
    got = [ir.convenience.get_const_tensor(n.inputs[11]).numpy() for n in nodes]
    want = _sinks(HELDOUT / f"{name}.onnx")
    assert len(want) == LAYERS
    assert sorted(map(tuple, got)) == sorted(map(tuple, want))
    windows = [n.attributes.get_int("local_window_size", -1) for n in nodes]
    assert windows[0] > 0 and windows[1] == -1, windows  # the sliding layer, then the global one
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


@pytest.mark.parametrize("prompt", [6, 60])
def test_fused_decoder_computes_what_the_export_does_on_a_growing_cache(fused, prompt) -> None:
    name, model, _ = fused
    # 60 then 4 steps ends on a cache of 63, the window's edge (the export refuses a longer one: its mask and
    # its cropped keys then differ in length), where local_window_size takes over from the export's crops
    assert_decodes_like_export(HELDOUT / f"{name}.onnx", model, batch=1 if prompt > 6 else 2, prompt=prompt)


def _attention_with_sink_input() -> ir.Model:
    """Sink attention whose sink column is a graph input, not a learned constant."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scores"]),
        helper.make_node("Add", ["scores", "mask"], ["masked"]),
        helper.make_node("Concat", ["masked", "sink"], ["joined"], axis=-1),
        helper.make_node("Softmax", ["joined"], ["probs"], axis=-1),
        helper.make_node("Slice", ["probs", "zero", "minus_one", "minus_one"], ["kept"]),
        helper.make_node("MatMul", ["kept", "v"], ["context"]),
        helper.make_node("Transpose", ["context"], ["out"], perm=[0, 2, 1, 3]),
    ]
    inits = [
        helper.make_tensor("scale", f, [], [0.25]),
        helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
        helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1]),
    ]
    shape = ["b", 2, "s", 8]
    inputs = [helper.make_tensor_value_info(n, f, shape) for n in ("q", "k", "v")]
    inputs += [
        helper.make_tensor_value_info("mask", f, ["b", 1, "s", "s"]),
        helper.make_tensor_value_info("sink", f, ["b", 2, "s", 1]),
    ]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("out", f, None)], inits)
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_a_sink_column_that_is_no_constant_is_declined_with_what_computes_it() -> None:
    sites, declined = match_sites(_attention_with_sink_input().graph)
    assert not sites
    assert "sink computed by a graph input, not a constant per head" in declined[0].reason
