"""Folding the export's head Reshapes around the fused attention (``fuse_gqa``).

GroupQueryAttention takes q/k/v and returns its output as [B,S,N*D]; the export splits and merges heads around
attention with its own Reshapes, so after the rewrite each projection goes [B,S,N*D] -> [B,S,N,D] (export)
-> [B,S,N*D] (``to_bsh``) and the output [B,S,N*D] -> [B,S,N,D] (``to_heads``) -> [B,S,N*D] (export). Each
pair gives back its own input, but only when the outer shape's two leading dims are provably the input's:
TorchScript writes them as ``Concat(Shape(h)[0], Shape(h)[1], ...)`` of the layer's hidden state ``h``, so
the proof follows dims 0 and 1 back through the ops that keep them (a MatMul by a 2-D constant, a bias
``Add``, a ``Split`` or ``Slice`` of later axes, RotaryEmbedding, GroupQueryAttention's query, a Reshape
whose shape keeps them) to one common value. A pair it cannot prove stays. With a constant
``[0, 0, ...]`` shape (leading dims copied) the proof is immediate. It removes, per layer and decode step, 8
Reshapes and the shape arithmetic feeding them (Shape, Gather, Unsqueeze, Concat), a few microseconds
each beside ~30 us int4 GEMVs. Dynamo exports take those dims from other inputs (the cache's batch, the
ids' length): equal there by the signature's dim names, which the proof accepts (``_same_symbol``) once
the projection's dims are traced to a graph input. The trace goes on through the hidden state's own
arithmetic (norms, RMSNorm's ``x * rsqrt(mean(x^2))``, residual Adds whose operands share one source, the
embedding lookup) to the token ids, so it needs no dim name on any inner value. Where values carry no shapes
(a merged decoder's branches), their ranks are read through the ops from the graph's inputs (``_ranks``)
and the ids' and the cache's declared dims still meet (a dynamo merged decoder's 16 Reshapes per branch
fold); a rotated key fuse_rotary flattened after the export's head split
(``RotaryEmbedding(Reshape(Reshape(k, s), [0,0,-1]))``) is read straight from the projection too.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

_ONNX = ("", "ai.onnx")
_LEADING = (0, 1)
# Broadcast ops that keep their data input's dims 0 and 1 beside a constant of rank <= 1 (``_broadcast_source``).
_BIAS_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Pow"})


def fold_head_reshapes(graph: ir.Graph) -> int:
    """Bypass the provable no-op Reshape pairs around fuse_gqa's attention nodes; returns how many pairs."""
    folded = 0
    token = _RANKS.set(_ranks(graph))
    roots = _ROOTS.set(_roots(graph))
    try:
        for node in list(graph):
            if node.op_type != "Reshape" or not (node.name or "").startswith("fuse_gqa/layer_"):
                continue
            if node.name.endswith("/to_bsh"):
                folded += _fold_into_flat(node)
            elif node.name.endswith("/to_heads"):
                folded += _fold_after_heads(node)
        for node in list(graph):
            if node.op_type == "GroupQueryAttention" and (node.name or "").startswith("fuse_gqa/layer_"):
                folded += sum(_fold_before_rotary(v) for v in node.inputs[:3] if v is not None)
    finally:
        _ROOTS.reset(roots)
        _RANKS.reset(token)
    return folded


@contextlib.contextmanager
def reading(graph: ir.Graph) -> Iterator[None]:
    """Ranks and leading-dim roots of ``graph``'s values read once, for ``rank``, ``_root`` and ``_dim`` calls
    made while the graph is being rewritten (values made later are read lazily)."""
    ranks = _RANKS.set(_ranks(graph))
    roots = _ROOTS.set(_roots(graph))
    try:
        yield
    finally:
        _ROOTS.reset(roots)
        _RANKS.reset(ranks)


def _fold_into_flat(flat: ir.Node) -> int:
    """``Reshape(Reshape(x, s), [0,0,-1])`` is ``x`` when x is rank 3 and s keeps x's dims 0 and 1."""
    inner = flat.inputs[0].producer() if flat.inputs[0] is not None else None
    if not _is_reshape(inner) or flat.outputs[0].is_graph_output():
        return 0
    x = inner.inputs[0]
    if x is None or rank(x) != 3 or not _keeps_leading(inner):
        return 0
    ir.convenience.replace_all_uses_with(flat.outputs[0], x)
    return 1


