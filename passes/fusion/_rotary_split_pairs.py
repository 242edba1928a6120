"""Matching rope written as ``Concat(x1*c - x2*s, x2*c + x1*s)`` with one angle per pair, for fuse_rotary
(issues 17/19: DeepSeek's MLA, GPT-OSS).

transformers' ``apply_rotary_pos_emb_interleave`` (DeepSeek-V2/V3's MLA, on the 64-wide rope slice of each head)
rotates the pairs (2i, 2i+1) of x but writes the result de-interleaved, evens first::

    x1, x2 = x[..., 0::2], x[..., 1::2]            # strided Slices
    y = Concat(x1 * c - x2 * s, x2 * c + x1 * s)     # c, s: the first half of cos/sin, one angle per pair

That is ``com.microsoft::RotaryEmbedding(interleaved=0)`` of ``Concat(x1, x2)``: the halves order the rotated
key is cached in, so it is kept (``RotaryEmbedding(interleaved=1)`` of x would put the pairs back together).
GPT-OSS's ``_apply_rotary_emb`` writes the same expression over ``torch.chunk(x, 2, dim=-1)``, the contiguous
halves (two Slices from TorchScript, one two-way Split from dynamo): ``RotaryEmbedding(interleaved=0)`` of x
itself, the rotate-half rope with a half-width cache (``Parts.halves``). OpenAI's privacy filter writes the
pairs back in place, ``stack((x1*c - x2*s, x2*c + x1*s), -1).flatten(-2)`` over the even and odd channels
(``Parts.stacked``): ``RotaryEmbedding(interleaved=1)`` of x.
c and s are read as the interleaved probe reads its factors (``_rotary_interleaved_probe``): run once at one
row of the cache's length, their rows are the cache, then the whole rotation is checked on its own values at
other shapes (``check``) before anything is rewritten.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from passes.fusion._rotary_eval import int_attr, one_int
from passes.fusion._rotary_interleaved import (
    Candidate,
    NotInterleaved,
    _data_cone,
    _depends_on,
    _positions,
    _producer,
    _stacked,
    _strided,
    _table_rows,
)

_SHAPE_ONLY = frozenset({"Shape", "Size"})


def _products(node: ir.Node | None) -> tuple[tuple[ir.Value, ir.Value], tuple[ir.Value, ir.Value]] | None:
    """((a, b), (c, d)) of ``op(Mul(a, b), Mul(c, d))``, each Mul's operands in both orders tried by the caller."""
    if node is None or len(node.inputs) != 2:
        return None
    muls = [_producer(v, "Mul") for v in node.inputs]
    if muls[0] is None or muls[1] is None or muls[0] is muls[1]:
        return None
    a, b = muls[0].inputs
    c, d = muls[1].inputs
    if a is None or b is None or c is None or d is None:
        return None
    return (a, b), (c, d)


def _other(pair: tuple[ir.Value, ir.Value], value: ir.Value) -> ir.Value | None:
    return pair[1] if pair[0] is value else pair[0] if pair[1] is value else None


class Parts(NamedTuple):
    """``Concat(x1*c - x2*s, x2*c + x1*s, axis=-1)`` read: x1/x2 are x's even and odd channels, or its first and
    second halves (``halves``); or the two stacked on a new last axis and flattened back (``stacked``, even and
    odd channels only); ``nodes`` are the rotation's, its cuts included."""

    x: ir.Value
    x1: ir.Value
    x2: ir.Value
    c: ir.Value
    s: ir.Value
    nodes: list[ir.Node]
    halves: bool
    stacked: bool = False


def looks_split_pairs(anchor: ir.Node) -> bool:
    return (
        anchor.op_type in ("Concat", "Reshape") and anchor.domain in ("", "ai.onnx") and split_parts(anchor) is not None
    )


def _last_axis_cut(node: ir.Node | None) -> ir.Value | None:
    """The data of a unit-step ``Slice`` on the last axis of a rank-4 tensor, else None. Where it starts and ends
    is not read (TorchScript computes chunk's bounds from the shape): ``check`` proves the halves on values."""
    if node is None or node.op_type != "Slice" or len(node.inputs) < 4:
        return None
    axes = one_int(node.inputs[3], {})
    steps = one_int(node.inputs[4], {}) if len(node.inputs) > 4 and node.inputs[4] is not None else 1
    return node.inputs[0] if axes in (-1, 3) and steps == 1 else None


