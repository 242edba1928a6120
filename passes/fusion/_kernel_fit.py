"""Attention the ORT kernels cannot take, or were measured slower on, read at onnxscript's SDPA rule and in the
report (issues 17/19), so that fuse_gqa, fuse_transformer and the per-layer reasons decide alike.

* **Heads along an input's axis.** MultiHeadAttention, GroupQueryAttention and Attention take a fixed
  ``num_heads``. Inkling 2's block attention residuals attend, at each token, over the stacked states of the
  earlier layer blocks: SDPA on ``[batch, sequence, blocks, hidden]``, whose "heads" axis is the sequence. The
  SDPA rule matched it and no later rule could turn it into a kernel (its head count is the input's length), so
  the onnxscript candidate kept an op outside ORT and was refused whole, with every skip norm it had fused.
  Such a site is refused at the SDPA rule: the query's axis 1 is one a graph input declares (by its name).
* **Multi-head latent attention** (values narrower than the queries and keys, in a decoder). fuse_gqa leaves it
  unfused under ``attention='auto'``, measured slower as MultiHeadAttention (``LATENT_SLOWER``); onnxscript's
  rules fused the same layers in fuse_transformer's candidate, against that measurement, and in a cached
  export laid the narrower values out ``[B, N, T, H]`` beside wider keys, which ORT refuses. In the decoder
  families the SDPA rule now refuses it with fuse_gqa's reason; an encoder with narrower values (LeViT's
  attention) keeps its fusion, measured faster there.
* **Keys laid out [B, S, H, d].** The SDPA rule records a key read as ``Transpose(k, [0, 2, 3, 1])`` as
  ``key_format="BSHd"``; onnxscript's MultiHeadAttention rules read that tag on self-attention, but the
  cross-attention rule transposes the key as if it were ``[B, H, S, d]``, trusting a shape check that a key with
  as many positions as heads passes (DAB-DETR's 2 x 2 image tokens and 4 heads: wrong keys, refused by
  verification, no attention fused). ``keys_heads_first`` gives such an SDPA the key ``Transpose(k, [0, 2, 1, 3])``
  and the ``BHSd`` tag: the same product, in the layout every MHA rule reads right. A key that is a
  ``[B, S, H, d]`` view of a ``[B, S, D]`` projection (BERT's, GPT-2's) is left: the self-attention rule takes it,
  and reads the tag.
"""

from __future__ import annotations

import onnx_ir as ir

_ONNX = ("", "ai.onnx")
_MARK = "onnxforge.left_unfused"  # on the Softmax of an attention refused here: why, for the report
DECODER_FAMILIES = frozenset({"gpt2", "llama"})

# bench/README.md "Stop 41": `python -m bench.mla_attention_ab` (MiniCPM3 at hidden 1024, 16 heads, one thread)
LATENT_SLOWER = (
    "left unfused under attention='auto': on multi-head latent attention MultiHeadAttention takes the keys and "
    "values flat, a transpose of each every call, and measured slower than the unfused graph (MiniCPM3 at "
    "hidden 1024: 1.5% on a prefill of 64, 5-10% on a decode after 128 and 512); attention='mha' fuses it"
)


def input_axis(dim: object, graph: ir.Graph | None) -> str | None:
    """The name of ``dim`` when a graph input declares an axis of that name (a length the caller sets)."""
    if graph is None or not isinstance(dim, ir.SymbolicDim) or dim.value is None:
        return None
    for value in graph.inputs:
        if value.shape is not None and any(isinstance(d, ir.SymbolicDim) and d.value == dim.value for d in value.shape):
            return dim.value
    return None