def _fold_before_rotary(value: ir.Value) -> int:
    """A rotated GQA input ``RotaryEmbedding(Reshape(Reshape(x, s), [0,0,-1]))`` reads ``x`` where that pair is
    a no-op: fuse_rotary flattens a present key that way (the export's head split, then its own flat form),
    and in a no-cache decoder GQA's present replaces the present the head split also fed."""
    rotary = value.producer()
    if rotary is None or rotary.op_type != "RotaryEmbedding" or rotary.domain != "com.microsoft":
        return 0
    flat = rotary.inputs[0].producer() if rotary.inputs[0] is not None else None
    if not _is_reshape(flat) or flat.attributes.get_int("allowzero", 0) or _constant(flat.inputs[1]) is None:
        return 0
    if _constant(flat.inputs[1]).reshape(-1).tolist() != [0, 0, -1]:
        return 0
    return _fold_into_flat(flat)


def _fold_after_heads(unflat: ir.Node) -> int:
    """``Reshape(Reshape(out, [0,0,N,D]), s)`` is ``out`` [B,S,N*D] when s has 3 entries keeping dims 0, 1."""
    out = unflat.inputs[0]
    folded = 0
    for use in list(unflat.outputs[0].uses()):
        outer = use.node
        if not _is_reshape(outer) or use.idx != 0 or outer.outputs[0].is_graph_output():
            continue
        entries = _shape_entries(outer.inputs[1])
        if entries is None or len(entries) != 3 or not _keeps_leading(outer):
            continue
        ir.convenience.replace_all_uses_with(outer.outputs[0], out)
        folded += 1
    return folded


def _is_reshape(node: ir.Node | None) -> bool:
    return (
        node is not None
        and node.op_type == "Reshape"
        and node.domain in _ONNX
        and len(node.inputs) == 2
        and node.inputs[0] is not None
        and node.inputs[1] is not None
    )


def _keeps_leading(reshape: ir.Node) -> bool:
    """Whether the Reshape's output dims 0 and 1 are its data input's."""
    entries = _shape_entries(reshape.inputs[1])
    if entries is None or len(entries) < 2:
        return False
    root = _root(reshape.inputs[0])
    copies_zero = not reshape.attributes.get_int("allowzero", 0)
    for position in _LEADING:
        entry = entries[position]
        if entry == 0 and copies_zero:  # 0 copies the input's dim (a literal 0 under allowzero=1)
            continue
        if not isinstance(entry, tuple):
            return False
        if not (entry[0] is root and entry[1] == position) and not _same_symbol(entry, root, position):
            return False
    return True


def _same_symbol(entry: tuple, root: ir.Value, position: int) -> bool:
    """Dim ``entry[1]`` of ``entry[0]`` and dim ``position`` of ``root`` are one named symbol: dynamo exports
    take a head split's batch from one input (a past cache) and its length from another (the token ids), which
    the graph's signature declares equal by name (``batch``, ``sequence``) and shape inference carries to the
    projections. Unnamed or differently named dims prove nothing."""
    source, index = entry
    if source.shape is None or root.shape is None or index >= len(source.shape) or position >= len(root.shape):
        return False
    a, b = source.shape[index], root.shape[position]
    if isinstance(a, int) or isinstance(b, int):
        return False  # a static leading dim may be one export's example size: no claim for other inputs
    return a.value is not None and a.value == b.value