def _halves(x1: ir.Value, x2: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, the cutting nodes) where x1 and x2 are the two outputs of one ``Split(x, axis=-1)`` or two unit-step
    Slices of x on its last axis."""
    split = _producer(x1, "Split")
    if split is not None and x2.producer() is split and len(split.outputs) == 2:
        if int_attr(split, "axis", 0) in (-1, 3) and list(split.outputs) == [x1, x2] and split.inputs[0] is not None:
            return split.inputs[0], [split]
        return None
    first, second = _producer(x1, "Slice"), _producer(x2, "Slice")
    x = _last_axis_cut(first)
    if x is None or x is not _last_axis_cut(second) or first is second:
        return None
    return x, [first, second]  # type: ignore[list-item]


def _cut(x1: ir.Value, x2: ir.Value) -> tuple[ir.Value, list[ir.Node], bool] | None:
    even, odd = _producer(x1, "Slice"), _producer(x2, "Slice")
    x = _strided(even, 0)
    if x is not None and x is _strided(odd, 1):
        return x, [even, odd], False  # type: ignore[list-item]
    halves = _halves(x1, x2)
    return None if halves is None else (*halves, True)


def split_parts(anchor: ir.Node) -> Parts | None:
    """``Concat(x1*c - x2*s, x2*c + x1*s, axis=-1)``, x1/x2 the even/odd channels or the halves, read; or
    ``Reshape(stack((x1*c - x2*s, x2*c + x1*s), -1))`` of the even/odd channels."""
    if anchor.op_type == "Reshape":
        stacked = _stacked(anchor.outputs[0])
        if stacked is None:
            return None
        first, second, joins = stacked
        found = _pairs(_producer(first, "Sub"), _producer(second, "Add"), [*joins])
        return found._replace(stacked=True) if found is not None and not found.halves else None
    if anchor.op_type != "Concat" or len(anchor.inputs) != 2 or int_attr(anchor, "axis", 0) not in (-1, 3):
        return None
    return _pairs(_producer(anchor.inputs[0], "Sub"), _producer(anchor.inputs[1], "Add"), [anchor])


def _pairs(sub: ir.Node | None, add: ir.Node | None, joins: list[ir.Node]) -> Parts | None:
    """x1*c - x2*s and x2*c + x1*s read, ``joins`` the nodes that put them together."""
    minus, plus = _products(sub), _products(add)
    if sub is None or add is None or minus is None or plus is None:
        return None
    for x1 in minus[0]:
        c = _other(minus[0], x1)
        for x2 in minus[1]:
            s = _other(minus[1], x2)
            cut = _cut(x1, x2)
            if cut is None or c is None or s is None:
                continue
            if _other(plus[0], x2) is not c and _other(plus[1], x2) is not c:
                continue
            if _other(plus[0], x1) is not s and _other(plus[1], x1) is not s:
                continue
            muls = [p for v in (*sub.inputs, *add.inputs) if (p := v.producer()) is not None]  # type: ignore[union-attr]
            x, cuts, halves = cut
            return Parts(x, x1, x2, c, s, [*joins, sub, add, *muls, *cuts], halves)  # type: ignore[list-item]
    return None


def candidate(anchor: ir.Node, graph: ir.Graph) -> Candidate:
    """The rotation ending at ``anchor`` (unverified); ``rotated`` is its output, checked whole by ``check``."""
    found = split_parts(anchor)
    if found is None:
        raise NotInterleaved("not Concat(x1*c - x2*s, x2*c + x1*s) of x's even and odd channels or its halves")
    x, c, s, nodes = found.x, found.c, found.s, found.nodes
    if x.dtype is not None and x.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        raise NotInterleaved(f"{x.name} is {x.dtype}; RotaryEmbedding takes float or float16")
    if _depends_on([c, s], x):
        raise NotInterleaved("cos or sin is computed from the rotated tensor itself")
    cone = _data_cone([c, s])
    positions = _positions(cone, list(graph.inputs))
    cone_nodes = [n for n in cone if n.op_type not in _SHAPE_ONLY]
    return Candidate(anchor, x, x, anchor.outputs[0], c, s, positions, _table_rows(cone), (*nodes, *cone_nodes))


def rows(found: Candidate, got: dict[str, np.ndarray], count: int) -> tuple[np.ndarray, np.ndarray]:
    """The cache: c and s at positions 0..count-1, one angle per pair already."""
    tables = []
    for op, value in (("cos", found.cos), ("sin", found.sin)):
        factor = got[str(value.name)]
        width = factor.shape[-1] if factor.ndim else 0
        if factor.size != count * width or not width:
            raise NotInterleaved(f"{op} is {list(factor.shape)} at {count} positions, not one row per position")
        tables.append(np.ascontiguousarray(factor.reshape(count, width).astype(np.float32)))
    return tables[0], tables[1]


def expected(
    x: np.ndarray, cos: np.ndarray, sin: np.ndarray, halves: bool = False, stacked: bool = False
) -> np.ndarray:
    """What the rotation must compute, from x and the cache rows broadcast as the graph's factors are."""
    half = x.shape[-1] // 2
    x1, x2 = (x[..., :half], x[..., half:]) if halves else (x[..., 0::2], x[..., 1::2])
    first, second = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if stacked:
        return np.stack([first, second], axis=-1).reshape(x.shape)
    return np.concatenate([first, second], axis=-1)


