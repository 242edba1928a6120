"""The head count of a rotation whose input is ``[batch, heads, sequence, head_size]`` (BNSH), from the graph.

ORT's ``RotaryEmbedding`` kernel refuses, when it is built, a node that gives ``rotary_embedding_dim`` without
``num_heads`` ("num_heads must be provided if rotary_embedding_dim is specified"), though on a 4-D input it takes
the heads from the input's shape. onnxscript's ``partial_rotary_embedding`` rule turns ``Concat(RotaryEmbedding(
x[..., :d]), x[..., d:])`` into ``RotaryEmbedding(x, rotary_embedding_dim=d)`` with the inner node's attributes,
and a full rotation of a 4-D slice needs no ``num_heads``: on GLM-4 MoE's TorchScript export (heads written as -1
in the view, so the dim is symbolic) the candidate failed to load. The count comes from the input's static heads
dim, else from the attention the rotated tensor feeds (through Transpose and Reshape): GroupQueryAttention's
``num_heads`` for its query and ``kv_num_heads`` for its key, MultiHeadAttention's ``num_heads`` for either.
"""

from __future__ import annotations

import onnx_ir as ir

_MS = "com.microsoft"
_THROUGH = frozenset({"Transpose", "Reshape", "Identity"})
_HEADS_ATTR = {("GroupQueryAttention", 0): "num_heads", ("GroupQueryAttention", 1): "kv_num_heads",
               ("MultiHeadAttention", 0): "num_heads", ("MultiHeadAttention", 1): "num_heads"}  # fmt: skip


def heads(x: ir.Value, rotated: ir.Value) -> int | None:
    """Heads of the BNSH tensor ``x`` whose rotation is ``rotated``; None when neither its shape nor the attention
    it feeds says."""
    shape = x.shape
    if shape is not None and len(shape) == 4 and isinstance(shape[1], int) and shape[1] > 0:
        return shape[1]
    value = rotated
    for _ in range(8):  # a few layout ops between the rotation and the attention
        uses = list(value.uses())
        if len(uses) != 1:
            return None
        node, index = uses[0]
        attr = _HEADS_ATTR.get((node.op_type, index)) if node.domain == _MS else None
        if attr is not None:
            count = node.attributes.get_int(attr, 0)
            return count if count > 0 else None
        if node.op_type not in _THROUGH or node.domain not in ("", "ai.onnx") or index != 0:
            return None
        value = node.outputs[0]
    return None