def _constant(value: ir.Value | None) -> np.ndarray | None:
    """A value's constant: an initializer or a ``Constant`` node's ``value``/``value_int(s)``."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is None or node.op_type != "Constant" or node.domain not in _ONNX or len(node.attributes) != 1:
        return None
    attribute = next(iter(node.attributes.values()))
    if attribute.name == "value":
        return attribute.as_tensor().numpy()
    if attribute.name in ("value_int", "value_ints"):
        return np.array(attribute.value, np.int64)
    return None


def _shape_entries(shape: ir.Value, *, roots: bool = True) -> list | None:
    """The entries of a 1-D shape value: ints where constant, ``(root, i)`` for dim i of a value (``Shape``
    read through ``Gather``/``Unsqueeze`` or ``Shape(start, end)``), ``None`` entries unknown; None if the
    entry count is unknown. ``roots=False``: ``(value, i)`` as read, for a caller that needs only the count
    (``_ranks``, which runs before the roots are read: walking them there re-walks a residual stream once per
    branch, 2^layers, minutes on a 4-layer GPT-2)."""
    array = _constant(shape)
    if array is not None:
        return [int(v) for v in array.reshape(-1)] if array.ndim == 1 else None
    node = shape.producer()
    if node is None or node.domain not in _ONNX:
        return None
    if node.op_type == "Concat" and node.attributes.get_int("axis", 0) == 0:
        entries: list = []
        for piece in node.inputs:
            got = _shape_entries(piece, roots=roots) if piece is not None else None
            if got is None:
                return None
            entries += got
        return entries
    if node.op_type == "Shape":
        data = node.inputs[0]
        start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", 0)
        if data is None or data.shape is None or start < 0 or ("end" in node.attributes and end <= start):
            return None
        stop = end if "end" in node.attributes else len(data.shape)
        if stop < 0 or stop > len(data.shape):
            return None
        return [_entry(data, i, roots) for i in range(start, stop)]
    if node.op_type == "Gather" and len(node.inputs) == 2 and not node.attributes.get_int("axis", 0):
        indices = _constant(node.inputs[1])  # Shape(x)[[i, j]]: a 1-D pick of dims
        shape = node.inputs[0].producer() if node.inputs[0] is not None else None
        if indices is None or indices.ndim != 1 or (indices < 0).any() or shape is None:
            return None
        if shape.op_type != "Shape" or shape.domain not in _ONNX or len(shape.attributes):
            return None
        return [_entry(shape.inputs[0], int(i), roots) for i in indices]
    if node.op_type == "Unsqueeze":
        given = _constant(node.inputs[1]) if len(node.inputs) > 1 else None
        axes = given.reshape(-1).tolist() if given is not None else list(node.attributes.get_ints("axes", []))
        scalar = _dim_of_shape(node.inputs[0], roots)
        return [scalar] if scalar is not None and list(axes) in ([0], [-1]) else None
    return None


def _dim_of_shape(value: ir.Value | None, roots: bool = True) -> tuple | None:
    """``Gather(Shape(x), i)`` with a scalar constant i >= 0: ``(root(x), i)``."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Gather" or node.domain not in _ONNX or node.attributes.get_int("axis", 0):
        return None
    index = _constant(node.inputs[1])
    shape = node.inputs[0].producer() if node.inputs[0] is not None else None
    if index is None or index.ndim != 0 or int(index) < 0:
        return None
    if shape is None or shape.op_type != "Shape" or shape.domain not in _ONNX or len(shape.attributes):
        return None
    return _entry(shape.inputs[0], int(index), roots)


def _entry(value: ir.Value, index: int, roots: bool = True) -> tuple[ir.Value, int]:
    """Dim ``index`` of ``value`` as a shape entry: a leading dim by its root, a later one as read (a root shares
    only dims 0 and 1 with what it feeds)."""
    return (_root(value), index) if roots and index in _LEADING else (value, index)


def _root(value: ir.Value) -> ir.Value:
    """The earliest value whose dims 0 and 1 ``value`` provably shares (read once per graph by ``_roots``)."""
    known = _ROOTS.get() or {}
    seen = 0
    while seen < _MAX_STEPS:
        entry = known.get(id(value))
        if entry is not None and entry[0] is value:  # the same object, not a later one at a freed id
            return entry[1]
        node = value.producer()
        source = _leading_source(node, value) if node is not None else None
        if source is None or source is value:
            return value
        value, seen = source, seen + 1
    return value


def _roots(graph: ir.Graph) -> dict[int, tuple[ir.Value, ir.Value]]:
    """``_root`` of every node output, in graph order (by ``id``), so that a residual stream's root is read once
    and not re-walked through every layer before it."""
    roots: dict[int, tuple[ir.Value, ir.Value]] = {}
    token = _ROOTS.set(roots)
    try:
        for node in graph:
            for output in node.outputs:
                source = _leading_source(node, output)
                roots[id(output)] = (output, output if source is None or source is output else _root(source))
    finally:
        _ROOTS.reset(token)
    return roots