def check(found: Candidate, got: dict[str, np.ndarray], tables: tuple[np.ndarray, np.ndarray], seq: int, atol: float):
    """(rotary_dim, heads) once the factors are the cache rows of their positions, broadcast over the heads of a
    [B, N, S, D] x, and the output is ``expected`` of them; NotInterleaved with the first difference otherwise."""
    x, y = got[str(found.x.name)], got[str(found.rotated.name)]
    if x.ndim != 4 or x.shape[2] != seq or x.shape[-1] != 2 * tables[0].shape[1] or y.shape != x.shape:
        raise NotInterleaved(f"x {list(x.shape)} is not [batch, heads, {seq}, {2 * tables[0].shape[1]}]")
    positions = np.arange(seq) if found.positions is None else got[str(found.positions.name)]
    positions = positions.astype(np.int64).reshape(-1, seq)
    if positions.min() < 0 or positions.max() >= tables[0].shape[0]:
        raise NotInterleaved(f"positions beyond the cache's {tables[0].shape[0]} rows")
    factors = []
    for op, value, table in (("cos", found.cos, tables[0]), ("sin", found.sin, tables[1])):
        factor, want = got[str(value.name)], table[positions][:, None]  # [B, 1, S, D/2]
        if factor.ndim != 4 or factor.shape[1] != 1:
            raise NotInterleaved(f"{op} is {list(factor.shape)}, not [batch, 1, {seq}, {table.shape[1]}]")
        try:
            shape = np.broadcast_shapes(want.shape, factor.shape)
        except ValueError:
            raise NotInterleaved(f"{op} {list(factor.shape)} is not per position {list(positions.shape)}") from None
        if not np.abs(np.broadcast_to(factor, shape) - np.broadcast_to(want, shape)).max() <= atol:
            raise NotInterleaved(f"{op} differs from its cache row at its position")
        factors.append(np.broadcast_to(want, (x.shape[0], 1, seq, table.shape[1])))
    parts = split_parts(found.anchor)
    halves, stacked = (parts.halves, parts.stacked) if parts is not None else (False, False)
    want = expected(x.astype(np.float32), *factors, halves=halves, stacked=stacked)
    # a half-precision graph rounds each product and the sum: a few units in the last place of the largest value
    tolerance = 10 * atol + (8 * float(np.finfo(y.dtype).eps) * float(np.abs(x).max()) if y.itemsize < 4 else 0.0)
    if not np.abs(y.astype(np.float32) - want).max() <= tolerance:
        raise NotInterleaved("the output is not Concat(x1*cos - x2*sin, x2*cos + x1*sin) of the cache rows")
    return int(x.shape[-1]), int(x.shape[1])


def separate(graph: ir.Graph) -> None:
    """``Concat(..., x1*c - x2*s, x2*c + x1*s)`` (TorchScript joins DeepSeek's ``cat((q_pass, q_rot))`` with the
    rotation's own cat) as ``Concat(..., Concat(x1*c - x2*s, x2*c + x1*s))``: the same values, the rotation then
    the output of one node, as RotaryEmbedding's is."""
    for node in list(graph):
        if node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 3:
            continue
        axis = int_attr(node, "axis", 0)
        rank = len(node.outputs[0].shape) if node.outputs[0].shape is not None else 4
        if axis not in (-1, rank - 1) or rank != 4:
            continue
        inner = ir.node("Concat", list(node.inputs[-2:]), {"axis": -1}, name=f"{node.name}/rotary_pair_halves")
        if split_parts(inner) is None:
            continue
        graph.insert_before(node, inner)
        inner.outputs[0].name = f"{node.name}/rotary_pair_halves_0"
        outer = ir.node("Concat", [*node.inputs[:-2], inner.outputs[0]], {"axis": axis}, name=node.name)
        graph.insert_before(node, outer)
        if node.outputs[0].type is not None:  # TorchScript leaves it untyped: ORT infers it
            outer.outputs[0].type, inner.outputs[0].dtype = node.outputs[0].type, node.outputs[0].dtype
        outer.outputs[0].shape = node.outputs[0].shape
        old = node.outputs[0]
        outer.outputs[0].name, old.name = old.name, f"{old.name}/separated"
        if old.is_graph_output():
            graph.outputs[list(graph.outputs).index(old)] = outer.outputs[0]
        ir.convenience.replace_all_uses_with(old, outer.outputs[0])
        graph.remove(node, safe=True)
