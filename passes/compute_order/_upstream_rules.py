"""Per-op rules for ``upstream_slice``: which inputs of a producer P a slice can move to, and on which axis.

Re-implements the actors of ORT's ``upstream_gather_actors.{h,cc}`` (``onnxruntime/core/optimizer/
compute_optimizer/``) as plain functions ``rule(P, slice, out_shape) -> Move | str``: a ``Move`` says how
to rewrite, a string says why not. Rules only read the graph. Fixes over ORT are marked "ORT:" where they apply.

Dims compare as Equal when both are the same int or the same named symbol; an unknown dim never equals
anything, so a rule refuses rather than guesses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from passes._match import node_label

Dim = int | ir.SymbolicDim | None


@dataclasses.dataclass(frozen=True)
class SliceInfo:
    """One slice node: Gather, Slice or GatherND, taking ``length`` entries of ``axis`` of its data."""

    node: ir.Node
    axis: int  # non-negative, on the slice's data input
    scalar: bool  # rank-0 Gather indices: the axis is removed
    length: Dim  # output dim on the axis; None for a scalar slice or when unknown
    shrinking: bool = False  # indices from Squeeze(NonZero(.)): dynamic length allowed
    origin: str = ""  # the entry slice this one was copied from, for names and reports


@dataclasses.dataclass
class Move:
    """How a slice moves above P."""

    sliced: dict[int, int]  # P's input index -> axis of that input to slice
    # A scalar slice done as "gather, Unsqueeze back to size 1" on each sliced input, then one Squeeze
    # after P: needed where an unsliced input keeps the axis (broadcast) or P needs its rank (MatMul, Gemm).
    keep_dim: bool = False
    attributes: dict[str, ir.Attr] = dataclasses.field(default_factory=dict)
    reshape_shape: np.ndarray | None = None  # Reshape: the new shape constant


Rule = Callable[[ir.Node, SliceInfo, Sequence[Dim]], "Move | str"]


class FreshNames:
    """Fresh value and node names for one graph, never clashing with the existing ones."""

    def __init__(self, graph: ir.Graph) -> None:
        self.taken = {v.name for v in graph.inputs} | set(graph.initializers)
        for n in graph:
            self.taken.add(n.name)
            self.taken.update(o.name for o in n.outputs)

    def __call__(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name


def same_dim(a: Dim | object, b: Dim | object) -> bool:
    if a is b:
        return True
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    if isinstance(a, ir.SymbolicDim) and isinstance(b, ir.SymbolicDim):
        return a.value is not None and a.value == b.value
    return False


def same_input(a: ir.Value | None, b: ir.Value | None) -> bool:
    """The same value, or two constants with equal type, shape and contents: the copies of one slice or one
    reshape that meet on a shared value may be merged only when this holds for all their other inputs."""
    if a is b:
        return True
    ta = ir.convenience.get_const_tensor(a) if a is not None else None
    tb = ir.convenience.get_const_tensor(b) if b is not None else None
    if ta is None or tb is None or ta.dtype != tb.dtype:
        return False
    x, y = ta.numpy(), tb.numpy()
    return x.shape == y.shape and bool(np.array_equal(x, y))


def producer_to_cross(node: ir.Node, is_twin: Callable[[ir.Node, int], bool]) -> tuple[ir.Node, list[ir.Node]] | str:
    """The producer P that ``node`` (a slice or a flatten, reading its data at input 0) would move above,
    with the copies of ``node`` to merge into it; or, as words for the stop reason, why it cannot.

    P must not produce a graph output (the move would change it), and ``node`` must be its only reader,
    or every other reader must be a twin (``is_twin(reader, input_index)``: a copy of ``node`` that arrived
    on another branch of the same value). Both ``upstream_slice`` and ``upstream_reshape`` climb this way."""
    data = node.inputs[0]
    assert data is not None
    p = data.producer()
    if p is None:
        return f"{'initializer' if data.is_initializer() else 'graph input'} {data.name!r}"
    label = repr(node_label(p))
    for out in p.outputs:
        if out.is_graph_output():
            return f"{label} (its output {out.name!r} is a graph output)"
    edges = sum(len(list(out.uses())) for out in p.outputs)
    if edges == 1:
        return p, []
    twins = [use.node for use in data.uses() if use.node is not node]
    if edges != 1 + len(twins) or not all(is_twin(use.node, use.idx) for use in data.uses() if use.node is not node):
        return f"{label} ({edges} consumers)"
    return p, twins


def _dims(value: ir.Value | None) -> list[Dim] | None:
    if value is None or value.shape is None:
        return None
    return list(value.shape)


def broadcast_axes(shapes: dict[int, Sequence[Dim] | None], out: Sequence[Dim], axis: int, scalar: bool) -> Move | str:
    """ORT's SimplePointwise actor: inputs right-aligned against the output; slice those Equal at the axis.

    ORT: a lower-rank input sliced on the axis gets the absolute axis; the right one is
    ``axis - (rank(out) - rank(input))``, which is what ``sliced`` holds here.
    """
    sliced: dict[int, int] = {}
    broadcast = False
    for i, shape in shapes.items():
        if shape is None:
            return f"input {i} has no shape"
        offset = len(out) - len(shape)
        if offset < 0:
            return f"input {i} has rank {len(shape)} > output rank {len(out)}"
        for j in range(max(offset, 0), axis + 1):
            d = shape[j - offset]
            if same_dim(d, out[j]):
                if j == axis:
                    sliced[i] = j - offset
            elif isinstance(d, int) and d == 1:
                broadcast = broadcast or j == axis
            else:
                return f"input {i} dim {j - offset} is {d}, output dim {j} is {out[j]}"
    return Move(sliced, keep_dim=scalar and broadcast)


def _pointwise(node: ir.Node, s: SliceInfo, out: Sequence[Dim]) -> Move | str:
    shapes = {i: _dims(v) for i, v in enumerate(node.inputs) if v is not None}
    for k, other in enumerate(node.outputs):  # e.g. Dropout's mask: it must change the same way
        dims = _dims(other)
        if dims is not None and (len(dims) != len(out) or not all(map(same_dim, dims, out))):
            return f"output {k} has shape {dims}, not the output shape {list(out)}"
    return broadcast_axes(shapes, out, s.axis, s.scalar)


def _normalizing(node: ir.Node, s: SliceInfo, out: Sequence[Dim], default: int) -> Move | str:
    """LayerNormalization and Softmax reduce from ``axis``: that must lie after the slice axis. Only X is
    sliced; a scalar slice drops a dim before ``axis``, which then counts one lower."""
    axis = node.attributes.get_int("axis", default)
    axis = axis + len(out) if axis < 0 else axis
    if axis <= s.axis:
        return f"{node.op_type} axis {axis} <= slice axis {s.axis}"
    move = broadcast_axes({0: _dims(node.inputs[0])}, out, s.axis, s.scalar)
    if isinstance(move, Move):
        move.attributes = {"axis": ir.AttrInt64("axis", axis - 1)} if s.scalar else {}
    return move


def _layer_norm(node: ir.Node, s: SliceInfo, out: Sequence[Dim]) -> Move | str:
    # Scale and B cover the normalized dims, all after the slice axis. Mean and InvStdDev keep X's leading
    # dims, so they take the same update as Y.
    return _normalizing(node, s, out, -1)


def _softmax(node: ir.Node, s: SliceInfo, out: Sequence[Dim]) -> Move | str:
    # Opset < 13 coerces to 2-D at ``axis`` (default 1); slicing a dim before it still commutes.
    return _normalizing(node, s, out, -1 if _opset(node) >= 13 else 1)


def _opset(node: ir.Node) -> int:
    graph = node.graph
    if graph is None:
        return 1
    return graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 1))


def _matmul(node: ir.Node, s: SliceInfo, out: Sequence[Dim]) -> Move | str:
    a, b = _dims(node.inputs[0]), _dims(node.inputs[1])
    if a is None or b is None or len(a) < 2 or len(b) < 2:
        return "MatMul needs both inputs of known rank >= 2"
    r = len(out)
    if s.axis == r - 1:  # N: the columns of the right operand
        move = Move({1: len(b) - 1})
    elif s.axis == r - 2:  # M: the rows of the left operand
        move = Move({0: len(a) - 2})
    else:  # a batch dim: broadcast rule over the leading dims
        result = broadcast_axes({0: a[:-2], 1: b[:-2]}, out[:-2], s.axis, s.scalar)
        if isinstance(result, str):
            return result
        move = result
    # A scalar slice would change an operand's rank, and MatMul's meaning with it: keep the dim.
    move.keep_dim = s.scalar
    return move


def _gemm(node: ir.Node, s: SliceInfo, out: Sequence[Dim]) -> Move | str:
    trans_a = node.attributes.get_int("transA", 0)
    trans_b = node.attributes.get_int("transB", 0)
    sliced = {0: 1 if trans_a else 0} if s.axis == 0 else {1: 0 if trans_b else 1}
    if len(node.inputs) > 2 and node.inputs[2] is not None:  # C broadcasts to [M, N]
        c = broadcast_axes({2: _dims(node.inputs[2])}, out, s.axis, s.scalar)
        if isinstance(c, str):
            return c
        sliced |= c.sliced
    return Move(sliced, keep_dim=s.scalar)  # Gemm is 2-D only


def _transpose(node: ir.Node, s: SliceInfo, out: Sequence[Dim]) -> Move | str:
    perm = node.attributes.get_ints("perm", None)
    perm = list(perm) if perm is not None else list(reversed(range(len(out))))
    source = perm[s.axis]
    attributes = {}
    if s.scalar:  # ORT adds Unsqueeze/Squeeze; dropping the axis from perm is exact and needs no nodes
        attributes["perm"] = ir.AttrInt64s("perm", [p - (p > source) for p in perm if p != source])
    return Move({0: source}, attributes=attributes)


def _reshape(node: ir.Node, s: SliceInfo, out: Sequence[Dim]) -> Move | str:
    src = _dims(node.inputs[0])
    if src is None:
        return "Reshape input shape unknown"
    a, n, m = s.axis, len(out), len(src)
    # Sound axis rule (ORT checks only the axis dim): either the axis and every dim before it are
    # unchanged (left-aligned), or the axis and every dim after it are (right-aligned). Row-major order
    # then maps the slice to the same entries of the input.
    if a < m and all(same_dim(src[j], out[j]) for j in range(a + 1)):
        b = a
    elif n - a <= m and all(same_dim(src[m - n + j], out[j]) for j in range(a, n)):
        b = m - n + a
    else:
        return f"Reshape {src} -> {list(out)} does not keep axis {a} with all dims before or after it"
    # The slice length as a dim; unknown (or 0, which a shape entry cannot say) equals only itself.
    length = s.length if _positive(s.length) else _LENGTH
    new_src = [d for j, d in enumerate(src) if j != b] if s.scalar else [*src[:b], length, *src[b + 1 :]]
    new_out = [d for j, d in enumerate(out) if j != a] if s.scalar else [*out[:a], length, *out[a + 1 :]]
    tensor = ir.convenience.get_const_tensor(node.inputs[1]) if len(node.inputs) > 1 else None
    # ORT does not check allowzero. With allowzero=1 a 0 is a literal empty dim, not "copy"; without any
    # 0 entry allowzero changes nothing (the torch exporter sets it on every Reshape).
    allowzero = node.attributes.get_int("allowzero", 0)
    if tensor is not None and tensor.numpy().ndim == 1 and not (allowzero and 0 in tensor.numpy()):
        new_shape = _rewrite_shape([int(v) for v in tensor.numpy()], s, a, b, new_src=new_src, new_out=new_out)
    else:  # a computed shape (Concat of Shape pieces): derive a constant one from the known dims
        new_shape = _derive_shape(new_src, new_out)
    if isinstance(new_shape, str):
        return new_shape
    attributes = {"allowzero": ir.AttrInt64("allowzero", 0)} if allowzero and 0 in new_shape else {}
    return Move({0: b}, attributes=attributes, reshape_shape=np.array(new_shape, np.int64))


_LENGTH = ir.SymbolicDim(None)


def _positive(length: Dim) -> bool:
    return isinstance(length, int) and length > 0


def _rewrite_shape(shape: list[int], s: SliceInfo, a: int, b: int, *, new_src: list, new_out: list) -> list[int] | str:
    """ORT's rewrite of a constant shape: drop (scalar) or set entry ``a``; then keep every entry valid."""
    if s.scalar:
        new_shape = [v for j, v in enumerate(shape) if j != a]
    else:
        new_shape = list(shape)
        if shape[a] == 0 and b != a:
            new_shape[a] = s.length if _positive(s.length) else 0  # a bad 0 is refused below
        elif shape[a] > 0:  # -1 stays: the total shrinks by exactly the slice factor
            if not _positive(s.length):
                return f"Reshape shape[{a}] = {shape[a]} but the slice length {s.length} is not known"
            new_shape[a] = s.length
    # A -1 away from the axis cannot be inferred once the slice may be empty (0 * anything = 0).
    may_be_empty = not s.scalar and not _positive(s.length)
    for j, v in enumerate(new_shape):
        if v == -1 and j != a and may_be_empty:
            if not _positive(new_out[j]):
                return f"Reshape shape entry {j} = -1 cannot be inferred if the slice is empty"
            new_shape[j] = new_out[j]
    # Every 0 copies the input dim at its own index: check that it still copies the right one.
    for j, v in enumerate(new_shape):
        if v == 0 and not same_dim(new_src[j] if j < len(new_src) else None, new_out[j]):
            if not _positive(new_out[j]):
                return f"Reshape shape entry {j} = 0 would copy a different input dim after slicing"
            new_shape[j] = new_out[j]
    return new_shape