def _leading_source(node: ir.Node, output: ir.Value) -> ir.Value | None:
    """An input whose dims 0 and 1 the node's ``output`` provably keeps, or None.

    Beyond the projection ops: elementwise ops of one input and norms over the last axis (their output is the
    input's shape), a reduction with ``keepdims`` over axes >= 2, an embedding lookup (``Gather`` of a constant
    table by [B, S] ids, whose dims 0 and 1 are the ids'), and a broadcast op whose inputs share one root at
    one rank (a residual ``Add``, RMSNorm's ``x * rsqrt(mean(x^2))``): both operands have the root's dims 0
    and 1 there, so the result has them too. Dynamo exports, and a merged decoder's branches, where no value
    carries a dim name, name the batch and length by the token ids this reaches."""
    first = node.inputs[0] if node.inputs else None
    if first is None:
        return None
    rank_ = rank(first)
    if node.domain in _ONNX:
        op = node.op_type
        if op == "MatMul":
            weight = _constant(node.inputs[1])
            two_d = weight is not None and weight.ndim == 2
            return first if two_d and rank_ is not None and rank_ >= 3 else None
        if op in _BIAS_OPS and len(node.inputs) == 2:
            return _broadcast_source(node.inputs[0], node.inputs[1])
        if op == "Slice" and len(node.inputs) >= 4:  # slicing only axes >= 2
            axes = _constant(node.inputs[3])
            if rank_ is None or axes is None or any(int(a) % rank_ < 2 for a in axes.reshape(-1)):
                return None
            return first
        if op == "Split":
            axis = node.attributes.get_int("axis", 0)
            return first if rank_ is not None and (axis >= 2 or (axis < 0 and axis + rank_ >= 2)) else None
        if op == "Reshape" and _is_reshape(node):
            return first if _keeps_leading(node) else None
        if op in _UNARY and output is node.outputs[0]:
            return first
        if op in ("LayerNormalization", "RMSNormalization") and output is node.outputs[0]:
            return first  # Y has X's shape, whichever axes it normalizes over
        if op in _REDUCE and node.attributes.get_int("keepdims", 1) and rank_ is not None and rank_ >= 2:
            given = _constant(node.inputs[1]) if len(node.inputs) > 1 else None
            axes = given.reshape(-1).tolist() if given is not None else list(node.attributes.get_ints("axes", []))
            return first if axes and all(int(a) % rank_ >= 2 for a in axes) else None
        if op == "Gather" and len(node.inputs) == 2 and node.attributes.get_int("axis", 0) == 0:
            table, ids = node.inputs
            ids_rank = rank(ids) if ids is not None else None
            return ids if _constant(table) is not None and ids_rank is not None and ids_rank >= 2 else None
        return None
    if node.domain == "com.microsoft":
        if node.op_type == "MatMulNBits":
            return first if rank_ is not None and rank_ >= 3 else None
        if node.op_type == "RotaryEmbedding" and rank_ == 3:  # [B,S,N*D] in and out
            return first
        if node.op_type == "GroupQueryAttention":  # output 0 is [B, S, N*D] of the (3-D) query's B and S
            return first if output is node.outputs[0] else None
        if node.op_type in _MS_NORMS and output is node.outputs[0] and rank_ is not None and rank_ >= 3:
            return first  # a bias or skip they add broadcasts over the last axis: dim 1 only at rank 2
    return None


def _broadcast_source(a: ir.Value | None, b: ir.Value | None) -> ir.Value | None:
    """The operand whose dims 0 and 1 a broadcast op of ``a`` and ``b`` keeps: the data side beside a constant of
    rank <= 1 (a bias, a scale: it broadcasts over the last axis only), or either side where both have one
    root at one rank >= 2."""
    if a is None or b is None:
        return None
    rank_a, rank_b = rank(a), rank(b)
    for data, other, data_rank in ((a, b, rank_a), (b, a, rank_b)):
        bias = _constant(other)
        if bias is None or bias.ndim > 1 or data_rank is None or data_rank < 2:
            continue
        if bias.size == 1 or data_rank >= 3:  # a [k] vector broadcasts over the last axis, dim 1 at rank 2
            return data
    if rank_a is None or rank_a < 2 or rank_a != rank_b or _constant(a) is not None or _constant(b) is not None:
        return None
    return a if _root(a) is _root(b) else None


