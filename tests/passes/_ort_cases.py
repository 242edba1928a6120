"""ORT's compute-optimizer test graphs, rebuilt with ``onnx.helper`` for ``test_upstream_slice.py``.

Source: ``onnxruntime/test/optimizer/compute_optimizer_test.cc`` and its ``testdata/transform/
computation_reduction/`` models. The ``.onnx`` files are not vendored; each builder recreates the graph
the C++ test describes, with smaller hidden sizes so a numeric check takes milliseconds. Like ORT's tests,
an Identity follows every slice that would otherwise be a graph output (ORT never moves such a slice).
Batch and sequence dims are symbolic where ORT's are, so the numeric checks also run at other sizes.

Every builder returns a shape-inferred ``onnx.ModelProto``; node names follow ORT's (``m1``, ``a1``...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
Shape = Sequence[int | str]


def build(
    nodes: list[onnx.NodeProto],
    inputs: Mapping[str, tuple[int, Shape]],
    outputs: Mapping[str, int],
    inits: Mapping[str, np.ndarray] | None = None,
    opset: int = 17,
) -> onnx.ModelProto:
    """A checked, shape-inferred model; ``inputs`` maps name -> (element type, shape)."""
    graph = helper.make_graph(
        nodes,
        "case",
        [helper.make_tensor_value_info(n, t, list(s)) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs.items()],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in (inits or {}).items()],
    )
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    onnx.checker.check_model(model)
    return model


def weights(*shape: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 0.2).astype(np.float32)


def node(op: str, inputs: list[str], output: str, name: str, **attrs) -> onnx.NodeProto:
    domain = attrs.pop("domain", "")
    return helper.make_node(op, inputs, [output], name=name, domain=domain, **attrs)


# --- GatherND_{Gelu,Add,LayerNormalization,MatMul}: input [B,S,H] -> op -> GatherND -> Identity --------


def gathernd(op: str, hidden: int = 32) -> onnx.ModelProto:
    """``op`` on ``input`` [B,S,H], then GatherND(batch_dims=1) with positions [B,P,1] (ORT's gathernd_*)."""
    inits: dict[str, np.ndarray] = {}
    opset = 17
    if op == "Gelu":
        op_node, opset = node("Gelu", ["input"], "op_out", "gelu"), 20  # ONNX Gelu, opset 20
    elif op == "Add":
        op_node = node("Add", ["input", "bias"], "op_out", "add")
        inits["bias"] = weights(hidden)
    elif op == "LayerNormalization":
        op_node = node("LayerNormalization", ["input", "scale", "beta"], "op_out", "layer_norm", axis=-1)
        inits |= {"scale": weights(hidden, seed=1) + 1, "beta": weights(hidden, seed=2)}
    else:
        op_node = node("MatMul", ["input", "weight"], "op_out", "matmul")
        inits["weight"] = weights(hidden, 16)
    nodes = [
        op_node,
        node("GatherND", ["op_out", "positions"], "gathered", "gathernd", batch_dims=1),
        node("Identity", ["gathered"], "output", "identity"),
    ]
    inputs = {"input": (F, ["batch", "seq", hidden]), "positions": (I64, ["batch", 3, 1])}
    return build(nodes, inputs, {"output": F}, inits, opset)


# --- GatherMatMul: input1 [8,16,H] x input2 [8,H,16] -> m1 -> Gather(axis) -> Identity -------------


def gather_matmul(axis: int, scalar: bool, hidden: int = 64) -> onnx.ModelProto:
    """ORT's GatherMatMul_{Scalar,}SlicingOn{BatchDim (0), SecondLastDim (1), LastDim (2)}."""
    nodes = [
        node("MatMul", ["input1", "input2"], "m1_out", "m1"),
        node("Gather", ["m1_out", "indices"], "g_out", "g1", axis=axis),
        node("Identity", ["g_out"], "output", "identity"),
    ]
    indices = np.array(3, np.int64) if scalar else np.array([0, 5], np.int64)
    inputs = {"input1": (F, [8, 16, hidden]), "input2": (F, [8, hidden, 16])}
    return build(nodes, inputs, {"output": F}, {"indices": indices})


# --- GatherLayerNormalization / GatherSoftmax ---------------------------------------------------------


def gather_layer_norm(ln_axis: int, scalar: bool) -> onnx.ModelProto:
    """[2,32,64] -> LayerNormalization(ln_axis) -> Gather(axis 1, index 0 or [0]) -> Identity."""
    norm_shape = [2, 32, 64][ln_axis:] if ln_axis >= 0 else [2, 32, 64][3 + ln_axis :]
    nodes = [
        node("LayerNormalization", ["input", "scale", "bias"], "ln_out", "ln", axis=ln_axis),
        node("Gather", ["ln_out", "indices"], "g_out", "g1", axis=1),
        node("Identity", ["g_out"], "output", "identity"),
    ]
    inits = {
        "scale": weights(*norm_shape, seed=1) + 1,
        "bias": weights(*norm_shape, seed=2),
        "indices": np.array(0 if scalar else [0], np.int64),
    }
    return build(nodes, {"input": (F, [2, 32, 64])}, {"output": F}, inits)


def gather_softmax(softmax_axis: int, scalar: bool) -> onnx.ModelProto:
    """[2,4,32,64] -> Softmax(softmax_axis) -> Gather(axis 1, index 0 or [0]) -> Identity."""
    nodes = [
        node("Softmax", ["input"], "sm_out", "softmax", axis=softmax_axis),
        node("Gather", ["sm_out", "indices"], "g_out", "g1", axis=1),
        node("Identity", ["g_out"], "output", "identity"),
    ]
    inits = {"indices": np.array(0 if scalar else [0], np.int64)}
    return build(nodes, {"input": (F, [2, 4, 32, 64])}, {"output": F}, inits)


# --- GatherReshape: [B,S,H] -> Reshape(shape) -> [B,S,heads,64] -> Gather(axis) -> Identity ---------


def gather_reshape(axis: int, indices: np.ndarray, shape: Sequence[int], seq: int | str = "seq") -> onnx.ModelProto:
    """ORT's GatherReshape_*: the Reshape splits H into heads; the Gather slices batch or seq."""
    hidden = int(np.prod(shape[2:]))
    nodes = [
        node("Reshape", ["input", "shape"], "r_out", "reshape"),
        node("Gather", ["r_out", "indices"], "g_out", "g1", axis=axis),
        node("Identity", ["g_out"], "output", "identity"),
    ]
    inits = {"shape": np.array(shape, np.int64), "indices": indices}
    return build(nodes, {"input": (F, ["batch", seq, hidden])}, {"output": F}, inits)


# --- ShrunkenGather / Slice on two branches, SliceTranspose ------------------------------------------


def shrunken_gather_two_branches() -> onnx.ModelProto:
    """Add(int64 [4,32,64] x 2) -> Gather(axis 1, Squeeze(NonZero(keep))) -> Identity."""
    nodes = [
        node("Add", ["a", "b"], "sum", "add"),
        node("NonZero", ["keep"], "nz", "nonzero"),
        node("Squeeze", ["nz", "zero"], "idx", "squeeze"),
        node("Gather", ["sum", "idx"], "g_out", "shrunken_gather", axis=1),
        node("Identity", ["g_out"], "output", "identity"),
    ]
    inputs = {"a": (I64, [4, 32, 64]), "b": (I64, [4, 32, 64]), "keep": (BOOL, [32])}
    return build(nodes, inputs, {"output": I64}, {"zero": np.array([0], np.int64)})


def slice_two_branches(data_shape: Sequence[int], axes: Sequence[int] | None, steps: bool) -> onnx.ModelProto:
    """Add(a, b) -> Slice(starts [0], ends [-1], axes, steps) -> Identity; ``axes`` None = omitted."""
    inits: dict[str, np.ndarray] = {"starts": np.array([0], np.int64), "ends": np.array([-1], np.int64)}
    slice_inputs = ["sum", "starts", "ends"]
    if axes is not None or steps:
        slice_inputs.append("axes" if axes is not None else "")
        if axes is not None:
            inits["axes"] = np.array(axes, np.int64)
    if steps:
        slice_inputs.append("steps")
        inits["steps"] = np.array([1], np.int64)
    nodes = [
        node("Add", ["a", "b"], "sum", "add"),
        node("Slice", slice_inputs, "s_out", "slice"),
        node("Identity", ["s_out"], "output", "identity"),
    ]
    inputs = {"a": (F, list(data_shape)), "b": (F, list(data_shape))}
    return build(nodes, inputs, {"output": F}, inits)


def slice_transpose(axes: Sequence[int] = (1,)) -> onnx.ModelProto:
    """[2,4,32,64] -> Transpose(0,2,1,3) -> Slice(axis 1, 0:-1) -> Identity (ORT's SliceTranspose)."""
    nodes = [
        node("Transpose", ["input"], "t_out", "transpose", perm=[0, 2, 1, 3]),
        node("Slice", ["t_out", "starts", "ends", "axes"], "s_out", "slice"),
        node("Identity", ["s_out"], "output", "identity"),
    ]
    n = len(axes)
    inits = {"starts": np.zeros(n, np.int64), "ends": np.full(n, -1, np.int64), "axes": np.array(axes, np.int64)}
    return build(nodes, {"input": (F, [2, 4, 32, 64])}, {"output": F}, inits)


# --- RoBERTa-like classification: 2-layer encoder, then features[:, 0, :] -> dense -> tanh -> out_proj -


def roberta_classifier(hidden: int = 32, heads: int = 4, ffn: int = 64, labels: int = 3) -> onnx.ModelProto:
    """A small RoBERTa encoder (post-LN, ONNX Gelu via Erf-free opset 20) and its classification head."""
    head_dim = hidden // heads
    inits: dict[str, np.ndarray] = {
        "split_shape": np.array([0, 0, heads, head_dim], np.int64),
        "merge_shape": np.array([0, 0, hidden], np.int64),
        "scale": np.array(np.sqrt(head_dim), np.float32),
        "cls": np.array(0, np.int64),
    }
    nodes: list[onnx.NodeProto] = []
    seed = iter(range(1000))

    def dense(x: str, name: str, n_in: int, n_out: int) -> str:
        inits[f"{name}.w"] = weights(n_in, n_out, seed=next(seed))
        inits[f"{name}.b"] = weights(n_out, seed=next(seed))
        nodes.append(node("MatMul", [x, f"{name}.w"], f"{name}.mm", f"{name}/matmul"))
        nodes.append(node("Add", [f"{name}.mm", f"{name}.b"], f"{name}.out", f"{name}/add"))
        return f"{name}.out"

    def layer_norm(x: str, name: str) -> str:
        inits[f"{name}.g"] = weights(hidden, seed=next(seed)) + 1
        inits[f"{name}.beta"] = weights(hidden, seed=next(seed))
        nodes.append(node("LayerNormalization", [x, f"{name}.g", f"{name}.beta"], f"{name}.out", name, axis=-1))
        return f"{name}.out"

    def op(kind: str, inputs: list[str], name: str, **attrs) -> str:
        nodes.append(node(kind, inputs, f"{name}.out", name, **attrs))
        return f"{name}.out"

    x = "embeddings"
    for i in range(2):
        p = f"layer{i}"
        q = op(
            "Transpose",
            [op("Reshape", [dense(x, f"{p}.q", hidden, hidden), "split_shape"], f"{p}/q_split")],
            f"{p}/q_t",
            perm=[0, 2, 1, 3],
        )
        k = op(
            "Transpose",
            [op("Reshape", [dense(x, f"{p}.k", hidden, hidden), "split_shape"], f"{p}/k_split")],
            f"{p}/k_t",
            perm=[0, 2, 3, 1],
        )
        v = op(
            "Transpose",
            [op("Reshape", [dense(x, f"{p}.v", hidden, hidden), "split_shape"], f"{p}/v_split")],
            f"{p}/v_t",
            perm=[0, 2, 1, 3],
        )
        scores = op(
            "Add", [op("Div", [op("MatMul", [q, k], f"{p}/qk"), "scale"], f"{p}/scaled"), "mask"], f"{p}/masked"
        )
        ctx = op("MatMul", [op("Softmax", [scores], f"{p}/probs", axis=-1), v], f"{p}/ctx")
        merged = op("Reshape", [op("Transpose", [ctx], f"{p}/ctx_t", perm=[0, 2, 1, 3]), "merge_shape"], f"{p}/merge")
        attn = layer_norm(op("Add", [dense(merged, f"{p}.o", hidden, hidden), x], f"{p}/attn_residual"), f"{p}/ln1")
        inner = op("Gelu", [dense(attn, f"{p}.ffn_in", hidden, ffn)], f"{p}/gelu")
        x = layer_norm(op("Add", [dense(inner, f"{p}.ffn_out", ffn, hidden), attn], f"{p}/ffn_residual"), f"{p}/ln2")
    cls = op("Gather", [x, "cls"], "head/cls", axis=1)  # features[:, 0, :]
    pooled = op("Tanh", [dense(cls, "head.dense", hidden, hidden)], "head/tanh")
    nodes.append(node("Identity", [dense(pooled, "head.out_proj", hidden, labels)], "logits", "head/identity"))
    inputs = {"embeddings": (F, ["batch", "seq", hidden]), "mask": (F, ["batch", 1, 1, "seq"])}
    return build(nodes, inputs, {"logits": F}, inits, opset=20)
