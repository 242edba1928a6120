"""The shape of a Concat read from the shapes of its inputs, so that a fusion may consume the Concat.

TorchScript's T5 decoder (with past) reads the key length of layer 0's self attention off the grown cache,
``Shape(Concat(past_key, key, axis=-2))[2]``, and feeds it to the relative position bias (``Range``, buckets,
the bias table) that the attention adds to its scores. onnxscript's with-past MHA rule replaces that Concat
with ``MultiHeadAttention``'s ``present_key`` output: the Shape would then read an output of the attention
whose bias it computes, a cycle, and the candidate was refused ("Nodes in a graph must be topologically
sorted"), so nothing in the decoder fused. Read from the Concat's inputs instead, the length no longer
depends on the Concat, and the rule fuses every layer::

    a[.., m, ..], b[.., n, ..] --Concat(axis=k)--Shape(start, end)-->
    ==>  Concat(Shape(a, start, k), Add(Shape(a, k, k+1), Shape(b, k, k+1)), Shape(a, k+1, end))

Exact: a Concat's inputs agree on every axis but ``k`` (its schema requires it), where its length is the sum
of theirs; a piece that lies outside ``[start, end)`` is left out. One dim is read as far up as it is the
same: through a ``Transpose`` at the permuted axis, through a ``Reshape`` at its input's one dim with the
same symbol (the head split ``[B, S, D] -> [B, S, h, d]``, as the symbolic shapes ``fuse_transformer`` runs
first prove it). Else the Shape would keep the new key's head split and transpose alive, and onnxscript's
with-past rule, which absorbs them, would refuse the layer (it fell back to attention over the Concat).
ORT also runs a Concat one of whose inputs is empty on another axis (it skips that input); the schema
does not allow such an input, and this rewrite does not model it. Needs ``Shape``'s start and end (opset
15); a Concat whose rank is unknown, or whose Shape is a graph output, is left as it is.
"""

from __future__ import annotations

import onnx_ir as ir

_ONNX = ("", "ai.onnx")


def _rank(values: list[ir.Value]) -> int | None:
    """The rank the Concat's inputs and output share, or None when no shape says it (or two disagree)."""
    ranks = {len(v.shape) for v in values if v.shape is not None}
    return ranks.pop() if len(ranks) == 1 else None


def _bound(attr: ir.Attr | None, default: int, rank: int) -> int:
    """Shape's start or end as ONNX reads it: negative from the back, then clamped to [0, rank]."""
    value = default if attr is None else int(attr.as_int())
    if value < 0:
        value += rank
    return min(max(value, 0), rank)


def _dim_source(value: ir.Value, axis: int) -> tuple[ir.Value, int]:
    """Where one dim of ``value`` is read most directly: through Transposes to the tensor they permute, and
    through a Reshape (the head split) to its input's dim of the same symbol, where the input has just one."""
    for _ in range(8):
        producer = value.producer()
        source = producer.inputs[0] if producer is not None and producer.inputs else None
        if producer is None or producer.domain not in _ONNX or source is None:
            break
        perm = producer.attributes.get("perm")
        if producer.op_type == "Transpose" and perm is not None:  # without perm: reversed, by a rank we know
            value, axis = source, list(perm.as_ints())[axis]
        elif producer.op_type == "Transpose" and source.shape is not None:
            value, axis = source, len(source.shape) - 1 - axis
        elif producer.op_type == "Reshape" and value.shape is not None and source.shape is not None:
            if _symbol(value.shape[axis]) is None:
                break
            same = [i for i, dim in enumerate(source.shape) if _symbol(dim) == _symbol(value.shape[axis])]
            if len(same) != 1:
                break
            value, axis = source, same[0]
        else:
            break
    return value, axis


def _symbol(dim: int | ir.SymbolicDim) -> str | None:
    return None if isinstance(dim, int) else dim.value


def _shape(new_nodes: list[ir.Node], value: ir.Value, lo: int, hi: int) -> ir.Value:
    """``Shape(value, lo, hi)``, a single dim read where it is most directly (``_dim_source``)."""
    if hi - lo == 1:
        value, lo = _dim_source(value, lo)
        hi = lo + 1
    piece = ir.node("Shape", [value], attributes={"start": lo, "end": hi})
    piece.outputs[0].dtype, piece.outputs[0].shape = ir.DataType.INT64, ir.Shape([hi - lo])
    new_nodes.append(piece)
    return piece.outputs[0]


def split_concat_shapes(model: ir.Model) -> int:
    """Rewrite every ``Shape(Concat(..))`` as above, in place; the number rewritten."""
    if model.opset_imports.get("", model.graph.opset_imports.get("", 0)) < 15:  # Shape's start and end
        return 0
    rewritten = 0
    for node in list(model.graph):
        if node.op_type != "Shape" or node.domain not in _ONNX or node.inputs[0] is None:
            continue
        concat = node.inputs[0].producer()
        if concat is None or concat.op_type != "Concat" or concat.domain not in _ONNX:
            continue
        parts = list(concat.inputs)
        if not parts or any(p is None for p in parts) or node.outputs[0].is_graph_output():
            continue
        rank = _rank([*parts, concat.outputs[0]])  # type: ignore[list-item]
        if rank is None or rank == 0:
            continue
        axis = concat.attributes.get_int("axis", 0)
        axis = axis + rank if axis < 0 else axis
        start = _bound(node.attributes.get("start"), 0, rank)
        end = _bound(node.attributes.get("end"), rank, rank)
        if not 0 <= axis < rank or start >= end:
            continue
        new_nodes: list[ir.Node] = []
        pieces = []
        if start < axis:
            pieces.append(_shape(new_nodes, parts[0], start, min(end, axis)))  # type: ignore[arg-type]
        if start <= axis < end:
            total = _shape(new_nodes, parts[0], axis, axis + 1)  # type: ignore[arg-type]
            for part in parts[1:]:
                add = ir.node("Add", [total, _shape(new_nodes, part, axis, axis + 1)])  # type: ignore[arg-type]
                add.outputs[0].dtype, add.outputs[0].shape = ir.DataType.INT64, ir.Shape([1])
                new_nodes.append(add)
                total = add.outputs[0]
            pieces.append(total)
        if axis + 1 < end:
            pieces.append(_shape(new_nodes, parts[0], max(start, axis + 1), end))  # type: ignore[arg-type]
        if len(pieces) > 1:
            joined = ir.node("Concat", pieces, attributes={"axis": 0})
            joined.outputs[0].dtype, joined.outputs[0].shape = ir.DataType.INT64, ir.Shape([end - start])
            new_nodes.append(joined)
        result = new_nodes[-1].outputs[0]
        model.graph.insert_before(node, new_nodes)
        ir.convenience.replace_all_uses_with(node.outputs[0], result)
        model.graph.remove(node, safe=True)
        rewritten += 1
    return rewritten