def rank(value: ir.Value) -> int | None:
    """``value``'s rank: its annotated shape's, else the one ``_ranks`` read from the ops that make it, else
    None."""
    if value.shape is not None:
        return len(value.shape)
    return (_RANKS.get() or {}).get(id(value))


# Ops whose output 0 has their input 0's rank.
_SAME_RANK = frozenset({
    "Cast", "Identity", "Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Log", "Erf", "Tanh", "Sigmoid", "Relu",
    "Softmax", "Transpose", "Slice", "Split", "LayerNormalization", "Dropout",
})  # fmt: skip
_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min"})
_REDUCE = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2", "ReduceSumSquare"})
_MS_SAME_RANK = frozenset({
    "RotaryEmbedding", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "SkipLayerNormalization",
    "MatMulNBits", "FastGelu", "QuickGelu", "Gelu", "BiasGelu",
})  # fmt: skip
# Elementwise ops of one data input (output 0 has its shape), and ORT's norms over the last axis.
_UNARY = frozenset({
    "Cast", "Identity", "Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Log", "Erf", "Tanh", "Sigmoid", "Relu",
    "Softplus", "Gelu", "HardSigmoid", "Dropout",
})  # fmt: skip
_MS_NORMS = frozenset({
    "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "SkipLayerNormalization", "FastGelu",
    "QuickGelu", "Gelu", "BiasGelu",
})  # fmt: skip
_MAX_STEPS = 10_000
_ROOTS: contextvars.ContextVar[dict[int, tuple[ir.Value, ir.Value]] | None] = contextvars.ContextVar(
    "gqa_roots", default=None
)
_RANKS: contextvars.ContextVar[dict[int, int | None] | None] = contextvars.ContextVar("gqa_ranks", default=None)


def _ranks(graph: ir.Graph) -> dict[int, int | None]:
    """The rank of each node output that the ops alone fix, in one pass over the graph in order (by ``id``).

    Why: a merged decoder's branches reach the passes without value_info (``passes._subgraphs.standalone``),
    so no value there has a shape and no pair above could be proven (``head_reshapes_folded: 0`` in both
    branches). Ranks follow from the graph's inputs, which keep their declared shapes, and the constants: a
    Reshape's target has as many entries as its output has dims, a Gather's output rank(data) + rank(indices)
    - 1, a broadcast the largest of its inputs', a MatMul of two matrices or batches of them the larger, a
    reduction with keepdims its input's, the elementwise and layout ops (and ORT's norms and rotary) their
    input's. Anything else is left unknown, which proves nothing."""
    ranks: dict[int, int | None] = {}

    def of(value: ir.Value | None) -> int | None:
        if value is None:
            return None
        if value.shape is not None:
            return len(value.shape)
        if value.const_value is not None:
            return len(value.const_value.shape)
        return ranks.get(id(value))

    for node in graph:
        first = of(node.inputs[0]) if node.inputs else None
        got: int | None = None
        op = node.op_type
        if node.domain in _ONNX:
            if op == "Constant":
                array = _constant(node.outputs[0])
                got = array.ndim if array is not None else None
            elif op in _SAME_RANK:
                got = first
            elif op in _BROADCAST:
                known = [of(v) for v in node.inputs]
                got = max(known) if known and None not in known else None  # type: ignore[type-var]
            elif op in _REDUCE and node.attributes.get_int("keepdims", 1):
                got = first
            elif op == "MatMul" and len(node.inputs) == 2:
                other = of(node.inputs[1])
                got = max(first, other) if first is not None and other is not None and min(first, other) >= 2 else None
            elif op == "Gather" and len(node.inputs) == 2:
                indices = of(node.inputs[1])
                got = first + indices - 1 if first is not None and indices is not None else None
            elif _is_reshape(node):
                entries = _shape_entries(node.inputs[1], roots=False)
                got = len(entries) if entries is not None else None
        elif node.domain == "com.microsoft":
            if op in _MS_SAME_RANK:
                got = first
            elif op == "GroupQueryAttention":
                got = 3 if first == 3 else None
        for index, output in enumerate(node.outputs):
            if output.shape is not None:
                ranks[id(output)] = len(output.shape)
            elif index == 0 or op == "Split":  # every Split output has the input's rank; others' output 0 only
                ranks[id(output)] = got
    return ranks