def heads_along_input(query: ir.Value | None) -> str | None:
    """Why no kernel takes this rank-4 query's heads (its axis 1 is an input's axis), else None."""
    if query is None or query.shape is None or query.shape.rank() != 4:
        return None
    graph = query.graph or (query.producer().graph if query.producer() is not None else None)  # type: ignore[union-attr]
    if (axis := input_axis(query.shape[1], graph)) is None:
        return None
    return (
        f"its heads axis is the input's {axis!r} axis (attention over another axis at each position: Inkling's "
        "block attention residuals), and the fused attention kernels take a fixed number of heads"
    )


def latent(query: ir.Value | None, value: ir.Value | None) -> bool:
    """Values narrower than the queries (both head sizes known): multi-head latent attention in a decoder."""
    if query is None or value is None or query.shape is None or value.shape is None:
        return False
    q, v = query.shape[-1], value.shape[-1]
    return isinstance(q, int) and isinstance(v, int) and v < q


def operands(softmax: ir.Node) -> tuple[ir.Value, ir.Value] | None:
    """The query and value of the attention ``softmax`` normalizes: ``MatMul(q, .)`` under the scores (through a
    scale, masks and Casts) and ``MatMul(probs, v)`` over them (through Casts, a NaN guard or a sink's Slice)."""
    value = softmax.inputs[0]
    for _ in range(6):
        node = value.producer() if value is not None else None
        if node is None or node.domain not in _ONNX:
            return None
        if node.op_type == "MatMul":
            query = node.inputs[0]
            break
        if node.op_type not in ("Mul", "Div", "Add", "Sub", "Where", "Cast", "Concat"):
            return None
        value = node.inputs[1] if node.op_type == "Where" else node.inputs[0]
    else:
        return None
    probs = softmax.outputs[0]
    for _ in range(4):
        readers = [u.node for u in probs.uses() if u.node.op_type not in ("Shape", "IsNaN")]  # IsNaN: the guard's
        if len(readers) != 1 or readers[0].domain not in _ONNX:
            return None
        reader = readers[0]
        if reader.op_type == "MatMul" and reader.inputs[0] is probs and query is not None and reader.inputs[1]:
            return query, reader.inputs[1]
        if reader.op_type not in ("Cast", "Where", "Slice"):
            return None
        probs = reader.outputs[0]
    return None


def mark(softmax: ir.Node, why: str) -> None:
    softmax.metadata_props[_MARK] = why


def marked(softmax: ir.Node) -> str | None:
    """Why the SDPA rule refused the attention ``softmax`` normalizes, if it did (``mark``)."""
    return softmax.metadata_props.get(_MARK)


def keys_heads_first(model: ir.Model) -> int:
    """Each onnxscript SDPA with a ``BSHd`` key given it heads first (module docstring); returns how many."""
    done = 0
    for node in list(model.graph):
        if node.op_type != "SDPA" or node.domain != "ai.onnxruntime._fusion" or len(node.inputs) < 2:
            continue
        key = node.inputs[1]
        if key is None or node.attributes.get_string("key_format", "BHSd") != "BSHd":
            continue
        if _head_view(key):  # self-attention's form: its rule reads the tag
            continue
        turned = ir.node("Transpose", [key], {"perm": [0, 2, 1, 3]}, name=f"{node.name or 'sdpa'}/key_heads_first")
        turned.outputs[0].dtype = key.dtype
        if key.shape is not None and key.shape.rank() == 4:
            turned.outputs[0].shape = ir.Shape([key.shape[0], key.shape[2], key.shape[1], key.shape[3]])
        model.graph.insert_before(node, turned)
        node.replace_input_with(1, turned.outputs[0])
        node.attributes["key_format"] = ir.AttrString("key_format", "BHSd")
        done += 1
    return done


def _head_view(key: ir.Value) -> bool:
    """``key`` is a Reshape of a rank-3 tensor: the ``[B, S, D]`` projection the self-attention MHA rule reads."""
    reshape = key.producer()
    if reshape is None or reshape.op_type != "Reshape" or not reshape.inputs or reshape.inputs[0] is None:
        return False
    shape = reshape.inputs[0].shape
    return shape is not None and shape.rank() == 3
