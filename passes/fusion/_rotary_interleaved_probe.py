"""The measured half of the interleaved rotary match: the cos/sin cache rows, and proof the candidate is one.

The factors' subgraph (pruned from the model; ORT, graph optimizations off) runs once on one row of ``rows``
new tokens: its positions must be 0..rows-1, each factor must repeat every value twice along the last axis
(cos[..., 2i] = cos[..., 2i+1], what interleaved=1 assumes), and the distinct values are the cache rows.
Then each candidate runs with its x, its rotated x, its factors and positions at two batches of other shapes
(rows of a position_ids input offset from one another, a prompt after a cache where the model has one): the
rotated value must equal ``rotate_every_two(x)`` and each factor the cache row of its token's position in
the layout the Mul broadcasts it ([B, 1, S, r] heads first, or [B, S, 1, r] heads after the sequence, GPT-J's
order), within ``ATOL``. A candidate that differs anywhere is declined with where.

Positions with one row per rope section (GLM-4V's multimodal rope, ``position_ids [3, B, S]``) have no table read
at one row: each candidate is proven at the checks' shapes with height and width drawn per token instead (the
rotated value, and each factor repeating every value on two adjacent channels for every token), and its factors'
even channels become per-token caches (``Verified.per_token``; ``fuse_rotary._per_token``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from core.inputs import analyze
from passes.fusion import _rotary_split_pairs as split_pairs
from passes.fusion._gqa_probe import _session, _weights_apart, _with_outputs
from passes.fusion._rotary_interleaved import Candidate, NotInterleaved, rotate_every_two

ATOL = 1e-6
# Positions the factors' subgraph is run for at once: its pruned graph can hold [1, rows, hidden] activations
# (the Shape of the hidden states sizes an Expand), GBs at a 131072-token context. Factors of a position_ids
# input are computed in parts of CHUNK_ROWS, each fed its own positions; others (positions from the graph's own
# Range) at once up to AT_ONCE_ROWS, past which the candidate is declined with the max_positions that would fuse.
CHUNK_ROWS = 4096
AT_ONCE_ROWS = 16384
_CHECKS = ((2, 5, 0), (3, 3, 4))  # (batch, new tokens, past); the second only where the model has a cache


@dataclasses.dataclass(frozen=True)
class Verified:
    cos: np.ndarray  # float32 [rows, r / 2]
    sin: np.ndarray
    rotary_dim: int
    head_size: int
    num_heads: int
    bsnd: bool  # heads after the sequence: [B, S, N, D]
    per_token: bool = False  # sectioned positions: no table, the factors' own rows are the caches (cos/sin empty)


class _Feeds:
    """Inputs for each role ``core.inputs`` reads off the graph; positions of row b start ``2 * b`` later."""

    def __init__(self, model: ir.Model) -> None:
        self.inputs = [v for v in model.graph.inputs if v.name not in model.graph.initializers]
        self.roles = analyze(model).roles
        self.has_past = any(r.role == "past_key_values" for r in self.roles.values())

    def __call__(
        self, batch: int, seq: int, past: int, offset: int, wanted: set[str], *, first: int = 0
    ) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        past = past if self.has_past else 0
        out = {}
        for value in self.inputs:
            if value.name not in wanted:
                continue
            role = self.roles[value.name or ""]
            if role.role == "attention_mask":
                array = np.ones((batch, past + seq))
            elif role.role == "position_ids":
                array = first + past + np.arange(seq)[None, :] + offset * np.arange(batch)[:, None]
                if value.shape is not None and len(value.shape) == 3:  # one row per rope section: a grid per token
                    sections = value.shape[0] if isinstance(value.shape[0], int) else 3
                    grid = rng.integers(0, past + seq + 1, (sections - 1, batch, seq))
                    array = np.concatenate([np.broadcast_to(array, (batch, seq))[None], grid])
            elif role.role in ("token_ids", "int"):
                array = rng.integers(0, role.high or 2, size=(batch, seq))
            elif role.role == "token_type_ids":
                array = np.zeros((batch, seq))
            elif role.role == "past_key_values":
                dims = [
                    batch if a == 0 else past if a == role.past_axis else d for a, d in enumerate(value.shape or ())
                ]
                if not all(isinstance(d, int) for d in dims):
                    raise NotInterleaved(f"cache input {value.name!r} has a symbolic dim the probe cannot size")
                array = rng.standard_normal(dims)
            elif role.role == "float":  # activations fed straight in: batch first, every other free dim the sequence
                dims = [batch if a == 0 else d if isinstance(d, int) else seq for a, d in enumerate(value.shape or ())]
                array = rng.standard_normal(dims)
            else:
                raise NotInterleaved(f"input {value.name!r} has role {role.role}, which the rotary probe cannot feed")
            dtype = np.dtype(value.dtype.numpy()) if value.dtype is not None else np.dtype(np.float32)
            out[value.name or ""] = np.ascontiguousarray(array).astype(dtype)
        return out


def _run(
    model: ir.Model, values: list[ir.Value], feeds: _Feeds, shape: tuple[int, int, int, int]
) -> dict[str, np.ndarray]:
    """``values`` computed at (batch, new tokens, past, offset of each row's positions), the graph pruned to them."""
    return _runs(model, values, feeds, [(shape, 0)])[0]


def _runs(
    model: ir.Model, values: list[ir.Value], feeds: _Feeds, shapes: list[tuple[tuple[int, int, int, int], int]]
) -> list[dict[str, np.ndarray]]:
    """``_run`` at each (shape, first position fed as position_ids), one pruned session for all of them."""
    inputs = [v for v in values if v in model.graph.inputs]  # position_ids: returned as fed
    values = [v for v in values if v not in model.graph.inputs]
    for index, value in enumerate(values):
        if not value.name:
            value.name = f"fuse_rotary/probe_{index}"
    untyped = {str(v.name) for v in values if v.type is None}
    with _weights_apart(model) as (light, folder):
        proto = _with_outputs(light, values, prune=True)
        for output in proto.graph.output:  # TorchScript types few values: ORT infers them (a Range is int64)
            if output.name in untyped:
                output.ClearField("type")
        session = _session(proto, folder)
    names = list(dict.fromkeys(str(v.name) for v in values))
    wanted = {i.name for i in session.get_inputs()} | {str(v.name) for v in inputs}
    results = []
    for shape, first in shapes:
        fed = feeds(*shape, wanted, first=first)
        got = session.run(names, {i.name: fed[i.name] for i in session.get_inputs()})
        results.append(dict(zip(names, got, strict=True)) | {str(v.name): fed[str(v.name)] for v in inputs})
    return results


def _positions(found: Candidate, got: dict[str, np.ndarray], seq: int) -> np.ndarray:
    """The positions the factors were computed for: as fed or computed, else 0..seq-1 (the claim to check)."""
    return np.arange(seq) if found.positions is None else got[str(found.positions.name)]


def _rows(
    found: Candidate, got: dict[str, np.ndarray], rows: int, first: int = 0, *, split: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    positions = _positions(found, got, rows)
    if positions.size != rows or not np.array_equal(positions.reshape(-1), np.arange(first, first + rows)):
        raise NotInterleaved(f"the positions of a {rows}-token prompt are not {first}..{first + rows - 1}")
    if split:  # one angle per pair already: the factors' rows are the cache
        return split_pairs.rows(found, got, rows)
    tables = []
    for op, value in (("cos", found.cos), ("sin", found.sin)):
        factor = got[str(value.name)]
        width = factor.shape[-1] if factor.ndim else 0
        if width % 2 or factor.size != rows * width:
            raise NotInterleaved(f"{op} is {list(factor.shape)} at {rows} positions, not one row per position")
        table = factor.reshape(rows, width).astype(np.float32)
        if not np.array_equal(table[:, 0::2], table[:, 1::2]):
            raise NotInterleaved(f"{op} does not repeat each value on two adjacent channels (not interleaved)")
        tables.append(np.ascontiguousarray(table[:, 0::2]))
    return tables[0], tables[1]


def _rotated_channels(found: Candidate, got: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(x, q) as run, once the graph's rotated value is proven ``rotate_every_two(x)`` in one 4-D head layout."""
    x, q = got[str(found.x.name)], got[str(found.q.name)]
    if x.ndim != 4 or q.ndim != 4 or x.shape[:3] != q.shape[:3]:
        raise NotInterleaved(f"the rotated channels are {list(x.shape)} of {list(q.shape)}, not one 4-D head layout")
    if not np.array_equal(got[str(found.rotated.name)], rotate_every_two(x)):
        raise NotInterleaved("the rotated value is not stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)")
    return x, q


def _layout(layouts: list[bool], x: np.ndarray, seq: int) -> tuple[bool, int]:
    """(heads after the sequence, heads) from how cos and sin broadcast (``layouts``: one bsnd per factor)."""
    if layouts[0] != layouts[1]:
        raise NotInterleaved("cos and sin broadcast over different axes")
    bsnd = layouts[0]
    if x.shape[1 if bsnd else 2] != seq:
        raise NotInterleaved(f"x {list(x.shape)} has its {seq} positions elsewhere than its cos and sin")
    return bsnd, int(x.shape[2] if bsnd else x.shape[1])


def _check(found: Candidate, got: dict[str, np.ndarray], tables: tuple[np.ndarray, np.ndarray], seq: int) -> Verified:
    x, q = _rotated_channels(found, got)
    positions = _positions(found, got, seq).astype(np.int64)
    positions = positions.reshape(1, -1) if positions.ndim == 1 else positions
    rows = tables[0].shape[0]
    if positions.ndim != 2 or positions.shape[1] != seq or positions.min() < 0 or positions.max() >= rows:
        raise NotInterleaved(f"positions {list(positions.shape)} are not [batch, {seq}] within {rows} rows")
    layouts = []
    for op, value, table in (("cos", found.cos, tables[0]), ("sin", found.sin, tables[1])):
        factor = got[str(value.name)]
        if factor.ndim != 4 or factor.shape[-1] != x.shape[-1]:
            raise NotInterleaved(f"{op} is {list(factor.shape)}, not a 4-D factor of {list(x.shape)}")
        if factor.shape[1:3] not in ((1, seq), (seq, 1)):
            raise NotInterleaved(f"{op} is {list(factor.shape)}: no heads axis of 1 beside the {seq} positions")
        bsnd = factor.shape[1] == seq
        expected = np.expand_dims(np.repeat(table[positions], 2, axis=-1), 2 if bsnd else 1)
        try:
            shape = np.broadcast_shapes(expected.shape, factor.shape)
        except ValueError:
            raise NotInterleaved(f"{op} {list(factor.shape)} is not per position {list(positions.shape)}") from None
        error = np.abs(np.broadcast_to(factor, shape).astype(np.float32) - np.broadcast_to(expected, shape)).max()
        if not error <= ATOL:
            raise NotInterleaved(f"{op} differs from its cache row at its position by {error:.3g}")
        layouts.append(bsnd)
    bsnd, heads = _layout(layouts, x, seq)
    return Verified(tables[0], tables[1], int(x.shape[-1]), int(q.shape[-1]), heads, bsnd)


def _per_token(
    model: ir.Model, candidates: list[Candidate], feeds: _Feeds, *, split: bool
) -> tuple[list[tuple[Candidate, Verified]], list[tuple[Candidate, str]]]:
    """Candidates over sectioned positions (multimodal rope: each token's angles from its own row per section),
    proven at the checks' shapes with height and width drawn per token: the rotated value is
    ``rotate_every_two(x)`` and each factor repeats every value on two adjacent channels for every token, so its
    even channels are that token's cache row (``fuse_rotary._per_token``)."""
    if split:
        reason = (
            "rotary on split pairs over sectioned positions (multimodal rope): not matched per token; left computed"
        )
        return [], [(c, reason) for c in candidates]
    return _proven_at_checks(model, candidates, feeds, [], _check_per_token, note="sectioned positions, ")


def _check_per_token(found: Candidate, got: dict[str, np.ndarray], seq: int) -> Verified:
    x, q = _rotated_channels(found, got)
    layouts = []
    for op, value in (("cos", found.cos), ("sin", found.sin)):
        factor = got[str(value.name)]
        if factor.ndim != 4 or factor.shape[-1] != x.shape[-1] or factor.shape[0] != x.shape[0]:
            raise NotInterleaved(f"{op} is {list(factor.shape)}, not a 4-D factor per row of {list(x.shape)}")
        if factor.shape[1:3] not in ((1, seq), (seq, 1)):
            raise NotInterleaved(f"{op} is {list(factor.shape)}: no heads axis of 1 beside the {seq} positions")
        if not np.array_equal(factor[..., 0::2], factor[..., 1::2]):
            raise NotInterleaved(f"{op} does not repeat each value on two adjacent channels (not interleaved)")
        layouts.append(factor.shape[1] == seq)
    bsnd, heads = _layout(layouts, x, seq)
    empty = np.zeros((0, x.shape[-1] // 2), np.float32)
    return Verified(empty, empty, int(x.shape[-1]), int(q.shape[-1]), heads, bsnd, per_token=True)


def _fed_positions(found: Candidate, feeds: _Feeds) -> bool:
    """Whether the factors' positions are the position_ids input, which ``_Feeds`` can start anywhere."""
    positions = found.positions
    role = feeds.roles.get(str(positions.name)) if positions is not None else None
    return positions in feeds.inputs and role is not None and role.role == "position_ids"


def _check_split(
    found: Candidate, got: dict[str, np.ndarray], tables: tuple[np.ndarray, np.ndarray], seq: int
) -> Verified:
    rotary_dim, heads = split_pairs.check(found, got, tables, seq, ATOL)
    return Verified(tables[0], tables[1], rotary_dim, rotary_dim, heads, bsnd=False)


def verify(
    model: ir.Model, candidates: list[Candidate], max_positions: int, *, split: bool = False
) -> tuple[list[tuple[Candidate, Verified]], list[tuple[Candidate, str]]]:
    """(the candidates proven, each with its cache; the others with the reason). ``split``: the candidates are
    ``_rotary_split_pairs``' (DeepSeek's halves-ordered pair rotation), checked by its rule."""
    declined: list[tuple[Candidate, str]] = []
    try:
        feeds = _Feeds(model)
    except Exception as exc:  # inputs the role reader cannot place: nothing proven, the graph left as it is
        return [], [(c, f"the graph's inputs could not be read for the probe: {str(exc)[:200]}") for c in candidates]
    sections = [
        v.name
        for v in feeds.inputs
        if feeds.roles.get(v.name) is not None
        and feeds.roles[v.name].role == "position_ids"
        and v.shape is not None
        and len(v.shape) == 3
    ]
    if sections:  # GLM-4V: each token's angles come from three rows, which no table read at one row holds
        return _per_token(model, candidates, feeds, split=split)
    tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    by_rows: dict[int, list[Candidate]] = {}
    for found in candidates:  # one run per length: a table gathered by position has its own rows
        by_rows.setdefault(min(max_positions, found.table_rows or max_positions), []).append(found)
    for rows, asked in by_rows.items():
        group = asked
        parts = [(first, min(CHUNK_ROWS, rows - first)) for first in range(0, rows, CHUNK_ROWS)]
        if len(parts) > 1:
            fed = [c for c in asked if _fed_positions(c, feeds)]
            if len(fed) < len(asked) and rows > AT_ONCE_ROWS:
                reason = (
                    f"max_positions {rows} is over the {AT_ONCE_ROWS} rows the probe computes at once, and cos/sin "
                    "are not a function of a position_ids input that the rows could be computed in parts from; "
                    f"pass fuse_rotary max_positions <= {AT_ONCE_ROWS} to fuse with that context"
                )
                declined += [(c, reason) for c in asked if c not in fed]
                group = fed
            elif len(fed) < len(asked):
                parts = [(0, rows)]
        if not group:
            continue
        try:
            values = [v for c in group for v in (c.positions, c.cos, c.sin) if v is not None]
            gots = _runs(model, values, feeds, [((1, n, 0, 0), first) for first, n in parts])
        except Exception as exc:  # the factors do not compute at this length: nothing to build a cache from
            declined += [(c, f"cos/sin did not compute at {rows} positions: {str(exc)[:200]}") for c in group]
            continue
        for found in group:
            try:
                pieces = [_rows(found, got, n, first, split=split) for got, (first, n) in zip(gots, parts, strict=True)]
                tables[id(found)] = (np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces]))
            except NotInterleaved as reason:
                declined.append((found, str(reason)))

    def check(found: Candidate, got: dict[str, np.ndarray], seq: int) -> Verified:
        return (_check_split if split else _check)(found, got, tables[id(found)], seq)

    return _proven_at_checks(model, candidates, feeds, declined, check, ready=lambda c: id(c) in tables)


def _proven_at_checks(
    model: ir.Model,
    candidates: list[Candidate],
    feeds: _Feeds,
    declined: list[tuple[Candidate, str]],
    check: Callable[[Candidate, dict[str, np.ndarray], int], Verified],
    *,
    ready: Callable[[Candidate], bool] = lambda c: True,
    note: str = "",
) -> tuple[list[tuple[Candidate, Verified]], list[tuple[Candidate, str]]]:
    """Each ``ready`` candidate not yet declined, run at every check's shape and held to ``check``: (the proven,
    each with its proof; ``declined`` with the others, each with where it failed)."""
    proven: dict[int, Verified] = {}
    for batch, seq, past in [c for c in _CHECKS if feeds.has_past or c[2] == 0]:
        pending = [c for c in candidates if ready(c) and id(c) not in {id(d) for d, _ in declined}]
        if not pending:
            break
        values = [v for c in pending for v in (c.positions, c.cos, c.sin, c.x, c.q, c.rotated) if v is not None]
        try:
            got = _run(model, values, feeds, (batch, seq, past, 2))
        except Exception as exc:
            declined += [
                (c, f"the rotation did not run at {batch} x {seq} after {past}: {str(exc)[:200]}") for c in pending
            ]
            break
        for found in pending:
            try:
                proven[id(found)] = check(found, got, seq)
            except NotInterleaved as reason:
                declined.append((found, f"{reason} ({note}at batch {batch}, {seq} new tokens after {past})"))
    refused = {id(c) for c, _ in declined}
    return [(c, proven[id(c)]) for c in candidates if id(c) in proven and id(c) not in refused], declined