def _derive_shape(new_src: list, new_out: list) -> list[int] | str:
    """A constant shape (allowzero=0) giving ``new_out`` from ``new_src``: positive sizes as is, a dim
    equal to the input dim at the same index as 0 (copy), and at most one other dim as -1 when every
    other entry is a positive literal (so -1 is inferable even for an empty tensor)."""
    shape: list[int] = []
    for j, d in enumerate(new_out):
        if _positive(d):
            shape.append(d)
        elif j < len(new_src) and same_dim(new_src[j], d):
            shape.append(0)
        elif d == 0:
            return f"Reshape output dim {j} is a literal 0 that a shape without allowzero cannot say"
        else:
            shape.append(-1)
    others = [v for v in shape if v != -1]
    if shape.count(-1) > 1 or (-1 in shape and not all(v > 0 for v in others)):
        return f"Reshape shape is computed and the sliced output dims {new_out} cannot be written as a constant"
    return shape


# Element-wise ops with (multidirectional or unidirectional) broadcasting: the SimplePointwise rule holds.
# fmt: off
_UNARY = frozenset((
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "BitwiseNot", "Cast", "Ceil", "Celu", "Clip",
    "Cos", "Cosh", "Dropout", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish", "Identity",
    "IsInf", "IsNaN", "LeakyRelu", "Log", "Mish", "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu",
    "Sigmoid", "Sign", "Sin", "Sinh", "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu",
))
_BINARY = frozenset((
    "Add", "And", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Div", "Equal", "Greater", "GreaterOrEqual",
    "Less", "LessOrEqual", "Max", "Mean", "Min", "Mod", "Mul", "Or", "PRelu", "Pow", "Sub", "Sum", "Where",
    "Xor",
))
# fmt: on
_MS_POINTWISE = ("Gelu", "BiasGelu", "FastGelu", "QuickGelu")
# (domain, op) of every element-wise op; upstream_reshape moves through the same set.
POINTWISE: frozenset[tuple[str, str]] = frozenset(
    {("", op) for op in (*_UNARY, *_BINARY)} | {("com.microsoft", op) for op in _MS_POINTWISE}
)

RULES: dict[tuple[str, str], Any] = {
    **dict.fromkeys(POINTWISE, _pointwise),
    ("", "LayerNormalization"): _layer_norm,
    ("", "Softmax"): _softmax,
    ("", "LogSoftmax"): _softmax,
    ("", "MatMul"): _matmul,
    ("", "Gemm"): _gemm,
    ("", "Transpose"): _transpose,
    ("", "Reshape"): _reshape,
}


def rule_for(node: ir.Node) -> Rule | None:
    domain = "" if node.domain == "ai.onnx" else node.domain
    return RULES.get((domain, node.op_type))
