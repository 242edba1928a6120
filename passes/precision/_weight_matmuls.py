"""Weight products in the one form ORT's quantizers read: a ``MatMul`` with a constant 2-D weight.

``MatMulNBitsQuantizer`` and ``quantize_dynamic`` take ``MatMul`` only, and two other forms hold weights:

* ``Gemm(A, B, C)`` (alpha = beta = 1, no transA): the TorchScript and dynamo exports of GPT-2's Conv1D layers
  and of ``nn.Linear`` on 2-D inputs. Left so, a GPT-2 keeps every projection float.
* ``com.microsoft::FusedMatMul(x, W, alpha, transB)`` (no transA, no batch transposes), written by onnxscript's
  ORT fusions (``fuse_transformer``): a tied LM head ``MatMul(x, Transpose(embedding))`` becomes one with
  ``transB`` (folding the Transpose would copy the table), and a head's scalar scale folds in as ``alpha``
  (Gemma's logit soft-capping, ``tanh(logits / cap) * cap``). Left so, the head is found by no one: not kept
  float or made 8-bit by rule, not judged by its greedy tokens.

Each becomes ``MatMul(A, W)`` then ``Add(C)`` or ``Mul(alpha)``; a transposed weight is stored transposed (a
copy: quantize_dynamic keeps its own int8 one anyway; quantize_int4 leaves those fused, its head policy keeps a
tied head float, reading the table it shares). The ``MatMul`` takes the node's name, so
``nodes_to_exclude``, pins by name and the report's node names still apply; a graph output keeps its name.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes._match import take_graph_output

_MS = "com.microsoft"


def _weight(node: ir.Node) -> ir.Value | None:
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    if weight is None or weight.const_value is None or len(weight.const_value.shape) != 2:
        return None
    return weight


_OP_TYPES = ("Gemm", "FusedMatMul")


def sites(model: ir.Model, op_types: tuple[str, ...] = _OP_TYPES, *, transposed: bool = True) -> list[ir.Node]:
    """The nodes of ``op_types`` (Gemm, FusedMatMul) in the main graph that ``unfuse`` writes back as MatMul;
    without ``transposed``, none whose weight is read transposed (``transB``): a tied head's FusedMatMul reads
    the token table itself, and unfused it would store a transposed copy beside it."""
    found = []
    for node in model.graph:
        if node.op_type not in op_types or _weight(node) is None:
            continue
        attrs = node.attributes
        if node.op_type == "Gemm" and node.domain in ("", "ai.onnx"):
            if (
                not node.name  # the quantizers know a Gemm's MatMul by the Gemm's name
                or attrs.get_int("transA", 0)
                or attrs.get_float("alpha", 1.0) != 1.0
                or attrs.get_float("beta", 1.0) != 1.0
            ):
                continue
        elif node.op_type == "FusedMatMul" and node.domain == _MS and len(node.inputs) == 2:
            if any(attrs.get_int(flag, 0) for flag in ("transA", "transBatchA", "transBatchB")):
                continue
        else:
            continue
        if not transposed and attrs.get_int("transB", 0):
            continue
        found.append(node)
    return found


def unfuse(model: ir.Model, op_types: tuple[str, ...] = _OP_TYPES, *, transposed: bool = True) -> dict[str, int]:
    """Rewrite every site of ``op_types`` (``sites``) in place; how many of each op type."""
    counts: dict[str, int] = {}
    for node in sites(model, op_types, transposed=transposed):
        x, weight = node.inputs[0], _weight(node)
        assert weight is not None
        name = node.name or f"{weight.name}_matmul"  # an unnamed FusedMatMul's, named after its weight
        if node.attributes.get_int("transB", 0):
            tensor = ir.tensor(weight.const_value.numpy().T.copy(), name=f"{weight.name}_transposed_for_{name}")
            weight = ir.Value(
                name=tensor.name, const_value=tensor, shape=tensor.shape, type=ir.TensorType(tensor.dtype)
            )
            model.graph.register_initializer(weight)
        node.name = f"{name}_unfused"
        matmul = ir.node("MatMul", [x, weight], name=name)
        new = [matmul]
        out = matmul.outputs[0]
        bias = node.inputs[2] if node.op_type == "Gemm" and len(node.inputs) > 2 else None
        alpha = node.attributes.get_float("alpha", 1.0) if node.op_type == "FusedMatMul" else 1.0
        if bias is not None:
            new.append(ir.node("Add", [out, bias], name=f"{name}_bias"))
        elif alpha != 1.0:
            dtype = weight.const_value.numpy().dtype
            scale = ir.Value(name=f"{name}_alpha", const_value=ir.tensor(np.array(alpha, dtype)))
            scale.type, scale.shape = ir.TensorType(ir.DataType.from_numpy(dtype)), ir.Shape([])
            model.graph.register_initializer(scale)
            new.append(ir.node("Mul", [out, scale], name=f"{name}_alpha"))
        old = node.outputs[0]
        result = new[-1].outputs[0]
        result.shape, result.type = old.shape, old.type
        model.graph.insert_before(node, new)
        take_graph_output(model.graph, old, result, "_unfused")
        ir.convenience.replace_all_uses_with(old, result)
        model.graph.remove(node, safe=True)
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts
