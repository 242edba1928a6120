"""pack_matmuls on the decoder corpus (tests/models/decoders): structure (q/k/v and gate/up each one MatMul per
layer, no activation read by two constant-weight MatMuls; Phi-3's export, packed already, left alone) and
numerics against the original under ORT with graph optimizations off, at batch/prompt/cache sizes other than
the export's, on a growing cache fed back from the packed model's own presents, alone and after fuse_rotary +
fuse_gqa as the int4 preset runs it."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_gqa import FuseGqa
from passes.fusion.fuse_rotary import FuseRotary
from passes.fusion.pack_matmuls import PackMatmuls
from tests.models.build_decoders import OUT, Signature, decoder_feeds, presents_as_past

MANIFEST = json.loads((OUT / "manifest.json").read_text())
# (batch, new tokens, past): none of them the export's (2, 3, 4)
SHAPES = ((2, 5, 0), (1, 11, 0), (3, 1, 7), (1, 4, 9), (1, 1, 33))
ATOL = 1e-4


def _session(model: ir.Model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    proto = ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])


def _run(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def _weight_readers(model: ir.Model) -> Counter:
    """How many constant-weight MatMuls read each activation."""
    readers: Counter = Counter()
    for node in model.graph:
        if node.op_type == "MatMul" and node.inputs[1] is not None and node.inputs[1].const_value is not None:
            readers[id(node.inputs[0])] += 1
    return readers


def _assert_exact(original: ir.Model, packed: ir.Model, name: str) -> None:
    signature = Signature.of(OUT / f"{name}.onnx")
    ref, new = _session(original), _session(packed)
    for index, (batch, seq, past) in enumerate(SHAPES):
        feeds = decoder_feeds(signature, batch, seq, past, seed=index)
        want, got = _run(ref, feeds), _run(new, feeds)
        assert want.keys() == got.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=ATOL, rtol=0, err_msg=f"{key} at {batch, seq, past}")
    # a cache grown by the packed model's own presents, compared step by step
    out_ref = _run(ref, decoder_feeds(signature, 1, 6, 0, seed=9))
    out_new = _run(new, decoder_feeds(signature, 1, 6, 0, seed=9))
    for step in range(4):
        token = np.array([[int(out_new["logits"][0, -1].argmax())]], np.int64)
        feeds_ref = decoder_feeds(signature, 1, 1, 6 + step, tokens=token, past_values=presents_as_past(out_ref))
        feeds_new = decoder_feeds(signature, 1, 1, 6 + step, tokens=token, past_values=presents_as_past(out_new))
        out_ref, out_new = _run(ref, feeds_ref), _run(new, feeds_new)
        for key in out_ref:
            np.testing.assert_allclose(out_new[key], out_ref[key], atol=ATOL, rtol=0, err_msg=f"{key} step {step}")


@pytest.mark.parametrize("name", ["llama_past_ts", "qwen2_past_dynamo", "mistral_past_ts", "llama_past_dynamo"])
def test_pack_matmuls_makes_one_matmul_per_qkv_and_gate_up_and_stays_exact_when_decoder(name):
    # setup
    layers = MANIFEST["families"][name.split("_")[0]]["layers"]
    original = ir.load(OUT / f"{name}.onnx")
    model = ir.load(OUT / f"{name}.onnx")
    assert max(_weight_readers(model).values()) == 3  # q/k/v read the normed hidden state
    # execute
    result = PackMatmuls()(model, PassContext())
    # assert: per layer q/k/v -> one, gate/up -> one
    assert result.modified and result.model is model
    assert result.counts["groups_packed"] == 2 * layers
    assert result.counts["matmuls_after"] == result.counts["matmuls_before"] - 3 * layers
    assert set(_weight_readers(model).values()) == {1}
    assert op_histogram(model)["Split"] >= 2 * layers
    assert [v.name for v in model.graph.outputs] == [v.name for v in original.graph.outputs]
    _assert_exact(original, model, name)


def test_pack_matmuls_exact_after_fuse_rotary_and_fuse_gqa_when_decoder():
    # setup: the int4 preset's order
    name = "mistral_past_ts"
    layers = MANIFEST["families"]["mistral"]["layers"]
    original = ir.load(OUT / f"{name}.onnx")
    model = ir.load(OUT / f"{name}.onnx")
    model = FuseRotary()(model, PassContext()).model
    model = FuseGqa()(model, PassContext()).model
    # execute
    result = PackMatmuls()(model, PassContext())
    # assert
    assert op_histogram(model)["com.microsoft::GroupQueryAttention"] == layers
    assert result.counts["groups_packed"] == 2 * layers
    assert set(_weight_readers(model).values()) == {1}
    _assert_exact(original, model, name)


def test_pack_matmuls_leaves_model_alone_when_projections_already_packed():
    # setup: Phi-3 exports qkv_proj and gate_up_proj as one MatMul each
    model = ir.load(OUT / "phi3_past_ts.onnx")
    before = op_histogram(model)
    # execute
    result = PackMatmuls()(model, PassContext())
    # assert
    assert not result.modified and result.counts["groups_packed"] == 0
    assert op_histogram(model) == before
    assert "skipped" in result.notes["decision"]
