"""Matching a decoder's rotate-half rotary embedding for fuse_rotary; the graph is never edited here.

transformers' ``apply_rotary_pos_emb`` (Llama, Qwen2, Mistral, Phi-3, Gemma...) as the TorchScript exporter
(eager and SDPA attention) and the dynamo exporter write it, per q and per k::

    cos = Unsqueeze(c, 1)   c = [Cast] [Mul(., attention_scaling)] Cos(emb)       emb = Concat(f, f, axis=-1)
    sin = Unsqueeze(s, 1)   s = [Cast] [Mul(., attention_scaling)] Sin(emb)
        f = Mul(Cast(Unsqueeze(position_ids, -1)), inv_freq)                                 (transformers >= 4.5x)
          | Transpose(MatMul([Expand] inv_freq[None, :, None], Cast(Unsqueeze(position_ids, 1))), [0, 2, 1])
    or  c = Gather(cos_cached, position_ids)        (older models: a folded cos/sin table, [max_pos, rotary_dim])
        position_ids: a [batch, sequence] input, or the model's own 1-D arange unsqueezed on [0, -1] (shared)
    or  cos = Slice(cos_cached, 0:S, axis -2)          (code written without transformers: a constant table
                                                        [max_pos, rotary_dim], or [1, 1, max_pos, rotary_dim],
                                                        cut to the sequence and broadcast; no positions at all)
    or  c = Concat(h, h, axis=-1)                      (per token: h [batch, sequence, rotary_dim/2] computed
                                                        any way, e.g. Qwen2-VL's M-RoPE gathering each section's
                                                        angles from its own row of position_ids [3, B, S])

    rotated = Add(Mul(x, cos), Mul(Concat(Neg(Slice(x, h:)), Slice(x, :h), axis=-1), sin))     h = rotary_dim / 2

and Phi-3's partial form (``partial_rotary_factor``) rotates ``x = Slice(q, :rotary_dim)`` then
``Concat(rotated, Slice(q, rotary_dim:), axis=-1)``. Heads are on axis 1 (the ``Unsqueeze(c, 1)``), the BNSH
layout ``com.microsoft::RotaryEmbedding`` takes in 4-D, or on axis 2 (``Unsqueeze(c, 2)``: Gemma 3n rotates
[B, S, N, D] before its head transpose), which goes to the kernel flat with its head count (``bsnd``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

import numpy as np
import onnx_ir as ir

from passes.fusion._rotary_eval import (
    SLICE_TO_END,
    Hints,
    axes_of,
    const,
    heads_of_split,
    int_attr,
    ints_attr,
    one_int,
    scalar,
)
from passes.fusion._rotary_interleaved import _producer

_ONNX = ("", "ai.onnx")
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


class Declined(Exception):
    """A rotary candidate that does not fuse; the message is the reason the report shows."""


@dataclasses.dataclass(frozen=True)
class CosSin:
    """Where one cos or sin factor comes from."""

    kind: Literal["inv_freq", "table", "per_token"]
    positions: ir.Value | None  # int64 [batch, sequence], [sequence] where shared; None: rows 0..S-1 of a table
    # inv_freq [rotary_dim/2], or the folded table's first half [max_positions, rotary_dim/2]; per_token: empty
    # (the rows are ``rows``, computed in the graph)
    values: np.ndarray
    scale: float  # attention_scaling (1 for default rope)
    nodes: tuple[ir.Node, ...]
    shared: bool = False  # 1-D positions the whole batch shares (the model's own arange)
    # without positions: the table cut to the sequence (its rows must be x's); per_token: the computed first half
    # [batch, sequence, rotary_dim/2] that Concat(half, half) doubled
    rows: ir.Value | None = None
    heads_axis: int = 1  # where the factor is unsqueezed: 1 for [B, N, S, D], 2 for [B, S, N, D] (Gemma 3n)


@dataclasses.dataclass(frozen=True)
class RotaryMatch:
    anchor: ir.Node  # its output is what RotaryEmbedding replaces: the Add, or the partial form's Concat
    x: ir.Value  # RotaryEmbedding's input, [batch, heads, sequence, head_size]
    rotary_dim: int
    partial: bool  # rotary_dim may be below x's head size: RotaryEmbedding needs rotary_embedding_dim, num_heads
    num_heads: int | None
    cos: CosSin
    sin: CosSin
    nodes: tuple[ir.Node, ...]  # every matched node, for cleaning up the dead ones
    interleaved: bool = False  # pairs (2i, 2i+1) rotate together (GPT-J's rotate_every_two), not (i, i + r/2)
    bsnd: bool = False  # x is [batch, sequence, heads, head_size] (GPT-J rotates before its head transpose)


def looks_rotary(add: ir.Node) -> bool:
    """An Add of two Muls, one fed a Concat(Neg(.), .): what a rotary candidate looks like before checking."""
    return _rotate_half_mul(add) is not None


def _rotate_half_mul(add: ir.Node) -> tuple[ir.Node, ir.Node, ir.Node, bool] | None:
    """(plain Mul, rotated Mul, rotate_half Concat, flipped) of ``Add(Mul(x, cos), Mul(rotate_half(x), sin))``:
    ``rotate_half`` is ``Concat(-x2, x1)``, or flipped, ``Concat(x2, -x1)`` (NanoChat's: the rotation by -angle,
    which is the usual one with sin negated)."""
    if add.op_type != "Add" or add.domain not in _ONNX or len(add.inputs) != 2:
        return None
    muls = [_producer(v, "Mul") for v in add.inputs]
    if muls[0] is None or muls[1] is None:
        return None
    for plain, rotated in ((muls[0], muls[1]), (muls[1], muls[0])):
        for v in rotated.inputs:
            concat = _producer(v, "Concat")
            if concat is None or len(concat.inputs) != 2:
                continue
            negated = [_producer(part, "Neg") is not None for part in concat.inputs]
            if negated[0] != negated[1]:
                return plain, rotated, concat, negated[1]
    return None


def _slice(node: ir.Node | None, hints: Hints) -> tuple[ir.Value, int | None, int | None] | None:
    """(data, start, end) of a step-1 Slice on the last axis of a rank-4 tensor; None if it is not one."""
    if node is None or len(node.inputs) < 3:
        return None
    axes = node.inputs[3] if len(node.inputs) > 3 else None
    steps = node.inputs[4] if len(node.inputs) > 4 else None
    if axes is None or one_int(axes, hints) not in (-1, 3):
        return None
    if steps is not None and one_int(steps, hints) != 1:
        return None
    data = node.inputs[0]
    assert data is not None
    return data, one_int(node.inputs[1], hints), one_int(node.inputs[2], hints)


def _positions(value: ir.Value | None, axis: tuple[int, ...], nodes: list[ir.Node]) -> tuple[ir.Value, bool]:
    """position_ids behind ``Cast(Unsqueeze(p, axis))`` (either order), and whether p is 1-D ``[sequence]``
    (a model computing ``arange(S)`` itself, unsqueezed on ``[0, axis]``), shared by the whole batch."""
    cast = _producer(value, "Cast")
    unsqueeze = _producer(cast.inputs[0] if cast else value, "Unsqueeze")
    if unsqueeze is None:
        raise Declined("the angle's positions are not Cast(Unsqueeze(position_ids))")
    axes = axes_of(unsqueeze)
    shared = axes in [[0, a] for a in axis]
    if axes not in [[a] for a in axis] and not shared:
        raise Declined(f"position_ids unsqueezed on axes {axes}, not {list(axis)}")
    nodes += [n for n in (cast, unsqueeze) if n is not None]
    inner = unsqueeze.inputs[0]
    if cast is None:
        cast = _producer(inner, "Cast")
        if cast is None:
            raise Declined("the angle's positions are never cast to float")
        nodes.append(cast)
        inner = cast.inputs[0]
    assert inner is not None
    if inner.dtype not in (None, ir.DataType.INT64, ir.DataType.INT32):
        raise Declined(f"positions {inner.name} are {inner.dtype}, not integers")
    rank = 1 if shared else 2
    if inner.shape is not None and len(inner.shape) != rank:
        raise Declined(f"positions {inner.name} have rank {len(inner.shape)}, not {rank}")
    return inner, shared


def _angles(emb: ir.Value | None, nodes: list[ir.Node]) -> tuple[tuple[ir.Value, bool], np.ndarray]:
    """(position_ids, inv_freq) of ``emb = Concat(f, f)``, ``f = positions * inv_freq``."""
    concat = _producer(emb, "Concat")
    if concat is None or len(concat.inputs) != 2 or concat.inputs[0] is not concat.inputs[1]:
        raise Declined("cos/sin's angle is not Concat(freqs, freqs)")
    if int_attr(concat, "axis", 0) not in (-1, 2):
        raise Declined("cos/sin's angle halves are not concatenated on the last axis")
    nodes.append(concat)
    freqs = concat.inputs[0]
    mul = _producer(freqs, "Mul")
    if mul is not None:
        nodes.append(mul)
        for i in (0, 1):
            inv = const(mul.inputs[i])
            if inv is not None and inv.dtype.kind == "f":
                return _positions(mul.inputs[1 - i], (-1, 2), nodes), inv.astype(np.float32).reshape(-1)
        raise Declined("the angle's Mul has no constant inv_freq")
    transpose = _producer(freqs, "Transpose")
    matmul = _producer(transpose.inputs[0], "MatMul") if transpose else None
    if transpose is None or matmul is None or ints_attr(transpose, "perm") != [0, 2, 1]:
        raise Declined("the angle is neither positions * inv_freq nor Transpose(MatMul(inv_freq, positions))")
    nodes += [transpose, matmul]
    expand = _producer(matmul.inputs[0], "Expand")
    inv = const(expand.inputs[0] if expand else matmul.inputs[0])
    if inv is None or inv.ndim != 3 or inv.shape[0] != 1 or inv.shape[2] != 1:
        raise Declined("the angle's MatMul has no constant inv_freq of shape [1, d, 1]")
    nodes += [expand] if expand else []
    return _positions(matmul.inputs[1], (1,), nodes), inv.astype(np.float32).reshape(-1)


def _sliced_table(value: ir.Value | None, op: str) -> CosSin | None:
    """``[Cast] Slice(table, 0:S, axis -2)`` of a constant table whose leading dims are 1 (``[P, D]``, ``[1, 1, P,
    D]``): rows 0..S-1 for every sequence, broadcast over the batch and heads. The table uncut is read so too
    where it has more than one row (DINOv3's 2-D rope over a fixed grid of patches, folded by dynamo to a ``[P, D]``
    constant): x's sequence must then be its P rows, which the broadcast itself requires. None when it is not that
    form."""
    nodes: list[ir.Node] = []
    cast = _producer(value, "Cast")
    if cast is not None:
        nodes.append(cast)
        value = cast.inputs[0]
    sliced = _producer(value, "Slice")
    if sliced is None:
        table = const(value)
        if table is None or table.ndim < 2 or table.shape[-2] < 2:
            return None
        source = value
    else:
        if len(sliced.inputs) < 4:
            return None
        table = const(sliced.inputs[0])
        if table is None or table.ndim < 2:
            return None
        start, axis = one_int(sliced.inputs[1], {}), one_int(sliced.inputs[3], {})
        step = one_int(sliced.inputs[4], {}) if len(sliced.inputs) > 4 and sliced.inputs[4] is not None else 1
        if start != 0 or step != 1 or axis is None or axis % table.ndim != table.ndim - 2:
            return None
        nodes.append(sliced)
        source = sliced.outputs[0]
    if any(d != 1 for d in table.shape[:-2]) or table.dtype.kind != "f":
        return None
    rows = table.reshape(table.shape[-2:])
    if rows.shape[1] % 2:
        return None
    half = rows.shape[1] // 2
    if not np.array_equal(rows[:, :half], rows[:, half:]):
        raise Declined(f"the {op.lower()} table's halves differ (not the rotate_half layout)")
    return CosSin("table", None, rows[:, :half].astype(np.float32), 1.0, tuple(nodes), rows=source)


def cos_sin(value: ir.Value | None, op: Literal["Cos", "Sin"]) -> CosSin:
    """Trace one factor of the rotation back to its angle or its folded table."""
    nodes: list[ir.Node] = []
    unsqueeze = _producer(value, "Unsqueeze")
    heads_axis = axes_of(unsqueeze) if unsqueeze is not None else None
    if heads_axis not in ([1], [2]):
        if (table := _sliced_table(value, op)) is not None:
            return table
        raise Declined(f"{op.lower()} is not unsqueezed on a heads axis (1: BNSH, 2: BSNH)")
    assert unsqueeze is not None and heads_axis is not None
    nodes.append(unsqueeze)
    v, scale = unsqueeze.inputs[0], 1.0
    while (node := _producer(v, "Cast", "Identity", "Mul")) is not None:
        if node.op_type == "Mul":
            factor = [scalar(i) for i in node.inputs]
            if factor[1] is not None:
                scale, v = scale * factor[1], node.inputs[0]
            elif factor[0] is not None:
                scale, v = scale * factor[0], node.inputs[1]
            else:
                break
        else:
            v = node.inputs[0]
        nodes.append(node)
    trig = _producer(v, op)
    if trig is not None:
        nodes.append(trig)
        (positions, shared), inv_freq = _angles(trig.inputs[0], nodes)
        return CosSin("inv_freq", positions, inv_freq, scale, tuple(nodes), shared, heads_axis=heads_axis[0])
    doubled = _producer(v, "Concat")
    if doubled is not None and len(doubled.inputs) == 2 and doubled.inputs[0] is doubled.inputs[1]:
        if int_attr(doubled, "axis", 0) not in (-1, 2):
            raise Declined(f"{op.lower()}'s halves are not concatenated on the last axis")
        nodes.append(doubled)
        return CosSin(
            "per_token", None, np.zeros(0, np.float32), scale, tuple(nodes), rows=doubled.inputs[0],
            heads_axis=heads_axis[0],
        )  # fmt: skip
    gather = _producer(v, "Gather")
    if gather is None or int_attr(gather, "axis", 0) != 0:
        raise Declined(
            f"{op.lower()} comes from neither {op}(angles), Gather(table, position_ids) nor Concat(half, half)"
        )
    nodes.append(gather)
    table_value = gather.inputs[0]
    sliced = _producer(table_value, "Slice")
    if sliced is not None:  # cos_cached[:seq_len]: every row stays reachable through position_ids
        nodes.append(sliced)
        table_value = sliced.inputs[0]
    table = const(table_value)
    if table is None or table.ndim != 2 or table.shape[1] % 2:
        raise Declined(f"the {op.lower()} table gathered by position_ids is not a constant [positions, dim]")
    half = table.shape[1] // 2
    if not np.array_equal(table[:, :half], table[:, half:]):
        raise Declined(f"the {op.lower()} table's halves differ (not the rotate_half layout)")
    positions = gather.inputs[1]
    assert positions is not None
    if positions.shape is not None and len(positions.shape) != 2:
        raise Declined(f"positions {positions.name} have rank {len(positions.shape)}, not [batch, sequence]")
    return CosSin("table", positions, table[:, :half].astype(np.float32), scale, tuple(nodes), heads_axis=heads_axis[0])


_ELEMENTWISE = frozenset({"Mul", "Div", "Add", "Sub", "Cast", "Identity", "SimplifiedLayerNormalization"})


def _heads_after_sequence(x: ir.Value) -> int | None:
    """Heads of ``x`` [B, S, N, D]: its static dim, else from the head split ``Reshape(proj, [B, S, -1, D])`` it
    was computed from, through a per-head norm (Gemma 3n's q/k RMSNorm) or other elementwise steps."""
    if x.shape is not None and len(x.shape) == 4 and isinstance(x.shape[2], int):
        return x.shape[2]
    split = _head_split(x)
    return split[0] if split else None


def _head_split(x: ir.Value, *, transposed: bool = False) -> tuple[int, int] | None:
    """(heads, head_size) of the head split ``Reshape(proj, [B, S, -1, D])`` ``x`` was computed from through
    elementwise steps (with ``transposed``, first its ``Transpose(perm=[0, 2, 1, 3])`` to heads-first)."""
    value: ir.Value | None = x
    if transposed:
        transpose = _producer(x, "Transpose")
        if transpose is None or ints_attr(transpose, "perm") != [0, 2, 1, 3]:
            return None
        value = transpose.inputs[0]
    for _ in range(16):
        node = value.producer() if value is not None else None
        if node is None or node.domain not in (*_ONNX, "com.microsoft"):
            return None
        if node.op_type == "Reshape":
            return heads_of_split(node.inputs[1], node.inputs[0])
        if node.op_type not in _ELEMENTWISE:
            return None
        # the computed operand: ``weight * x`` (a per-head norm's scale first, as TorchScript writes it) reads x
        computed = [v for v in node.inputs if v is not None and _computed(v)]
        value = computed[0] if computed else None
    return None


def _computed(value: ir.Value) -> bool:
    producer = value.producer()
    return value.const_value is None and producer is not None and producer.op_type != "Constant"


def _width(first: ir.Node | None, x: ir.Value, bsnd: bool) -> int:
    """The rotary dim of a rotation whose factors are computed per token: twice the end of rotate_half's first
    Slice (``x[..., :half]``), else x's head size (static, or its head split's: transformers' rotate_half cuts
    ``x.shape[-1] // 2``, which a TorchScript export computes from the shape)."""
    half = one_int(first.inputs[2], {}) if first is not None and len(first.inputs) > 2 else None
    if half is not None and 0 < half < SLICE_TO_END:
        return 2 * half
    if x.shape is not None and len(x.shape) == 4 and isinstance(x.shape[3], int):
        size: int | None = x.shape[3]
    else:
        split = _head_split(x, transposed=not bsnd)
        size = split[1] if split else None
    if size is not None and size % 2 == 0:
        return size
    raise Declined("the rotation's width is not known from the graph (its factors are computed per token)")


def _rows_of_sequence(rows: ir.Value | None, x: ir.Value) -> bool:
    """Whether the table cut to ``rows`` has as many rows as ``x`` [B, N, S, D] has positions: the same symbol
    or number (a cut of another length would broadcast one row over the sequence, or fail)."""
    if rows is None or rows.shape is None or x.shape is None or len(x.shape) != 4:
        return False
    length, sequence = rows.shape[-2], x.shape[2]
    if isinstance(length, int) or isinstance(sequence, int):
        return length == sequence and length != 1
    return length.value is not None and length == sequence


def _num_heads(q: ir.Value) -> int | None:
    if q.shape is not None and len(q.shape) == 4 and isinstance(q.shape[1], int):
        return q.shape[1]
    # A fused qkv projection split per head on the last axis (GPT-NeoX: [B, N, S, 3*D] sliced into q, k, v
    # after the head Transpose) keeps the heads axis: read it from the tensor before the split.
    while (head_split := _slice(_producer(q, "Slice"), {})) is not None:
        q = head_split[0]
    transpose = _producer(q, "Transpose")
    reshape = _producer(transpose.inputs[0], "Reshape") if transpose else None
    if transpose is None or reshape is None or ints_attr(transpose, "perm") != [0, 2, 1, 3]:
        return None
    split = heads_of_split(reshape.inputs[1], reshape.inputs[0])
    return split[0] if split else None


def match(add: ir.Node, graph_outputs: set[ir.Value]) -> RotaryMatch:
    """The rotary embedding ending at ``add``; raises Declined with the reason when it is not one."""
    parts = _rotate_half_mul(add)
    if parts is None:
        raise Declined("not Add(Mul(x, cos), Mul(rotate_half(x), sin))")
    plain, rotated, concat, flipped = parts
    sin_value = next(v for v in rotated.inputs if v is not concat.outputs[0])
    if len(plain.inputs) != 2 or concat.outputs[0] not in rotated.inputs:
        raise Declined("rotate_half's Mul is not binary")
    neg = _producer(concat.inputs[1 if flipped else 0], "Neg")
    assert neg is not None
    if flipped:  # Concat(x2, -x1)
        second, first = _producer(concat.inputs[0], "Slice"), _producer(neg.inputs[0], "Slice")
    else:  # Concat(-x2, x1)
        second, first = _producer(neg.inputs[0], "Slice"), _producer(concat.inputs[1], "Slice")
    if int_attr(concat, "axis", 0) not in (-1, 3):
        raise Declined("rotate_half concatenates on an axis other than the last")
    cos_value = None
    x: ir.Value | None = None
    for i in (0, 1):
        if second is not None and plain.inputs[i] is second.inputs[0]:
            x, cos_value = plain.inputs[i], plain.inputs[1 - i]
    if x is None or cos_value is None or first is None or second is None or first.inputs[0] is not x:
        raise Declined("rotate_half's two Slices and the cos Mul do not read the same tensor")
    cos = cos_sin(cos_value, "Cos")
    sin = cos_sin(sin_value, "Sin")
    if cos.kind != sin.kind or cos.positions is not sin.positions:
        raise Declined("cos and sin come from different positions or forms")
    if cos.kind == "inv_freq" and not np.array_equal(cos.values, sin.values):
        raise Declined("cos and sin use different inv_freq")
    if cos.kind == "table" and cos.values.shape != sin.values.shape:
        raise Declined("the cos and sin tables differ in shape")
    if cos.kind == "per_token" and cos.rows is sin.rows:
        raise Declined("cos and sin are the same values")
    if cos.scale != sin.scale:
        raise Declined(f"cos is scaled by {cos.scale}, sin by {sin.scale}")
    if flipped:  # x*cos + Concat(x2, -x1)*sin is x*cos + Concat(-x2, x1)*(-sin): the sin cache negated
        sin = dataclasses.replace(sin, scale=-sin.scale)
    if cos.heads_axis != sin.heads_axis:
        raise Declined("cos and sin are unsqueezed on different axes")
    bsnd = cos.heads_axis == 2
    bsnd_heads = _heads_after_sequence(x) if bsnd else None
    if bsnd and bsnd_heads is None:
        raise Declined("the heads of the [batch, sequence, heads, head_size] input are not known from the graph")
    if x.dtype is not None and x.dtype not in _FLOATS:
        raise Declined(f"{x.name} is {x.dtype}; RotaryEmbedding takes float or float16")
    rotary_dim = 2 * cos.values.shape[-1] if cos.kind != "per_token" else _width(first, x, cos.heads_axis == 2)
    if cos.kind == "table" and cos.positions is None and not _rows_of_sequence(cos.rows, x):
        raise Declined("the cos table is cut to a length not proven to be the sequence's")
    hints = {x: (np.nan, np.nan, np.nan, float(rotary_dim)), cos_value: (np.nan, np.nan, np.nan, float(rotary_dim))}
    if cos.positions is not None:
        hints[cos_value.producer().inputs[0]] = (np.nan, np.nan, float(rotary_dim))  # type: ignore[union-attr]
    half = rotary_dim // 2
    lo, hi = _slice(first, hints), _slice(second, hints)
    if lo is None or hi is None or lo[1:] != (0, half) or hi[1] != half or (hi[2] or 0) < rotary_dim:
        raise Declined(f"rotate_half does not split the last axis at {half} (rotary_dim {rotary_dim})")
    nodes = [add, plain, rotated, concat, neg, first, second, *cos.nodes, *sin.nodes]
    anchor, rotated_input, partial, heads = add, x, False, None
    outer = _producer(x, "Slice") if not bsnd else None  # a heads-last partial rotation: the slice's rotation
    users = add.outputs[0].uses()
    wrapper = users[0].node if len(users) == 1 and add.outputs[0] not in graph_outputs else None
    if outer is not None and wrapper is not None and wrapper.op_type == "Concat" and len(wrapper.inputs) == 2:
        q = outer.inputs[0]
        assert q is not None
        outer_hints = {**hints, q: (np.nan, np.nan, np.nan, np.nan)}
        rot, rest = _slice(outer, outer_hints), _slice(_producer(wrapper.inputs[1], "Slice"), outer_hints)
        heads = _num_heads(q)
        if (
            wrapper.inputs[0] is add.outputs[0]
            and int_attr(wrapper, "axis", 0) in (-1, 3)
            and rot is not None
            and rest is not None
            and rot[0] is q
            and rest[0] is q
            and rot[1:] == (0, rotary_dim)
            and rest[1] == rotary_dim
            and (rest[2] or 0) >= SLICE_TO_END
            and heads is not None
        ):
            nodes += [wrapper, outer, wrapper.inputs[1].producer()]  # type: ignore[list-item]
            anchor, rotated_input, partial = wrapper, q, True
    if bsnd:
        heads = bsnd_heads
    return RotaryMatch(anchor, rotated_input, rotary_dim, partial, heads, cos, sin, tuple(nodes), bsnd=bsnd)


_LAYER = re.compile(r"(?:layers|layer|h|blocks|block)[._/](\d+)[._/]")


def layer_of(node: ir.Node, depth: int = 16) -> int | None:
    """The decoder layer a node belongs to: from its name (TorchScript) or the nearest weight's (dynamo)."""
    seen: set[ir.Node] = set()
    frontier = [node]
    for _ in range(depth):
        following: list[ir.Node] = []
        for current in frontier:
            for text in (current.name or "", *(v.name or "" for v in current.inputs if v is not None)):
                found = _LAYER.search(text + ".")
                if found:
                    return int(found.group(1))
            for v in current.inputs:
                producer = v.producer() if v is not None else None
                if producer is not None and producer not in seen:
                    seen.add(producer)
                    following.append(producer)
        frontier = following
    return None
