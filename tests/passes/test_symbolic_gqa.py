"""passes.fusion._symbolic_gqa: ORT's symbolic shape inference with GroupQueryAttention's presents typed when
the op has no past (fuse_gqa's form for a decoder without a cache), so the inference fuse_transformer runs
(``_symbolic_shapes.infer``) reaches the layers after the first attention. The shapes it claims are the ones
ORT's kernel gives at run time; with a past it is ORT's inference unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from passes.fusion import _symbolic_shapes
from passes.fusion._symbolic_gqa import infer_shapes

HEADS, KV_HEADS, HEAD = 4, 2, 8


def _gqa_model(past: bool) -> onnx.ModelProto:
    """q, k, v [B, S, .] -> GroupQueryAttention (no rotary) -> Reshape [0, 0, HEADS, HEAD] -> Mul: a layer's
    attention and what reads it, with an empty past or a past input."""
    cache = ["batch", KV_HEADS, "past", HEAD]
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, ["batch", "seq", HEADS * HEAD]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, ["batch", "seq", KV_HEADS * HEAD]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, ["batch", "seq", KV_HEADS * HEAD]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]
    if past:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in ("past_key", "past_value")]
    gqa = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "past_key" if past else "", "past_value" if past else "", "seqlens_k", "total_sequence_length"],
        ["attn", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
    )
    shape = helper.make_tensor("heads", TensorProto.INT64, [4], [0, 0, HEADS, HEAD])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    nodes = [
        gqa,
        helper.make_node("Reshape", ["attn", "heads"], ["split"]),
        helper.make_node("Mul", ["split", "two"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "present_key", "present_value")]
    graph = helper.make_graph(nodes, "gqa", inputs, outputs, [shape, two])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _dims(proto: onnx.ModelProto, name: str) -> list[int | str]:
    values = {v.name: v for v in [*proto.graph.value_info, *proto.graph.output]}
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in values[name].type.tensor_type.shape.dim]


def test_presents_without_a_past_are_typed_so_the_inference_completes_when_gqa_has_no_past(tmp_path, monkeypatch):
    # setup: ORT's own inference stops at the untyped presents (the refusal this module exists for)
    from onnxruntime.transformers.shape_infer_helper import SymbolicShapeInference

    model = _gqa_model(past=False)
    monkeypatch.chdir(tmp_path)  # ORT saves its partial result into the working directory when it gives up
    with pytest.raises(Exception, match="Incomplete symbolic shape inference"):
        SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    # execute
    inferred = infer_shapes(model)
    # assert: [batch, kv heads, a fresh length, head size], and what follows the attention is typed
    key, value = _dims(inferred, "present_key"), _dims(inferred, "present_value")
    assert key[:2] == value[:2] == ["batch", KV_HEADS] and key[3] == value[3] == HEAD
    assert isinstance(key[2], str) and key[2] not in ("batch", "seq") and key[2] != value[2]
    assert _dims(inferred, "y") == ["batch", "seq", HEADS, HEAD]
    report: dict[str, object] = {}
    _symbolic_shapes.infer(model, report)
    assert report["symbolic_shapes"] == "applied"


@pytest.mark.parametrize(("batch", "seq"), [(1, 5), (2, 3)])
def test_the_claimed_present_shape_is_the_kernels_when_run_without_a_past(batch, seq):
    # setup
    model = _gqa_model(past=False)
    inferred = infer_shapes(model)
    rng = np.random.default_rng(batch * 10 + seq)
    feeds = {
        "q": rng.standard_normal((batch, seq, HEADS * HEAD), np.float32),
        "k": rng.standard_normal((batch, seq, KV_HEADS * HEAD), np.float32),
        "v": rng.standard_normal((batch, seq, KV_HEADS * HEAD), np.float32),
        "seqlens_k": np.full((batch,), seq - 1, np.int32),
        "total_sequence_length": np.array(seq, np.int32),
    }
    # execute
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, present_key, present_value = session.run(["y", "present_key", "present_value"], feeds)
    # assert: every static dim the inference claims holds, and the kernel's present is the keys themselves
    for name, got in (("present_key", present_key), ("present_value", present_value), ("y", y)):
        claimed = _dims(inferred, name)
        assert len(claimed) == got.ndim, name
        assert all(isinstance(c, str) or c == g for c, g in zip(claimed, got.shape, strict=True)), (name, claimed)
    assert present_key.shape == (batch, KV_HEADS, seq, HEAD)
    np.testing.assert_array_equal(present_key, feeds["k"].reshape(batch, seq, KV_HEADS, HEAD).transpose(0, 2, 1, 3))


def test_with_a_past_the_inference_is_orts_when_gqa_reads_a_cache(tmp_path, monkeypatch):
    # setup
    from onnxruntime.transformers.shape_infer_helper import SymbolicShapeInference

    model = _gqa_model(past=True)
    monkeypatch.chdir(tmp_path)
    # execute
    theirs, ours = SymbolicShapeInference.infer_shapes(model, auto_merge=True), infer_shapes(model)
    # assert
    for name in ("present_key", "present_value", "y"):
        assert _dims(ours, name) == _dims(theirs, name), name
    assert _dims(ours, "present_key") == ["batch", KV_HEADS, "past", HEAD]
