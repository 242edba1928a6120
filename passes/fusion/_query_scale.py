"""A query scaled per head dimension after its head split, scaled before it instead (fuse_transformer; issue 17,
TimesFM).

TimesFM learns a scale per head dimension for its queries, ``q * (softplus(s) * 1.44 / sqrt(d))``, applied to the
heads-first query ``Transpose(Reshape(x @ Wq + b, [B, S, H, D]), [0, 2, 1, 3])``. The attention rules take a scalar
scale only ("query_scale is not a scalar"), so no attention of the model fused. The product is elementwise over the
last axis, which the Reshape and the Transpose keep: ``x @ Wq + b`` times the vector tiled over the heads is the
same query with no Mul between the head split and ``q @ k^T``, which the rules read with a scale of 1::

    Mul(Transpose(Reshape(p, [B, S, H, D]), [0, 2, 1, 3]), c[1, 1, 1, D])
    ==>  Transpose(Reshape(Mul(p, tile(c, H)), [B, S, H, D]), [0, 2, 1, 3])

Moved only where the scaled query is what a scores MatMul multiplies (through a scalar Mul at most); a scale applied
after a rope (TimesFM 2.5's) is not moved: the rope mixes dimensions the scale tells apart.
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
        if mul.op_type != "Mul" or mul.domain not in _ONNX or len(mul.inputs) != 2:
            continue
        for side in (0, 1):
            heads, vector = mul.inputs[side], _vector(mul.inputs[1 - side])
            transpose = heads.producer() if heads is not None else None
            if vector is None or transpose is None or transpose.op_type != "Transpose":
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
            tiled = ir.Value(
                name=f"{mul.name or 'query'}/scale_per_channel",
                const_value=ir.tensor(np.tile(vector, width // vector.size)),
            )
            graph.register_initializer(tiled)
            scaled = ir.node("Mul", [flat, tiled], name=f"{mul.name or 'query'}/scaled_before_heads")
            scaled.outputs[0].dtype, scaled.outputs[0].shape = flat.dtype, flat.shape
            graph.insert_before(reshape, scaled)
            reshape.replace_input_with(0, scaled.outputs[0])
            ir.convenience.replace_all_uses_with(mul.outputs[0], heads)
            graph.remove(mul, safe=True)
            moved += 1
            break
    return moved
