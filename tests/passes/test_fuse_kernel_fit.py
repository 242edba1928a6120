"""Attention the ORT kernels cannot take, refused at onnxscript's SDPA rule (``passes/fusion/_kernel_fit.py``), and
values narrower than their keys kept flat for MultiHeadAttention (``_mha_kv_layout``), issues 17/19.

Inkling 2's block attention residuals attend, at each token, over the stacked states of earlier layer blocks:
SDPA on ``[batch, sequence, blocks, hidden]``, its heads axis the input's sequence. onnxscript's SDPA rule fused it,
no later rule could give it a fixed ``num_heads``, and the whole candidate was refused ("ops outside stock ORT").
LeViT-like attention (values narrower than keys, 4-D) went through ``sdpa_via_mha`` and was then handed to
MultiHeadAttention as ``[B, N, T, H]`` keys and values of different widths, which ORT refuses at run time.
"""

from __future__ import annotations

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
