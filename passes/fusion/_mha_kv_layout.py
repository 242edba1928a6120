"""A cached key and value handed to ``MultiHeadAttention`` in their own ``[B, N, T, H]`` layout (issue 17/19).

onnxscript's ``sdpa_via_mha`` rule (0.7.2) always gives MultiHeadAttention 3-D ``[B, T, N*H]`` keys and
values: where they are 4-D ``[B, N, T, H]`` (a decoder's ``Concat(past, new)`` on the sequence axis, BLOOM's
ALiBi attention with a cache) it inserts ``Reshape(Transpose(0, 2, 1, 3)(kv), [B, T, N*H])``, a copy of the
whole cache for each of K and V, in every layer, at every decode step. ORT's MultiHeadAttention also takes
key and value as ``[B, N, T, H]`` (BNSH, its cross-attention layout; checked on the CPU EP, ORT 1.32) and
reads them in place, so the Transpose and Reshape are dropped::

    MultiHeadAttention(q, Reshape(Transpose(k4, perm=[0,2,1,3]), [B,T,N*H]), Reshape(Transpose(v4, ..), ..))
    ==>  MultiHeadAttention(q, k4, v4)

Exact (the same values, read in the layout the kernel accepts). Only where the shapes prove each Reshape
merges exactly the last two dims of the transposed ``[B, N, T, H]`` source, with N the node's ``num_heads``,
key and value have one head size (ORT requires BNSH keys and values of one shape: multi-head latent attention's
values are narrower than its keys, and its 3-D flat form is what the kernel takes), and the node has no
projection ``bias``, ``key_padding_mask`` or past/present inputs and outputs, which ORT does not combine with
BNSH keys.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from passes.fusion._batched_heads import same_dim

_ONNX = ("", "ai.onnx")


def _heads_first(value: ir.Value | None, heads: int) -> ir.Value | None:
    """The ``[B, N, T, H]`` source of ``Reshape(Transpose(src, perm=[0,2,1,3]), [B, T, N*H])``, else None."""
    reshape = value.producer() if value is not None else None
    if reshape is None or reshape.op_type != "Reshape" or reshape.domain not in _ONNX:
        return None
    transpose = reshape.inputs[0].producer() if reshape.inputs[0] is not None else None
    if transpose is None or transpose.op_type != "Transpose" or transpose.domain not in _ONNX:
        return None
    if list(transpose.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        return None
    source = transpose.inputs[0]
    if source is None or source.shape is None or value.shape is None:
        return None
    src, out = list(source.shape), list(value.shape)
    if len(src) != 4 or len(out) != 3 or not (isinstance(src[3], int) and same_dim(src[1], heads)):
        return None
    if not (same_dim(out[0], src[0]) and same_dim(out[1], src[2]) and same_dim(out[2], heads * src[3])):
        return None
    return source


def read_heads_first_kv(model: ir.Model) -> int:
    """Give every proven MultiHeadAttention its 4-D key and value directly; the number rewritten."""
    done = 0
    for node in list(model.graph):
        if node.op_type != "MultiHeadAttention" or node.domain != "com.microsoft":
            continue
        heads = node.attributes.get_int("num_heads", 0)
        inputs = list(node.inputs) + [None] * (8 - len(node.inputs))
        if heads <= 0 or any(v is not None for v in inputs[3:5] + inputs[6:]) or len(node.outputs) > 1:
            continue
        key, value = _heads_first(inputs[1], heads), _heads_first(inputs[2], heads)
        if key is None or value is None or key.shape[3] != value.shape[3]:  # type: ignore[index]
            continue
        node.replace_input_with(1, key)
        node.replace_input_with(2, value)
        done += 1
    if done:
        common_passes.RemoveUnusedNodesPass()(model)
    return done
