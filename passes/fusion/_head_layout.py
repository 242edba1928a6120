"""Where a head-first q/k/v comes from in [B,S,N,D] layout, without a Transpose (``fuse_gqa``'s inputs).

GroupQueryAttention takes q, k and v as [B,S,N*D]. ``_gqa_rewrite.flat_heads`` flattens a value that is
``Transpose(0,2,1,3)(x)`` straight from ``x``. Exports of a fused qkv projection put more between the head
Transpose and attention (GPT-NeoX: the per-head [N, 3*D] block split after the Transpose; Falcon: a Reshape
to the shape the value already has)::

    qkv[B,S,N*3D] --Reshape--> y[B,S,N,3D] --Transpose(0,2,1,3)--> [B,N,S,3D] --Slice/Split(axis 3)--> q[B,N,S,D]
    qkv[B,S,(N+2)D] --Reshape--> y[B,S,N+2,D] --Slice(axis 2)--> --Transpose(0,2,1,3)--> --Reshape(same)--> q

so the fused layer kept the export's Transpose and its own one back (4 per layer), and the Reshape pairs
around them. ``transposed_source`` reads such a value as ``Transpose(0,2,1,3)(x)`` with ``x`` [B,S,N,D]:

* a Slice or Split of a transposed value is the Transpose of the same Slice/Split of its source, on the
  axis the permutation maps it to; the new Slice/Split on ``y`` is made here (element for element the same
  values: a re-layout, exact). Dynamo's Falcon picks k and v as ``Transpose(1,0,2,3)(GatherND(
  Transpose(2,0,1,3)(y), [[i]]))``: a ``GatherND`` of one index on axis 0 is that axis' ``Slice(i, i+1)``,
  and Transposes in a row compose (here to (0,2,1,3));
* a Reshape is skipped where it provably gives back its input's shape (``is_identity``): every target entry
  is the input's own dim, read through the graph's arithmetic (``_dim``: Transposes, Slices and Splits by
  constant bounds, Gathers, Reshape entries), never from a shape annotation, at most one ``-1`` left over
  (the element count fixes it).

Then q, k and v are the [B,S,N,D] slices of ``y`` itself: each goes into GQA as ``Reshape(., [0,0,-1])`` and
no Transpose is left around attention.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.fusion._gqa_reshapes import _constant, _is_reshape, _root, _same_symbol, _shape_entries, rank

_ONNX = ("", "ai.onnx")
_HEADS_PERM = (0, 2, 1, 3)  # its own inverse
_MAX_DEPTH = 64

Dim = int | tuple[ir.Value, int]


def transposed_source(
    graph: ir.Graph, value: ir.Value, prefix: str, made: list[ir.Node], splits: dict
) -> ir.Value | None:
    """``x`` with ``value == Transpose(0,2,1,3)(x)``, making the Slice/Split on ``x`` that this needs (appended to
    ``made``; a Split made once per original, through ``splits``), or None. Nothing is made unless found.

    A ``Shape`` of ``value`` that reads only dims the permutation keeps (0 and 3: fuse_rotary's batch for its
    position ids, where the graph has none) then reads ``x``: otherwise it alone would keep the export's
    Transpose and Slices computed, for a shape."""
    walk = _Walk(graph, prefix, None, splits)
    dry = walk.source(value)
    if dry is not None and dry[1] == _HEADS_PERM:
        found = walk.build(made).source(value)[0]  # type: ignore[index]
    elif _heads_transpose(value.producer()):  # Transposes below that compose to another order: the last one's input
        found = value.producer().inputs[0]  # type: ignore[union-attr]
    else:
        return None
    for use in list(value.uses()):
        reader = use.node
        if reader.op_type != "Shape" or reader.domain not in _ONNX:
            continue
        start, end = reader.attributes.get_int("start", 0), reader.attributes.get_int("end", 4)
        kept = range(4)[slice(start, end)]
        if len(kept) and all(_HEADS_PERM[i] == i for i in kept):
            reader.replace_input_with(use.idx, found)
    return found


def _heads_transpose(node: ir.Node | None) -> bool:
    return (
        node is not None
        and node.op_type == "Transpose"
        and node.domain in _ONNX
        and tuple(node.attributes.get_ints("perm", [])) == _HEADS_PERM
    )


class _Walk:
    """Reads a value back to ``(x, perm)`` with ``value == Transpose(perm)(x)``, x of rank 4, through
    Transposes (composed), identity Reshapes, and Slices, Splits and single-index GatherNDs of a transposed
    value, each of which is the same op on x along the axis ``perm`` maps it to; with ``made`` set it makes
    those ops on x (else it only reads, and returns x as None)."""

    def __init__(self, graph: ir.Graph, prefix: str, made: list[ir.Node] | None, splits: dict) -> None:
        self.graph, self.prefix, self.made, self.splits = graph, prefix, made, splits

    def build(self, made: list[ir.Node]) -> _Walk:
        return _Walk(self.graph, self.prefix, made, self.splits)

    def source(self, value: ir.Value, depth: int = 0) -> tuple[ir.Value | None, tuple[int, ...]] | None:
        node = value.producer()
        if node is None or node.domain not in _ONNX or depth > _MAX_DEPTH or not node.inputs or not node.inputs[0]:
            return None
        data = node.inputs[0]
        if node.op_type == "Transpose":
            perm = tuple(node.attributes.get_ints("perm", []))
            if sorted(perm) != list(range(4)):
                return None
            inner = self.source(data, depth + 1)
            if inner is None:
                return data, perm
            return inner[0], tuple(inner[1][p] for p in perm)  # Transpose(perm)(Transpose(q)(x)): x's q[perm[j]]
        if _is_reshape(node) and is_identity(node):
            return self.source(data, depth + 1)
        if node.op_type == "Split":
            return self._split(node, value, depth)
        picked = _picked_axes(node)
        if picked is None:
            return None
        inner = self.source(data, depth + 1)
        if inner is None:
            return None
        x, perm = inner
        if self.made is None:
            return None, perm
        starts, ends, axes = picked
        mapped = np.array([perm[int(a) % 4] for a in axes], np.int64)
        bounds = [_const(self.graph, f"{self.prefix}/slice_{n}_{len(self.made)}", v) for n, v in
                  (("starts", starts), ("ends", ends), ("axes", mapped))]  # fmt: skip
        steps = list(node.inputs[4:5]) if node.op_type == "Slice" else []
        self.made.append(ir.node("Slice", [x, *bounds, *steps], name=f"{self.prefix}/slice_bsnh_{len(self.made)}"))
        return self.made[-1].outputs[0], perm

    def _split(self, node: ir.Node, value: ir.Value, depth: int) -> tuple[ir.Value | None, tuple[int, ...]] | None:
        index = list(node.outputs).index(value)
        if id(node) in self.splits:
            split, perm = self.splits[id(node)]
            return split.outputs[index], perm
        inner = self.source(node.inputs[0], depth + 1)
        if inner is None:
            return None
        x, perm = inner
        if self.made is None:
            return None, perm
        attributes = {a.name: a.value for a in node.attributes.values()}
        attributes["axis"] = perm[node.attributes.get_int("axis", 0) % 4]
        split = ir.node(
            "Split", [x, *node.inputs[1:]], attributes, num_outputs=len(node.outputs), name=f"{self.prefix}/split_bsnh"
        )
        self.made.append(split)
        self.splits[id(node)] = (split, perm)
        return split.outputs[index], perm


def _picked_axes(node: ir.Node) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(starts, ends, axes) of a constant Slice, or of a ``GatherND`` that picks one index of axis 0 (indices
    [[i]], dynamo's ``x[i]``, which keeps the axis as 1 long: ``Slice(i, i + 1)``); None for anything else."""
    if node.op_type == "Slice" and len(node.inputs) >= 4:
        arrays = [_constant(v) for v in node.inputs[1:4]]
        if any(a is None or a.ndim != 1 for a in arrays):
            return None
        return arrays[0], arrays[1], arrays[2]  # type: ignore[return-value]
    if node.op_type == "GatherND" and len(node.inputs) == 2 and not node.attributes.get_int("batch_dims", 0):
        indices = _constant(node.inputs[1])
        if indices is None or indices.shape != (1, 1) or indices.dtype.kind != "i":
            return None
        first = int(indices.reshape(-1)[0])
        end = np.iinfo(np.int64).max if first == -1 else first + 1
        return np.array([first], np.int64), np.array([end], np.int64), np.array([0], np.int64)
    return None


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    tensor = ir.tensor(array, name=name)
    value = ir.Value(name=name, const_value=tensor, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
    graph.register_initializer(value)
    return value


def is_identity(reshape: ir.Node) -> bool:
    """Whether the Reshape provably gives back its data input's shape: each target entry is that input's dim
    at its position (0 copying it, a constant equal to a dim fixed by constants, a dim read from a Shape that
    the graph proves the same), except at most one ``-1``, which the element count then fixes."""
    data = reshape.inputs[0]
    entries = _shape_entries(reshape.inputs[1])
    width = rank(data) if data is not None else None
    if data is None or entries is None or width is None or len(entries) != width:
        return False
    copies_zero = not reshape.attributes.get_int("allowzero", 0)
    free = 0
    for position, entry in enumerate(entries):
        if entry == 0 and copies_zero:
            continue
        if entry == -1:
            free += 1
            continue
        if entry is None or (isinstance(entry, int) and entry < 0):
            return False
        want = entry if isinstance(entry, int) else _dim(entry[0], entry[1])
        if not _same(want, _dim(data, position)):
            return False
    return free <= 1


def _same(a: Dim | None, b: Dim | None) -> bool:
    if a is None or b is None:
        return False
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    if a[0] is b[0] and a[1] == b[1]:
        return True
    # The leading dims of two graph inputs (a past's batch, the ids' length) are equal where the signature
    # names them so, as ``_gqa_reshapes`` accepts for its pairs.
    return a[1] in (0, 1) and b[1] in (0, 1) and _same_symbol(a, b[0], b[1])


def _dim(value: ir.Value, index: int, depth: int = 0) -> Dim | None:
    """Dim ``index`` of ``value``: an int where constants fix it, else ``(source, i)``, the earliest value and
    axis it provably equals; None when the rank is unknown."""
    width = rank(value)
    if width is None or not -width <= index < width:
        return None
    index %= width
    node = value.producer()
    if node is None or depth > _MAX_DEPTH:
        return _leading(value, index)
    step = _through(node, value, index)
    if step is None:
        return _leading(value, index)
    if isinstance(step, int):
        return step
    return _dim(step[0], step[1], depth + 1)


def _leading(value: ir.Value, index: int) -> Dim:
    return (_root(value), index) if index in (0, 1) else (value, index)


def _through(node: ir.Node, value: ir.Value, index: int) -> Dim | None:
    """One step of ``_dim`` back through ``node``: the input dim (or the constant) that dim ``index`` of its
    output ``value`` is, or None."""
    data = node.inputs[0] if node.inputs else None
    if data is None:
        return None
    if node.domain == "com.microsoft":
        return (data, index) if node.op_type == "RotaryEmbedding" else None
    if node.domain not in _ONNX:
        return None
    op = node.op_type
    if op == "Transpose":
        perm = list(node.attributes.get_ints("perm", [])) or list(range(rank(value) or 0))[::-1]
        return (data, perm[index]) if index < len(perm) else None
    if op == "Reshape" and _is_reshape(node):
        entries = _shape_entries(node.inputs[1])
        if entries is None or index >= len(entries):
            return None
        entry = entries[index]
        if isinstance(entry, int):
            if entry > 0:
                return entry
            return (data, index) if entry == 0 and not node.attributes.get_int("allowzero", 0) else None
        return entry
    if op == "Slice" and len(node.inputs) >= 4:
        return _through_slice(node, data, index)
    if op == "Split":
        return _through_split(node, value, data, index)
    if op == "Gather" and len(node.inputs) == 2:
        indices = _constant(node.inputs[1])
        width = rank(data)
        if indices is None or width is None:
            return None
        axis = node.attributes.get_int("axis", 0) % width
        if index < axis:
            return (data, index)
        if index < axis + indices.ndim:
            return int(indices.shape[index - axis])
        return (data, index - indices.ndim + 1)
    return None


def _through_slice(node: ir.Node, data: ir.Value, index: int) -> Dim | None:
    arrays = [_constant(v) for v in node.inputs[1:4]]
    steps = _constant(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    width = rank(data)
    if any(a is None for a in arrays) or width is None:
        return None
    starts, ends, axes = (a.reshape(-1).tolist() for a in arrays)  # type: ignore[union-attr]
    axes = [int(a) % width for a in axes]
    if index not in axes:
        return (data, index)
    size = _dim(data, index)
    if not isinstance(size, int):
        return None
    at = axes.index(index)
    step = int(steps.reshape(-1)[at]) if steps is not None else 1
    if step <= 0:
        return None
    return len(range(size)[slice(int(starts[at]), int(ends[at]), step)])  # ONNX's clamping for step > 0


def _through_split(node: ir.Node, value: ir.Value, data: ir.Value, index: int) -> Dim | None:
    width = rank(data)
    if width is None:
        return None
    if index != node.attributes.get_int("axis", 0) % width:
        return (data, index)
    position = list(node.outputs).index(value)
    sizes = _constant(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if sizes is None and "split" in node.attributes:  # opset < 13 gives the sizes as an attribute
        sizes = np.array(node.attributes.get_ints("split", []), np.int64)
    if sizes is not None:
        return int(sizes.reshape(-1)[position])
    total, parts = _dim(data, index), len(node.outputs)
    return total // parts if isinstance(total, int) and total % parts == 0 else None
