"""Matching an interleaved ("GPT-J style", ``rotate_every_two``) rotary embedding for fuse_rotary.

GPT-J, Cohere and RoFormer rotate each pair of adjacent channels (2i, 2i+1) of a head, where Llama rotates
channel i with i + D/2. The three exporters write the rotation itself alike, per q and per k::

    rotated = Add(Mul(x, cos), Mul(Reshape(Concat(Unsqueeze(Neg(Slice(x, 1::2)), -1),
                                                  Unsqueeze(Slice(x, 0::2), -1), axis=-1)), sin))

(``torch.stack((-x2, x1), -1).flatten(-2)``), with GPT-J's partial form ``Concat(rotated(q[..., :r]),
q[..., r:], axis=-1)``. That is ``com.microsoft::RotaryEmbedding(interleaved=1)``: out[2i] = x[2i] cos_i -
x[2i+1] sin_i, out[2i+1] = x[2i+1] cos_i + x[2i] sin_i, when cos[..., 2i] = cos[..., 2i+1] = cos_i.

The cos/sin factors, though, are written a different way by every model and exporter: a sin|cos table
gathered with ``GatherElements`` from a batch-tiled copy (GPT-J), ``repeat_interleave`` of the angles before
Cos/Sin (Cohere), a chunked sinusoidal embedding stacked with itself (RoFormer), with ``Tile``, ``Expand``,
``Reshape`` and shape arithmetic in between. Rather than trace each form, this reads what they compute: the
cache rows are the factors themselves, run (their subgraph alone, pruned from the model) at one row of
``rows`` positions, and the match is then checked on its own values at other shapes and positions (``probe``):
the rotated input must be ``rotate_every_two(x)`` exactly and each factor the cache row of its position,
repeated pairwise, or the candidate is declined with the first difference. What the structure gives: the
rotation's nodes, x, and the positions the factors are a function of (a ``position_ids`` input, or the
model's own ``Range``), which RotaryEmbedding is fed at run time.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from passes.fusion._rotary_eval import SLICE_TO_END, const, int_attr, one_int

_ONNX = ("", "ai.onnx")
# Ops whose output depends only on their input's shape: the factors' data never flows through them.
_SHAPE_ONLY = frozenset({"Shape", "Size"})
# Layout ops a gathered table passes through before its Gather (GPT-J's batch-tiled copy).
_TABLE_LAYOUT = frozenset({"Expand", "Tile", "Cast", "Identity", "Unsqueeze", "Squeeze"})


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A structural match: the rotation's nodes, what it rotates and the factors it multiplies by."""

    anchor: ir.Node  # the Add, or the partial form's Concat with the channels left as they are
    x: ir.Value  # the channels rotated, [B, N, S, r] or [B, S, N, r]
    q: ir.Value  # what RotaryEmbedding rotates: x, or the whole head x was sliced from (partial)
    rotated: ir.Value  # rotate_every_two(x) as the graph computes it
    cos: ir.Value
    sin: ir.Value
    positions: ir.Value | None  # an integer input [B, S], a Range output [S]; None: rows 0..S-1 (Slice of a table)
    table_rows: int | None  # rows of a constant table the factors gather from (positions beyond it fail)
    nodes: tuple[ir.Node, ...]  # the rotation's and the factors' nodes, candidates for removal


class NotInterleaved(Exception):
    """A candidate that does not fuse; the message is the reason the report shows."""


