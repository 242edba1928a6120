"""The shapes TorchScript reads off attention's intermediate tensors, read where their dims were made instead.

TorchScript records every ``x.size(i)`` as a ``Shape`` of ``x`` itself. GPT-1's export slices its causal mask to
the scores' size (``bias[:, :, :w.size(-2), :w.size(-1)]``) and merges its heads with ``x.size(-2) *
x.size(-1)`` of the transposed context. onnxscript's SDPA and MHA rules replace those tensors and refuse a match
whose nodes have readers outside the pattern ("Matched nodes have other uses"), so no attention fused (0/2; the
dynamo export computes the same sizes from the mask and the projection and fused 2/2). Each such ``Shape`` is
rewritten dim by dim::

    Shape(t)[i]   ==>   a constant, where the dim is a static size (heads, head size)
                        Shape(u)[j], where the dim was made: u, j found by walking up from (t, i)

The walk goes through a Transpose (``j = perm[i]``), a Reshape that keeps every dim up to ``i``, a MatMul (its
batch and row dims from the left operand, its last from the right), and elementwise ops and Softmax (the operand
whose dim, aligned from the right, is the output's): at every step the dim it moves to is proven the same (the
same int or symbol of the graph's inferred shapes), so the value read is the one read before. Only a ``Shape``
of a tensor on an attention path is touched: scores that reach a ``Softmax`` through a scale or a mask, or the
product of a Softmax's probabilities, up to its Transposes and Reshapes; and only where every dim that is not
static is then read from a tensor of lower rank than the heads' (the projection before its head split, the
hidden states), which no attention pattern takes: a read that stays among the heads' tensors (BROS's context,
walked back to its biased scores) would block the fusion it was to free.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.fusion._batched_heads import same_dim

_ONNX = ("", "ai.onnx")
_MASKING = ("Add", "Sub", "Mul", "Div", "Where")
_ELEMENTWISE = (*_MASKING, "Pow", "Max", "Min")
_SAME_SHAPE = ("Softmax", "Cast", "Identity", "Neg", "Relu", "Tanh", "Erf", "Sqrt", "Exp", "Sigmoid", "Clip")
_STEPS = 24


def _dims(value: ir.Value | None) -> list | None:
    return None if value is None or value.shape is None else list(value.shape)


def reaches_softmax(value: ir.Value, depth: int = 4) -> bool:
    """Whether ``value`` reaches a Softmax through at most ``depth`` ops a mask or a scale is written with."""
    for use in value.uses():
        node = use.node
        if node.domain not in _ONNX:
            continue
        if node.op_type == "Softmax":
            return True
        if depth and node.op_type in _MASKING and reaches_softmax(node.outputs[0], depth - 1):
            return True
    return False


def _from_probabilities(value: ir.Value, depth: int = 4) -> bool:
    """``value`` is the product of a Softmax's probabilities (``probs @ v``), through Transposes and Reshapes."""
    node = value.producer()
    while node is not None and node.domain in _ONNX and node.op_type in ("Transpose", "Reshape") and depth:
        node, depth = (node.inputs[0].producer() if node.inputs[0] is not None else None), depth - 1
    if node is None or node.domain not in _ONNX or node.op_type != "MatMul" or node.inputs[0] is None:
        return False
    probs = node.inputs[0].producer()
    return probs is not None and probs.domain in _ONNX and probs.op_type == "Softmax"


def _step(value: ir.Value, axis: int) -> tuple[ir.Value, int] | None:
    """The operand and axis that dim ``axis`` of ``value`` comes from, proven the same dim; None where unknown."""
    node, out = value.producer(), _dims(value)
    if node is None or node.domain not in _ONNX or out is None or axis >= len(out) or not node.inputs:
        return None
    op, rank = node.op_type, len(out)
    candidates: list[tuple[ir.Value | None, int]] = []
    if op == "Transpose":
        perm = list(node.attributes.get_ints("perm", [])) or list(reversed(range(rank)))
        candidates = [(node.inputs[0], perm[axis])] if axis < len(perm) else []
    elif op == "Reshape":
        before = _dims(node.inputs[0])
        if before is not None and axis < len(before) and all(same_dim(out[i], before[i]) for i in range(axis + 1)):
            candidates = [(node.inputs[0], axis)]
    elif op == "MatMul" and rank >= 2:
        candidates = [(node.inputs[1], axis)] if axis == rank - 1 else [(node.inputs[0], axis)]
    elif op in _SAME_SHAPE:
        candidates = [(node.inputs[0], axis)]
    elif op in _ELEMENTWISE:
        for operand in node.inputs:
            dims = _dims(operand)
            if operand is not None and operand.const_value is None and dims is not None:
                candidates.append((operand, axis - (rank - len(dims))))
    for operand, at in candidates:
        dims = _dims(operand)
        if operand is not None and dims is not None and 0 <= at < len(dims) and same_dim(dims[at], out[axis]):
            return operand, at
    return None


def _made_at(value: ir.Value, axis: int) -> tuple[ir.Value, int]:
    for _ in range(_STEPS):
        found = _step(value, axis)
        if found is None:
            break
        value, axis = found
    return value, axis


def _const(values: list[int], name: str) -> ir.Node:
    return ir.node("Constant", [], {"value": ir.tensor(np.array(values, np.int64))}, name=name)


def read_at_origin(model: ir.Model) -> int:
    """Every ``Shape`` of a tensor on an attention path rewritten to read each dim where it was made; how many."""
    done = 0
    for shape in list(model.graph):
        if shape.op_type != "Shape" or shape.domain not in _ONNX or shape.inputs[0] is None:
            continue
        target, dims = shape.inputs[0], _dims(shape.inputs[0])
        if shape.outputs[0].is_graph_output() or dims is None or not dims:
            continue
        if not (reaches_softmax(target) or _from_probabilities(target)):
            continue
        rank = len(dims)
        start, end = shape.attributes.get_int("start", 0), shape.attributes.get_int("end", rank)
        start, end = max(start + rank if start < 0 else start, 0), min(end + rank if end < 0 else end, rank)
        prefix = shape.name or f"attention_shape_{done}"
        nodes, pieces = [], []
        for axis in range(start, end):
            if isinstance(dims[axis], int):  # a static size: no reader at all
                piece = _const([dims[axis]], f"{prefix}/dim{axis}")
            else:
                value, at = _made_at(target, axis)
                if len(_dims(value) or dims) >= rank:  # still read inside the heads' tensors: no gain, left
                    break
                piece = ir.node("Shape", [value], {"start": at, "end": at + 1}, name=f"{prefix}/dim{axis}")
            nodes.append(piece)
            pieces.append(piece.outputs[0])
        if not pieces or len(pieces) != end - start:  # empty, or a dim left among the heads' tensors
            continue
        result = pieces[0]
        if len(pieces) > 1:
            joined = ir.node("Concat", pieces, {"axis": 0}, name=f"{prefix}/at_origin")
            nodes.append(joined)
            result = joined.outputs[0]
        result.shape, result.dtype = shape.outputs[0].shape, shape.outputs[0].dtype
        model.graph.insert_before(shape, nodes)
        ir.convenience.replace_all_uses_with(shape.outputs[0], result)
        model.graph.remove(shape, safe=True)
        done += 1
    return done
