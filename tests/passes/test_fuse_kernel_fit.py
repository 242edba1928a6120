"""Attention the ORT kernels cannot take, refused at onnxscript's SDPA rule (``passes/fusion/_kernel_fit.py``), and
values narrower than their keys kept flat for MultiHeadAttention (``_mha_kv_layout``), issues 17/19.

Inkling 2's block attention residuals attend, at each token, over the stacked states of earlier layer blocks:
SDPA on ``[batch, sequence, blocks, hidden]``, its heads axis the input's sequence. onnxscript's SDPA rule fused it,
no later rule could give it a fixed ``num_heads``, and the whole candidate was refused ("ops outside stock ORT").
LeViT-like attention (values narrower than keys, 4-D) went through ``sdpa_via_mha`` and was then handed to
MultiHeadAttention as ``[B, N, T, H]`` keys and values of different widths, which ORT refuses at run time.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

from passes._infra import op_histogram
from passes.fusion import _kernel_fit as kernel_fit
from passes.fusion import _onnxscript_adapter as adapter
from passes.fusion._layer_reasons import attention_by_design
from tests.numerics import assert_equivalent

F = TensorProto.FLOAT


def _attention(q_shape: list, k_shape: list, v_shape: list, *, heads_first: bool = True) -> onnx.ModelProto:
    """``Softmax(q @ k^T * 0.25) @ v`` over graph inputs (``heads_first``: the product's heads on axis 1)."""
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["out"]),
    ]
    inputs = [
        helper.make_tensor_value_info("q", F, q_shape),
        helper.make_tensor_value_info("k", F, k_shape),
        helper.make_tensor_value_info("v", F, v_shape),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        [helper.make_tensor_value_info("out", F, None)],
        [helper.make_tensor("scale", F, [], [0.25])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_attention_whose_heads_are_an_inputs_axis_is_left_unfused_with_its_reason() -> None:
    proto = _attention(["batch", "sequence", 3, 16], ["batch", "sequence", 3, 16], ["batch", "sequence", 3, 16])
    model = ir.serde.deserialize_model(proto)
    counts = adapter.fuse_for_ort(model)
    ops = op_histogram(model)
    assert not counts["sdpa"] and ops["Softmax"] == 1
    assert not any(op.split("::")[0] not in ("", "com.microsoft") for op in ops if "::" in op)
    (why,) = attention_by_design(model).values()
    assert "heads axis is the input's 'sequence' axis" in why
    shapes = [dict.fromkeys("qkv", (2, 5, 3, 16)), dict.fromkeys("qkv", (1, 9, 3, 16))]
    assert_equivalent(proto, model, shapes, rtol=0, atol=0)


def test_fixed_heads_still_fuse_and_a_decoders_narrower_values_are_refused_as_latent() -> None:
    shapes = (["batch", 2, "sequence", 16], ["batch", 2, "sequence", 16], ["batch", 2, "sequence", 8])
    model = ir.serde.deserialize_model(_attention(*shapes))
    assert adapter.fuse_for_ort(model)["sdpa"] == 1
    latent = ir.serde.deserialize_model(_attention(*shapes))
    assert adapter.fuse_for_ort(latent, latent_attention=False)["sdpa"] == 0
    (softmax,) = (n for n in latent.graph if n.op_type == "Softmax")
    assert kernel_fit.LATENT_SLOWER in (kernel_fit.marked(softmax) or "")


def test_values_narrower_than_keys_stay_flat_for_multi_head_attention_and_run_exactly() -> None:
    proto = _attention(["batch", 2, "sequence", 16], ["batch", 2, "sequence", 16], ["batch", 2, "sequence", 8])
    model = ir.serde.deserialize_model(proto)
    adapter.fuse_for_ort(model)
    (mha,) = (n for n in model.graph if n.op_type == "MultiHeadAttention")
    assert mha.inputs[1].shape.rank() == mha.inputs[2].shape.rank() == 3  # flat: ORT takes two widths so
    shapes = [{"q": (2, 2, 5, 16), "k": (2, 2, 5, 16), "v": (2, 2, 5, 8)}]
    shapes.append({"q": (1, 2, 11, 16), "k": (1, 2, 11, 16), "v": (1, 2, 11, 8)})
    assert_equivalent(proto, model, shapes, rtol=1e-5, atol=1e-5)


def _cross_attention_keys_sequence_first() -> onnx.ModelProto:
    """Cross attention whose keys, per-head halves joined on the last axis, stay ``[B, T, H, d]`` until
    ``Transpose(k, [0, 2, 3, 1])`` gives k^T, with as many keys as heads (T = H = 4: DAB-DETR's 2 x 2 image tokens),
    values ``[B, H, T, d]``."""
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal((16, 16)).astype(np.float32) / 4 for n in ("wq", "wk", "wv")}
    shapes = {"q4": [0, 0, 4, 4], "k4": [0, 0, 4, 4], "k_half": [0, 0, 4, 2], "halves": [8, 8], "out3": [0, 0, 16]}
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"]),
        helper.make_node("Reshape", ["q", "q4"], ["q_heads"]),
        helper.make_node("Transpose", ["q_heads"], ["qh"], perm=[0, 2, 1, 3]),
        # [B, T, H, d] from per-head content and position halves (DAB-DETR's), never transposed to heads first
        helper.make_node("MatMul", ["memory", "wk"], ["k"]),
        helper.make_node("Split", ["k", "halves"], ["k_content", "k_position"], axis=2),
        helper.make_node("Reshape", ["k_content", "k_half"], ["k_content_heads"]),
        helper.make_node("Reshape", ["k_position", "k_half"], ["k_position_heads"]),
        helper.make_node("Concat", ["k_content_heads", "k_position_heads"], ["k_heads"], axis=3),
        helper.make_node("Transpose", ["k_heads"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("MatMul", ["memory", "wv"], ["v"]),
        helper.make_node("Reshape", ["v", "k4"], ["v_heads"]),
        helper.make_node("Transpose", ["v_heads"], ["vh"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["qh", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "vh"], ["context"]),
        helper.make_node("Transpose", ["context"], ["merged"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["merged", "out3"], ["out"]),
    ]
    inits = [helper.make_tensor("scale", F, [], [0.5])]
    inits += [helper.make_tensor(n, F, list(w.shape), w.reshape(-1)) for n, w in weights.items()]
    inits += [helper.make_tensor(n, TensorProto.INT64, [len(v)], v) for n, v in shapes.items()]
    inputs = [
        helper.make_tensor_value_info("x", F, ["batch", "queries", 16]),
        helper.make_tensor_value_info("memory", F, ["batch", 4, 16]),
    ]
    graph = helper.make_graph(nodes, "cross", inputs, [helper.make_tensor_value_info("out", F, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_cross_attention_keys_sequence_first_fuse_right_when_as_many_as_the_heads() -> None:
    proto = _cross_attention_keys_sequence_first()
    model = ir.serde.deserialize_model(proto)
    ir.passes.common.ShapeInferencePass()(model)
    counts = adapter.fuse_for_ort(model, stop_before="mha")
    assert counts["sdpa_keys_heads_first"] == 1
    assert op_histogram(model)["com.microsoft::MultiHeadAttention"] == 1
    shapes = [{"x": (2, 3, 16), "memory": (2, 4, 16)}, {"x": (1, 7, 16), "memory": (1, 4, 16)}]
    assert_equivalent(proto, model, shapes, rtol=1e-5, atol=1e-5)