def _producer(value: ir.Value | None, *ops: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.domain not in _ONNX or node.op_type not in ops:
        return None
    return node


def _strided(node: ir.Node | None, start: int) -> ir.Value | None:
    """The data of ``Slice(data, start::2)`` on the last axis of a rank-4 tensor, else None."""
    if node is None or len(node.inputs) != 5:
        return None
    begin, end, axes, steps = (one_int(v, {}) for v in node.inputs[1:])
    if begin != start or steps != 2 or end is None or end < SLICE_TO_END or axes not in (-1, 3):
        return None
    return node.inputs[0]


def _stacked(value: ir.Value | None) -> tuple[ir.Value, ir.Value, list[ir.Node]] | None:
    """(first, second) of ``Unsqueeze(first, -1)``, ``Unsqueeze(second, -1)`` joined on that new last axis
    (``torch.stack(..., -1)``) and flattened back by a Reshape."""
    reshape = _producer(value, "Reshape")
    concat = _producer(reshape.inputs[0], "Concat") if reshape else None
    if reshape is None or concat is None or len(concat.inputs) != 2 or int_attr(concat, "axis", 0) not in (-1, 4):
        return None
    parts = [_producer(v, "Unsqueeze") for v in concat.inputs]
    if parts[0] is None or parts[1] is None:
        return None
    for part in parts:
        axes = const(part.inputs[1]) if len(part.inputs) > 1 else None
        if axes is None or axes.size != 1 or int(axes.reshape(())) not in (-1, 4):
            return None
    first, second = parts[0].inputs[0], parts[1].inputs[0]
    assert first is not None and second is not None
    return first, second, [reshape, concat, parts[0], parts[1]]


def _rotation(add: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value, list[ir.Node]] | None:
    """(x, rotate_every_two(x), cos, sin, nodes) of ``Add(Mul(x, cos), Mul(rotate_every_two(x), sin))``."""
    if add.op_type != "Add" or add.domain not in _ONNX or len(add.inputs) != 2:
        return None
    muls = [_producer(v, "Mul") for v in add.inputs]
    if muls[0] is None or muls[1] is None or muls[0] is muls[1]:
        return None
    for plain, rotating in ((muls[0], muls[1]), (muls[1], muls[0])):
        for i in (0, 1):
            stacked = _stacked(rotating.inputs[i])
            if stacked is None:
                continue
            first, second, nodes = stacked
            neg = _producer(first, "Neg")
            odd = _strided(_producer(neg.inputs[0], "Slice"), 1) if neg else None
            even = _strided(_producer(second, "Slice"), 0)
            if odd is None or odd is not even or odd not in plain.inputs:
                continue
            x = odd
            cos = plain.inputs[1] if plain.inputs[0] is x else plain.inputs[0]
            sin = rotating.inputs[1 - i]
            assert neg is not None and cos is not None and sin is not None
            slices = [neg.inputs[0].producer(), second.producer()]  # type: ignore[union-attr]
            nodes += [add, plain, rotating, neg, *(s for s in slices if s is not None)]
            return x, rotating.inputs[i], cos, sin, nodes  # type: ignore[return-value]
    return None


def looks_interleaved(add: ir.Node) -> bool:
    """An Add of ``x * cos`` and ``stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2) * sin``."""
    return _rotation(add) is not None


def _data_cone(values: list[ir.Value]) -> list[ir.Node]:
    """The nodes ``values`` are computed from, not following the inputs of shape-only ops (a Shape of the
    hidden states that sizes a Reshape is no data of the factors)."""
    seen: dict[ir.Node, None] = {}
    stack = [p for v in values if (p := v.producer()) is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen[node] = None
        if node.op_type in _SHAPE_ONLY and node.domain in _ONNX:
            continue
        stack += [p for v in node.inputs if v is not None and (p := v.producer()) is not None]
    return list(seen)


def _depends_on(values: list[ir.Value], target: ir.Value) -> bool:
    """Whether any of ``values`` is computed from ``target``'s data."""
    return any(target in n.inputs for n in _data_cone(values)) or target in values


def _table_rows(cone: list[ir.Node]) -> int | None:
    """Rows of the constant tables the cone gathers from (positions axis second-last): the most positions the
    factors can be computed for, and so the cache's rows (a position past them fails in the original too).
    Dynamo writes CodeGen's ``embed_positions[position_ids]`` as a ``GatherND``."""
    rows = []
    for node in cone:
        if node.op_type not in ("Gather", "GatherElements", "GatherND", "Slice") or node.domain not in _ONNX:
            continue
        data = node.inputs[0]
        while (layout := _producer(data, *_TABLE_LAYOUT)) is not None:
            data = layout.inputs[0]
        table = const(data)
        if table is not None and table.ndim >= 2 and table.dtype.kind == "f":
            rows.append(int(table.shape[-2]))
    return min(rows) if rows else None


def _positions(cone: list[ir.Node], graph_inputs: list[ir.Value]) -> ir.Value | None:
    """The integer values the factors are a function of: a graph input read as data (position_ids), else the
    model's one ``Range`` (arange(past, past + S), shared by the batch), else None where neither is there: the
    factors then depend on the sequence length alone (``range_gather_to_slice`` made ``Gather(table,
    arange(S))`` a ``Slice(table, 0, S)``), rows 0..S-1 as the probe checks."""
    read = {v for n in cone if n.op_type not in _SHAPE_ONLY for v in n.inputs if v is not None}
    inputs = [v for v in graph_inputs if v in read and v.dtype in (ir.DataType.INT64, ir.DataType.INT32)]
    if len(inputs) == 1:
        return inputs[0]
    if len(inputs) > 1:
        raise NotInterleaved(f"cos/sin read several integer inputs ({', '.join(str(v.name) for v in inputs)})")
    ranges = [n for n in cone if n.op_type == "Range" and n.domain in _ONNX]
    if len(ranges) > 1:
        raise NotInterleaved(f"cos/sin come from {len(ranges)} Range nodes and no position_ids input, not one")
    return ranges[0].outputs[0] if ranges else None


def _slice_args(node: ir.Node) -> tuple[int | None, ...]:
    """(start, end, axis, step) of a Slice with constant arguments (None where one is not constant)."""
    args = [one_int(v, {}) if v is not None else None for v in node.inputs[1:5]]
    args += [None] * (4 - len(args))
    if len(node.inputs) < 5 or node.inputs[4] is None:
        args[3] = 1
    return tuple(args)


def _partial(add: ir.Node, x: ir.Value, graph_outputs: set[ir.Value]) -> tuple[ir.Node, ir.Value, list[ir.Node]]:
    """``Concat(rotated(q[..., :r]), q[..., r:], axis=-1)`` around the rotation (GPT-J's rotary_dim): (that
    Concat, q, its nodes); else (add, x, [])."""
    outer = _producer(x, "Slice")
    users = add.outputs[0].uses()
    wrapper = users[0].node if len(users) == 1 and add.outputs[0] not in graph_outputs else None
    if outer is None or wrapper is None or wrapper.op_type != "Concat" or wrapper.domain not in _ONNX:
        return add, x, []
    rest = _producer(wrapper.inputs[1], "Slice") if len(wrapper.inputs) == 2 else None
    if wrapper.inputs[0] is not add.outputs[0] or rest is None or int_attr(wrapper, "axis", 0) not in (-1, 3):
        return add, x, []
    q = outer.inputs[0]
    (start, split, axis, step), (begin, end, rest_axis, rest_step) = _slice_args(outer), _slice_args(rest)
    if rest.inputs[0] is not q or axis not in (-1, 3) or rest_axis not in (-1, 3) or step != 1 or rest_step != 1:
        return add, x, []
    if start != 0 or split is None or begin != split or end is None or end < SLICE_TO_END:
        return add, x, []
    assert q is not None
    return wrapper, q, [wrapper, outer, rest]


def candidate(add: ir.Node, graph: ir.Graph, graph_outputs: set[ir.Value]) -> Candidate:
    """The interleaved rotation ending at ``add``, unverified; NotInterleaved with the reason otherwise."""
    found = _rotation(add)
    if found is None:
        raise NotInterleaved("not Add(Mul(x, cos), Mul(rotate_every_two(x), sin))")
    x, rotated, cos, sin, nodes = found
    if x.dtype is not None and x.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        raise NotInterleaved(f"{x.name} is {x.dtype}; RotaryEmbedding takes float or float16")
    if _depends_on([cos, sin], x):
        raise NotInterleaved("cos or sin is computed from the rotated tensor itself")
    cone = _data_cone([cos, sin])
    positions = _positions(cone, list(graph.inputs))
    anchor, q, around = _partial(add, x, graph_outputs)
    cone_nodes = [n for n in cone if n.op_type not in _SHAPE_ONLY]
    return Candidate(anchor, x, q, rotated, cos, sin, positions, _table_rows(cone), (*nodes, *around, *cone_nodes))


def rotate_every_two(x: np.ndarray) -> np.ndarray:
    """``torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)``, the rotation the candidate must compute."""
    return np.stack((-x[..., 1::2], x[..., ::2]), axis=-1).reshape(x.shape)
