"""A query scaled per head dimension after its head split, scaled before it instead (fuse_transformer; issue 17,
TimesFM).

TimesFM learns a scale per head dimension for its queries, ``q * (softplus(s) * 1.44 / sqrt(d))``, applied to the
heads-first query ``Transpose(Reshape(x @ Wq + b, [B, S, H, D]), [0, 2, 1, 3])``. The attention rules take a scalar
scale only ("query_scale is not a scalar"), so no attention of the model fused. The product is elementwise over the
last axis, which the Reshape and the Transpose keep: ``x @ Wq + b`` times the vector tiled over the heads is the
same query with no Mul between the head split and ``q @ k^T``, which the rules read with a scale of 1::

    Mul(Transpose(Reshape(p, [B, S, H, D]), [0, 2, 1, 3]), c[1, 1, 1, D])
    ==>  Transpose(Reshape(Mul(p, tile(c, H)), [B, S, H, D]), [0, 2, 1, 3])

Moved only where the scaled query is what a scores MatMul multiplies (through a scalar Mul at most).

A scale applied after a rope and a norm (TimesFM 2.5's ``q_norm(rope(q)) * c``) cannot go before the head split: the
rope mixes the dimensions the scale tells apart. It goes to the keys instead: the scores are sums over the head
dimension, ``sum_d q_d c_d k_d``, the same with ``c`` on either operand (``move_head_dim_scales_to_keys``). The key
is scaled where its head dimension is still the last axis, before the Transpose that puts it second to last for
the product (``Transpose(k, [0, 1, 3, 2])``, or dynamo's ``Reshape(Transpose(k3, [0, 2, 1]))``)::

    MatMul(Mul(q, c[1, 1, 1, D]) [* a], [b *] ... Transpose(k) ...)
    ==>  MatMul(q [* a], [b *] ... Transpose(Mul(k, c[D])) ...)

Only where each value on both paths is read by the next step alone, so neither the query nor the key (a cache's
present output, say) changes for any other reader.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.fusion._rotary_eval import const, scalar

_ONNX = ("", "ai.onnx")


def _vector(value: ir.Value | None) -> np.ndarray | None:
    """A constant of shape [..., D] (every axis before the last of size 1, D > 1), flattened; else None."""
    array = const(value)
    if array is None or not 0 < array.ndim <= 4 or array.shape[-1] < 2 or any(d != 1 for d in array.shape[:-1]):
        return None
    return array.reshape(-1)


def _vector_operands(mul: ir.Node) -> list[tuple[ir.Value, np.ndarray]]:
    """Each (operand, vector) reading of an ONNX ``Mul`` of two inputs whose other input is a ``_vector``."""
    if mul.op_type != "Mul" or mul.domain not in _ONNX or len(mul.inputs) != 2:
        return []
    readings = ((mul.inputs[side], _vector(mul.inputs[1 - side])) for side in (0, 1))
    return [(operand, vector) for operand, vector in readings if operand is not None and vector is not None]


def _reaches_scores(value: ir.Value) -> bool:
    """``value`` is the first operand of a MatMul, directly or through one Mul by a scalar constant."""
    for use in value.uses():
        node = use.node
        if node.domain not in _ONNX:
            continue
        if node.op_type == "MatMul" and use.idx == 0:
            return True
        if node.op_type == "Mul" and scalar(node.inputs[1 - use.idx]) is not None:
            return any(u.node.op_type == "MatMul" and u.idx == 0 for u in node.outputs[0].uses())
    return False


def move_head_dim_scales(model: ir.Model) -> int:
    """Each per-head-dimension query scale moved before the head split (module docstring); returns how many."""
    graph = model.graph
    moved = 0
    for mul in list(graph):
        for heads, vector in _vector_operands(mul):
            transpose = heads.producer()
            if transpose is None or transpose.op_type != "Transpose":
                continue
            if list(transpose.attributes.get_ints("perm", [])) != [0, 2, 1, 3] or len(list(heads.uses())) != 1:
                continue
            reshape = transpose.inputs[0].producer() if transpose.inputs[0] is not None else None
            if reshape is None or reshape.op_type != "Reshape" or len(list(reshape.outputs[0].uses())) != 1:
                continue
            flat = reshape.inputs[0]
            width = flat.shape[-1] if flat is not None and flat.shape is not None and flat.shape.rank() == 3 else None
            if not isinstance(width, int) or width % vector.size or not _reaches_scores(mul.outputs[0]):
                continue
            if flat.dtype is not None and flat.dtype.numpy() != vector.dtype:  # type: ignore[union-attr]
                continue
            _move(graph, mul, heads, reshape, scale=np.tile(vector, width // vector.size), what="scaled_before_heads")
            moved += 1
            break
    return moved


def _move(graph: ir.Graph, mul: ir.Node, unscaled: ir.Value, at: ir.Node, *, scale: np.ndarray, what: str) -> None:
    """``at``'s data input times ``scale`` (a Mul inserted before ``at``), and ``mul``'s readers given ``unscaled``."""
    operand = at.inputs[0]
    assert operand is not None  # the callers read its shape and type
    name = mul.name or "query"
    constant = ir.Value(name=f"{name}/{what}_scale", const_value=ir.tensor(scale))
    graph.register_initializer(constant)
    scaled = ir.node("Mul", [operand, constant], name=f"{name}/{what}")
    scaled.outputs[0].dtype, scaled.outputs[0].shape = operand.dtype, operand.shape
    graph.insert_before(at, scaled)
    at.replace_input_with(0, scaled.outputs[0])
    ir.convenience.replace_all_uses_with(mul.outputs[0], unscaled)
    graph.remove(mul, safe=True)


def _single(value: ir.Value) -> ir.Node | None:
    """The one node reading ``value``, when it is also no graph output (a present cache, say)."""
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 and not value.is_graph_output() else None


def _scalar_mul_operand(node: ir.Node | None) -> ir.Value | None:
    """The non-scalar operand of ``Mul(x, scalar)`` (either order), else None."""
    if node is None or node.op_type != "Mul" or node.domain not in _ONNX or len(node.inputs) != 2:
        return None
    for side in (0, 1):
        if scalar(node.inputs[1 - side]) is not None:
            return node.inputs[side]
    return None


def _key_transpose(value: ir.Value | None) -> ir.Node | None:
    """The Transpose under a scores MatMul's key operand (through a scalar Mul and Reshapes, each read once) that
    moves its input's last axis to the second to last: its input still has the head dimension last."""
    for _ in range(4):
        node = value.producer() if value is not None else None
        if node is None or node.domain not in _ONNX or _single(node.outputs[0]) is None:
            return None
        if node.op_type == "Transpose":
            perm = list(node.attributes.get_ints("perm", []))
            return node if len(perm) >= 2 and perm[-2] == len(perm) - 1 else None
        value = node.inputs[0] if node.op_type == "Reshape" else _scalar_mul_operand(node)
    return None


def move_head_dim_scales_to_keys(model: ir.Model) -> int:
    """Each per-head-dimension query scale left after ``move_head_dim_scales`` moved onto the keys (module
    docstring); returns how many."""
    graph = model.graph
    moved = 0
    for mul in list(graph):
        for query, vector in _vector_operands(mul):
            if query.shape is None or query.shape.rank() != 4:
                continue
            if query.shape[-1] != vector.size:
                continue
            via, reader = mul.outputs[0], _single(mul.outputs[0])
            if reader is not None and _scalar_mul_operand(reader) is via:  # the attention's own scalar scale
                via, reader = reader.outputs[0], _single(reader.outputs[0])
            if reader is None or reader.op_type != "MatMul" or reader.domain not in _ONNX:
                continue
            if reader.inputs[0] is not via:
                continue
            transpose = _key_transpose(reader.inputs[1])
            key = transpose.inputs[0] if transpose is not None else None
            if key is None or key.dtype is None or key.dtype.numpy() != vector.dtype:
                continue
            if key.shape is None or key.shape[-1] != vector.size:  # the head dimension, last
                continue
            _move(graph, mul, query, transpose, scale=vector, what="keys_scaled")  # type: ignore[arg-type]
            moved += 1
            break
    return moved
