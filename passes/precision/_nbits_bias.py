"""Constant bias Adds after ``MatMulNBits`` folded into its ``bias`` input (``quantize_int4``'s last step).

ORT's ``MatMulNBitsFusion`` (``core/optimizer/matmul_nbits_fusion.cc``, level 2) does the direct case when a
session is built; this writes it into the artifact, so the graph a user gets and the graph ORT runs at any
level agree, and adds the case ORT leaves alone, a projection packed before its biases are applied::

    x --MatMulNBits--> Add(b) --> y                  =>   x --MatMulNBits(.., bias=b)--> y

    x --MatMulNBits--> Split --> Add(bq) --> q            x --MatMulNBits(.., bias=[bq|bk|bv])--> Split --> q
                             --> Add(bk) --> k       =>                                                --> k
                             --> Add(bv) --> v                                                         --> v

The kernel adds the bias to each output column after the dot product, as the Add did: at ``accuracy_level``
0 the results are bit-identical, at 4 within a rounding of the sum (the int8 path adds it inside its tile).
CPU only: the CUDA kernel of ORT 1.32 takes a bias on one GEMV shape alone (a gpt-oss router, M = 1) and
throws at run time otherwise, so the caller folds for the CPU target only.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes._infra import NonMatch
from passes._match import drop_orphans, take_graph_output
from passes.precision._quantization import unique_name

_BIAS = 5  # MatMulNBits inputs: A, B, scales, zero_points, g_idx, bias
_ONNX = ("", "ai.onnx")


def fold_bias_adds(model: ir.Model) -> tuple[int, list[NonMatch]]:
    """Fold every foldable bias Add of ``model`` into its MatMulNBits, in place; (Adds removed, declined)."""
    sites: list[tuple[ir.Node, list[tuple[ir.Node, ir.Value, ir.Value]]]] = []
    declined: list[NonMatch] = []
    for node in model.graph:
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            site = _match(node)
            if isinstance(site, NonMatch):
                declined.append(site)
            elif site is not None:
                sites.append((node, site))
    for node, adds in sites:
        _fold(model, node, adds)
    return sum(len(adds) for _, adds in sites), declined


# One Add to remove: (the Add, the value it adds the bias to, the constant bias it reads).
_Add = tuple[ir.Node, ir.Value, ir.Value]


def _match(node: ir.Node) -> list[_Add] | NonMatch | None:
    """The Adds to fold, in column order; a reason where a bias Add follows but cannot go; None where no Add
    follows (most MatMulNBits of a decoder: nothing to say about them)."""
    if len(node.inputs) > _BIAS and node.inputs[_BIAS] is not None:
        return None
    out = node.outputs[0]
    users = list(out.uses())
    if len(users) != 1 or out.is_graph_output():
        return None
    user = users[0].node
    if user.op_type == "Add" and user.domain in _ONNX:
        bias = _bias_of(user, out, node, int(node.attributes["N"].value))
        return bias if bias is None or isinstance(bias, NonMatch) else [(user, out, bias)]
    if user.op_type != "Split" or user.domain not in _ONNX:
        return None
    widths = _split_widths(user, node)
    if widths is None:
        return None  # not a split of the output columns: a bias after it would not be per column
    adds: list[_Add] = []
    for piece, width in zip(user.outputs, widths, strict=True):
        readers = list(piece.uses())
        if len(readers) != 1 or piece.is_graph_output():
            return None
        add = readers[0].node
        if add.op_type != "Add" or add.domain not in _ONNX:
            return None
        bias = _bias_of(add, piece, node, width)
        if bias is None or isinstance(bias, NonMatch):
            return bias
        adds.append((add, piece, bias))
    return adds


def _bias_of(add: ir.Node, value: ir.Value, node: ir.Node, width: int) -> ir.Value | NonMatch | None:
    other = add.inputs[1] if add.inputs[0] is value else add.inputs[0]
    if other is value or other is None or other.const_value is None:
        return None  # a residual or another activation: not a bias, nothing to say
    shape = tuple(other.const_value.shape)
    if shape != (width,):  # [1, N] would broadcast a 2-D output up a rank: not a bias
        return NonMatch(f"bias of shape {list(shape)}, not [{width}]", add.name, "Add")
    scales = node.inputs[2].const_value if node.inputs[2] is not None else None
    if scales is None or other.const_value.dtype != scales.dtype:  # the kernel's bias is T1, the scales' type
        return NonMatch("bias of another dtype than the MatMulNBits' scales", add.name, "Add")
    return other


def _split_widths(split: ir.Node, node: ir.Node) -> list[int] | None:
    """The column widths of a Split over the last axis of the MatMulNBits' output, when constant."""
    n = int(node.attributes["N"].value)
    axis = split.attributes["axis"].value if "axis" in split.attributes else 0
    shape = node.outputs[0].shape
    if axis != -1 and (shape is None or axis != shape.rank() - 1):
        return None
    sizes = split.inputs[1] if len(split.inputs) > 1 else None
    if sizes is not None:
        if sizes.const_value is None:
            return None
        widths = [int(w) for w in sizes.const_value.numpy().ravel()]
    elif "split" in split.attributes:  # opset < 13
        widths = [int(w) for w in split.attributes["split"].value]
    elif n % len(split.outputs):
        return None  # num_outputs with a shorter last piece: left alone
    else:
        widths = [n // len(split.outputs)] * len(split.outputs)
    return widths if sum(widths) == n and len(widths) == len(split.outputs) else None


def _fold(model: ir.Model, node: ir.Node, adds: list[_Add]) -> None:
    graph = model.graph
    if len(adds) == 1:
        bias = adds[0][2]  # read in place: no new bytes
    else:
        array = np.concatenate([b.const_value.numpy() for _, _, b in adds])
        name = unique_name(graph.initializers, f"{node.name}_bias")
        bias = ir.Value(name=name, const_value=ir.tensor(array, name=name), shape=ir.Shape(array.shape))
        bias.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
        graph.register_initializer(bias)
    if len(node.inputs) <= _BIAS:
        node.resize_inputs(_BIAS + 1)
    node.replace_input_with(_BIAS, bias)
    for add, before, old_bias in adds:
        after = add.outputs[0]
        if after.shape is not None:
            before.shape = after.shape
        take_graph_output(graph, after, before, "_unbiased")
        ir.convenience.replace_all_uses_with(after, before)
        graph.remove(add, safe=True)
        drop_orphans(graph, [old_bias])  # the one bias read in place is read by the MatMulNBits now: kept
