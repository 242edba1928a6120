"""Fuse a decoder's rotary position embedding into ``com.microsoft::RotaryEmbedding``, and report the decoder's
structure.

ORT's ``fusion_rotary_attention.py`` does this for Llama-2-shaped exports of its own converter only, and
onnxscript's ``rotary_embedding``/``cos_sin_cache`` rules match ``MatMul(inv_freq, positions)`` with static
head shapes, which current transformers no longer export (it writes ``positions * inv_freq``) and TorchScript
never annotates. This pass matches the forms ``_rotary_match`` draws (TorchScript eager and SDPA, dynamo,
full and Phi-3 partial rotary, angles computed or the exporter's folded table), per q and per k::

    x --Mul(cos)-------------------------------+
    x --Slice--Neg--Concat--Mul(sin)----------Add-->        ==>   x --RotaryEmbedding(position_ids,
    x --Slice-----/                                                    cos_cache, sin_cache)-->
    position_ids--Unsqueeze--Cast--Mul(inv_freq)--Concat--Cos/Sin--[Mul(scaling)]--Unsqueeze

with the caches computed once per distinct frequency set (``_rotary_cache``). Factors computed per token,
``Concat(h, h)`` of any half ``h [B, S, rotary_dim/2]`` (Qwen2-VL's M-RoPE gathers each section's angles from its
own row of ``position_ids [3, B, S]``: no table indexed by one position exists), become caches in the graph:
``h`` flattened to one row per token, read at positions ``arange(B * S)`` (``_per_token``); an interleaved one
over such positions (GLM-4V) takes its proven factors' even channels as ``h``. The interleaved form (GPT-J,
Cohere, RoFormer: ``rotate_every_two``, channel pairs (2i, 2i+1)) becomes ``RotaryEmbedding(interleaved=1)``
(``_rotary_interleaved``: its caches are what the graph's own cos/sin compute, run once and then checked at
other shapes, ``_rotary_interleaved_probe``). DeepSeek's MLA rotates pairs too but writes them evens first,
``cat([x1*c - x2*s, x2*c + x1*s])`` (``_rotary_split_pairs``): ``RotaryEmbedding(interleaved=0)`` of
``Concat(x[..., 0::2], x[..., 1::2])``, its caches read and proven the same way; GPT-OSS writes that expression
over x's contiguous halves, which is ``RotaryEmbedding(interleaved=0)`` of x with a half-width cache, and
OpenAI's privacy filter stacks its two results back into pairs, ``RotaryEmbedding(interleaved=1)`` of x. A
rotation of [B, S, N, D] (GPT-J, before its head transpose) goes in flat, [B, S, N*D] with ``num_heads``, and
comes back to its four dims. The consumers of the rotated
q and k are unchanged (an attention fusion after this one sees opaque values). Nodes left without a
consumer are removed; the trigonometry disappears with the last layer's use of it. A rotated key that is a
graph output itself (the present of a decoder without a past: Optimum's no-cache branch) is rotated on its
flat [B, S, N*D] form and transposed after, so that fuse_gqa reads that one rotation instead of adding its
own beside it (``_transposed_heads``).

It also rewrites the dynamo exporter's RMS norms into the form ORT's session fuses into
``SimplifiedLayerNormalization`` (``_decoder_norm``), which it otherwise leaves as six elementwise nodes.

``notes["decoder"]`` is the structure ``_decoder_structure.detect`` reads from the graph; ``non_matches``
names, per layer, every rotate-half candidate that did not fuse and why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx_ir as ir
from pydantic import Field

from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes._subgraphs import in_branches
from passes.fusion import _decoder_structure
from passes.fusion._decoder_norm import divide_rms_norms
from passes.fusion._rotary_cache import DEFAULT_MAX_POSITIONS, metadata_max_positions, rows
from passes.fusion._rotary_interleaved import Candidate, NotInterleaved, candidate, looks_interleaved
from passes.fusion._rotary_interleaved_probe import Verified, verify
from passes.fusion._rotary_match import CosSin, Declined, RotaryMatch, layer_of, looks_rotary, match
from passes.fusion._rotary_split_pairs import Parts, looks_split_pairs, separate, split_parts
from passes.fusion._rotary_split_pairs import candidate as split_candidate

_MS = "com.microsoft"


class FuseRotaryOptions(PassOptions):
    max_positions: int | None = Field(
        default=None,
        ge=1,
        description="Rows of the cos/sin cache built from inv_freq: the longest context (past + prompt) the "
        "artifact accepts; ORT refuses a position beyond it. Default: the model's max_position_embeddings "
        f"metadata, else {DEFAULT_MAX_POSITIONS}. A table the exporter folded keeps its own rows.",
    )


class FuseRotary(Pass[FuseRotaryOptions]):
    name = "fuse_rotary"
    summary = (
        "Decoder rotary position embeddings (rotate_half: q*cos + rotate_half(q)*sin, or interleaved "
        "rotate_every_two; full or partial) -> com.microsoft::RotaryEmbedding with a constant cos/sin cache; "
        "reports the decoder's structure."
    )

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        if (branches := in_branches(self, model, ctx)) is not None:  # a merged decoder: fuse inside its If
            return branches
        del ctx  # the rewrite is decided from the graph alone
        graph = model.graph
        outputs = set(graph.outputs)
        matches: list[RotaryMatch] = []
        declined: list[NonMatch] = []
        for node in graph:
            if not looks_rotary(node):
                continue
            try:
                matches.append(match(node, outputs))
            except Declined as reason:
                declined.append(_non_match(node, str(reason)))
        max_positions = self.options.max_positions or metadata_max_positions(model) or DEFAULT_MAX_POSITIONS
        matches += _interleaved(model, outputs, max_positions, declined)
        matches += _split_pairs(model, max_positions, declined)
        trig = sum(1 for n in graph if n.op_type in ("Sin", "Cos") and n.domain in ("", "ai.onnx"))
        structure = _decoder_structure.detect(model, matches)
        norms = divide_rms_norms(graph)
        if not matches:
            structure["rotary"] = "unmatched" if declined or trig else "no rotary"
            counts = {"rms_norms_divided": norms} if norms else {}
            declined += [] if declined else _unexplained_trig(graph)
            return PassResult(model, bool(norms), counts, declined, notes={"decoder": structure})
        matches = [_from_start(graph, m) for m in matches]
        layers = sorted({layer for m in matches if (layer := layer_of(m.anchor)) is not None})
        caches: dict[tuple[Any, ...], tuple[ir.Value, ir.Value]] = {}
        per_token: dict[tuple[ir.Value, ir.Value], tuple[ir.Value, ir.Value, ir.Value]] = {}
        for each in matches:
            found, tables = (
                _per_token(graph, each, per_token)
                if each.cos.kind == "per_token"
                else (each, _caches(graph, each, max_positions, caches))
            )
            _rewrite(graph, found, outputs, tables)
        matched = [n for m in matches for n in m.nodes]
        removed = _remove_dead(graph, [*matched, *_downstream(matched)], set(graph.outputs))
        model.opset_imports.setdefault(_MS, 1)
        left = sum(1 for n in graph if n.op_type in ("Sin", "Cos") and n.domain in ("", "ai.onnx"))
        explained = _feeding({v for pair in per_token for v in pair})
        declined += _unexplained_trig(graph, explained) if left and not declined else []
        notes: dict[str, Any] = {
            "decoder": structure,
            "max_positions": {
                m.cos.kind: (
                    max_positions
                    if m.cos.kind == "inv_freq"
                    else "the input's (one row per token)"
                    if m.cos.kind == "per_token"
                    else len(m.cos.values)
                )
                for m in matches
            },
            "rotary_layers": layers,
        }
        counts = {
            "rotary_embeddings": len(matches),
            "partial_rotary": sum(m.partial for m in matches),
            "interleaved_rotary": sum(m.interleaved for m in matches),
            "cos_sin_caches": len(caches) + len(per_token),
            "nodes_removed": removed,
            "trig_left": left,
            "rms_norms_divided": norms,
        }
        return PassResult(model, True, counts=counts, non_matches=declined, notes=notes)


def _interleaved(
    model: ir.Model, outputs: set[ir.Value], max_positions: int, declined: list[NonMatch]
) -> list[RotaryMatch]:
    """The interleaved rotations (``_rotary_interleaved``), proven on their own values; the others declined."""
    graph = model.graph
    candidates: list[Candidate] = []
    for node in graph:
        if looks_interleaved(node):
            try:
                candidates.append(candidate(node, graph, outputs))
            except NotInterleaved as reason:
                declined.append(_non_match(node, str(reason)))
    if not candidates:
        return []
    proven, refused = verify(model, candidates, max_positions)
    declined += [_non_match(found.anchor, f"interleaved rotary: {reason}") for found, reason in refused]
    matches = []
    for found, proof, cos, sin in _proven_tables(graph, proven):
        partial = found.q is not found.x
        matches.append(
            RotaryMatch(
                found.anchor,
                found.q,
                proof.rotary_dim,
                partial,
                proof.num_heads,
                cos,
                sin,
                found.nodes,
                interleaved=True,
                bsnd=proof.bsnd,
            )
        )
    return matches


def _split_pairs(model: ir.Model, max_positions: int, declined: list[NonMatch]) -> list[RotaryMatch]:
    """DeepSeek's pair rotation written in halves order (``_rotary_split_pairs``), proven on its own values:
    RotaryEmbedding(interleaved=0) of its even channels then its odd ones, the order its output keeps. The
    rotation's output is replaced where it is, a graph output or not."""
    graph = model.graph
    separate(graph)
    candidates: list[Candidate] = []
    for node in graph:
        if looks_split_pairs(node):
            try:
                candidates.append(split_candidate(node, graph))
            except NotInterleaved as reason:
                declined.append(_non_match(node, str(reason)))
    if not candidates:
        return []
    proven, refused = verify(model, candidates, max_positions, split=True)
    declined += [_non_match(found.anchor, f"rotary on split pairs: {reason}") for found, reason in refused]
    matches = []
    for found, proof, cos, sin in _proven_tables(graph, proven):
        parts = split_parts(found.anchor)
        assert parts is not None
        rotated = found.x if parts.halves or parts.stacked else _evens_then_odds(graph, found.anchor, parts)
        matches.append(
            RotaryMatch(
                found.anchor,
                rotated,
                proof.rotary_dim,
                False,
                proof.num_heads,
                cos,
                sin,
                found.nodes,
                interleaved=parts.stacked,
            )
        )
    return matches


def _evens_then_odds(graph: ir.Graph, anchor: ir.Node, parts: Parts) -> ir.Value:
    """``Concat(x[..., 0::2], x[..., 1::2])``: what RotaryEmbedding(interleaved=0) rotates for DeepSeek's pairs."""
    halves = ir.node("Concat", [parts.x1, parts.x2], {"axis": -1}, name=f"{anchor.name}/rotary_halves")
    if parts.x.dtype is not None:
        halves.outputs[0].dtype = parts.x.dtype
    halves.outputs[0].shape = parts.x.shape
    halves.outputs[0].name = f"{anchor.name}/rotary_halves_0"
    graph.insert_before(anchor, halves)
    return halves.outputs[0]


def _proven_tables(
    graph: ir.Graph, proven: list[tuple[Candidate, Verified]]
) -> list[tuple[Candidate, Verified, CosSin, CosSin]]:
    """Each proven rotation with its cos and sin caches, read at its positions: the position_ids input, the
    model's own arange(S) ([S], shared by the batch), or, where the factors take no positions, rows 0..S-1 for
    every sequence (the kernel's one-element form: a start of 0)."""
    tables = []
    evens: dict[ir.Value, ir.Value] = {}
    for found, proof in proven:
        if proof.per_token:  # sectioned positions: each token's factor row, its even channels, is its cache row
            cos, sin = (
                CosSin("per_token", None, proof.cos, 1.0, (), rows=_even_channels(graph, f, proof.bsnd, found, evens))
                for f in (found.cos, found.sin)
            )
            tables.append((found, proof, cos, sin))
            continue
        positions = found.positions if found.positions is not None else _position_start(graph)
        shared = found.positions is not None and positions not in graph.inputs
        cos = CosSin("table", positions, proof.cos, 1.0, (), shared)
        sin = CosSin("table", positions, proof.sin, 1.0, (), shared)
        tables.append((found, proof, cos, sin))
    return tables


def _even_channels(
    graph: ir.Graph, factor: ir.Value, bsnd: bool, found: Candidate, made: dict[ir.Value, ir.Value]
) -> ir.Value:
    """``factor`` [B, 1, S, r] (or [B, S, 1, r]) as [B, S, r / 2], its even channels: an interleaved factor repeats
    each value on two adjacent channels (proven), so these are its token's cache row. Once per factor."""
    if factor not in made:
        base = f"{factor.name or found.anchor.name}/rotary_evens"
        starts, ends = _int64(f"{base}_starts", [0]), _int64(f"{base}_ends", [np.iinfo(np.int64).max])
        axes, steps = _int64(f"{base}_axes", [-1]), _int64(f"{base}_steps", [2])
        heads = _int64(f"{base}_heads", [2 if bsnd else 1])
        evens = ir.node("Slice", [factor, *(n.outputs[0] for n in (starts, ends, axes, steps))], name=f"{base}_slice")
        rows = ir.node("Squeeze", [evens.outputs[0], heads.outputs[0]], name=f"{base}_rows")
        graph.insert_before(found.anchor, [starts, ends, axes, steps, heads, evens, rows])
        if factor.dtype is not None:
            evens.outputs[0].dtype = rows.outputs[0].dtype = factor.dtype
        made[factor] = rows.outputs[0]
    return made[factor]


def _from_start(graph: ir.Graph, found: RotaryMatch) -> RotaryMatch:
    """A rotation whose table is cut to the sequence (no positions) reads rows 0..S-1: the kernel's start of 0."""
    if found.cos.positions is not None or found.cos.kind == "per_token":  # per token: positions made by _per_token
        return found
    start = _position_start(graph)
    cos, sin = (dataclasses.replace(f, positions=start) for f in (found.cos, found.sin))
    return dataclasses.replace(found, cos=cos, sin=sin)


def _position_start(graph: ir.Graph) -> ir.Value:
    """The one start-of-0 initializer every rotation without positions reads (the interleaved and the split
    pairs forms share it: registered once per graph)."""
    name = "rotary_emb.position_start"
    start = graph.initializers.get(name)
    if start is not None and start.const_value is not None and start.const_value.numpy().tolist() == [0]:
        return start
    start = ir.Value(name=name, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
    start.const_value = ir.tensor(np.array([0], np.int64), name=name)
    graph.register_initializer(start)
    return start


def _unexplained_trig(graph: ir.Graph, explained: frozenset[ir.Node] = frozenset()) -> list[NonMatch]:
    """Sin/Cos no rotate-half candidate explained: a rotary form this pass does not match (a scaled rope choosing
    inv_freq at run time), named so the report says what blocked it. ``explained``: those computing per-token
    caches, which stay."""
    return [
        _non_match(n, f"{n.op_type} feeds no q*cos + rotate_half(q)*sin this pass matches (another form)")
        for n in graph
        if n.op_type in ("Sin", "Cos") and n.domain in ("", "ai.onnx") and n not in explained
    ]


def _feeding(values: set[ir.Value]) -> frozenset[ir.Node]:
    """Every node the ``values`` are computed from."""
    seen: set[ir.Node] = set()
    pending = [p for v in values if (p := v.producer()) is not None]
    while pending:
        node = pending.pop()
        if node not in seen:
            seen.add(node)
            pending += [p for v in node.inputs if v is not None and (p := v.producer()) is not None]
    return frozenset(seen)


def _non_match(node: ir.Node, reason: str) -> NonMatch:
    layer = layer_of(node)
    where = f"layer {layer}: " if layer is not None else ""
    return NonMatch(reason=f"{where}{reason}", node=node.name, op_type=node.op_type)


def _caches(
    graph: ir.Graph, found: RotaryMatch, max_positions: int, made: dict[tuple[Any, ...], tuple[ir.Value, ir.Value]]
) -> tuple[ir.Value, ir.Value]:
    """The initializers holding this match's cos and sin caches, shared by every match with the same ones."""
    dtype = found.x.dtype or ir.DataType.FLOAT
    cos, sin = found.cos, found.sin
    key = (cos.kind, cos.values.tobytes(), sin.values.tobytes(), cos.scale, sin.scale, max_positions, dtype)
    if key not in made:
        values = []
        for op, factor in (("cos", cos), ("sin", sin)):
            table = rows(factor, max_positions, op).astype(dtype.numpy())
            name = f"rotary_emb.{op}_cache" + (f".{len(made)}" if made else "")
            value = ir.Value(name=name, shape=ir.Shape(table.shape), type=ir.TensorType(dtype))
            value.const_value = ir.tensor(table, name=name)
            graph.register_initializer(value)
            values.append(value)
        made[key] = (values[0], values[1])
    return made[key]


def _per_token(
    graph: ir.Graph, found: RotaryMatch, made: dict[tuple[ir.Value, ir.Value], tuple[ir.Value, ir.Value, ir.Value]]
) -> tuple[RotaryMatch, tuple[ir.Value, ir.Value]]:
    """``found`` reading per-token caches: its factors' computed halves ``h`` [batch, sequence, rotary_dim/2]
    (``Concat(h, h)`` proves the rotate_half layout) flattened to one row per token, read at positions
    ``arange(batch * sequence)`` in x's [batch, sequence] shape. The kernel then rotates each token by its own
    row, whatever computed it (M-RoPE's sections from three position rows); every match reading the same
    factors shares them, built before the first one's anchor."""
    cos, sin = found.cos, found.sin
    assert cos.rows is not None and sin.rows is not None
    key = (cos.rows, sin.rows)
    if key not in made:
        anchor, base = found.anchor, f"rotary_emb.per_token{len(made) or ''}"
        half = found.rotary_dim // 2
        seq_axis = 1 if found.bsnd else 2
        batch = ir.node("Shape", [found.x], {"start": 0, "end": 1}, name=f"{base}/batch")
        seq = ir.node("Shape", [found.x], {"start": seq_axis, "end": seq_axis + 1}, name=f"{base}/sequence")
        grid = ir.node("Concat", [batch.outputs[0], seq.outputs[0]], {"axis": 0}, name=f"{base}/grid")
        width = _int64(f"{base}/half", [half])
        rows_shape = ir.node("Concat", [grid.outputs[0], width.outputs[0]], {"axis": 0}, name=f"{base}/rows")
        flat = _int64(f"{base}/flat", [-1, half])
        nodes = [batch, seq, grid, width, rows_shape, flat]
        tables = []
        for op, factor in (("cos", cos), ("sin", sin)):
            rows = factor.rows
            assert rows is not None
            if factor.scale != 1.0:
                dtype = rows.dtype or found.x.dtype or ir.DataType.FLOAT
                scale = _constant(f"{base}/{op}_scale", np.array(factor.scale, dtype.numpy()))
                scaled = ir.node("Mul", [rows, scale.outputs[0]], name=f"{base}/{op}_scaled")
                nodes += [scale, scaled]
                rows = scaled.outputs[0]
            expand = ir.node("Expand", [rows, rows_shape.outputs[0]], name=f"{base}/{op}_rows")
            cache = ir.node("Reshape", [expand.outputs[0], flat.outputs[0]], name=f"{base}/{op}_cache")
            nodes += [expand, cache]
            cache.outputs[0].name = f"{base}.{op}_cache"
            cache.outputs[0].shape = ir.Shape([None, half])  # one row per token of the call
            tables.append(cache.outputs[0])
        tokens = ir.node("ReduceProd", [grid.outputs[0]], {"keepdims": 0}, name=f"{base}/tokens")
        start, step = _int64(f"{base}/start", 0), _int64(f"{base}/step", 1)
        arange = ir.node("Range", [start.outputs[0], tokens.outputs[0], step.outputs[0]], name=f"{base}/arange")
        positions = ir.node("Reshape", [arange.outputs[0], grid.outputs[0]], name=f"{base}/positions")
        positions.outputs[0].name = f"{base}.positions"
        nodes += [tokens, start, step, arange, positions]
        graph.insert_before(anchor, nodes)
        for value, dtype in ((tables[0], cos.rows.dtype), (tables[1], sin.rows.dtype)):
            if (dtype := dtype or found.x.dtype) is not None:  # TorchScript leaves intermediates untyped
                value.dtype = dtype
        positions.outputs[0].dtype = ir.DataType.INT64
        made[key] = (tables[0], tables[1], positions.outputs[0])
    cos_cache, sin_cache, positions = made[key]
    found = dataclasses.replace(
        found, cos=dataclasses.replace(cos, positions=positions), sin=dataclasses.replace(sin, positions=positions)
    )
    return found, (cos_cache, sin_cache)


def _rewrite(graph: ir.Graph, found: RotaryMatch, outputs: set[ir.Value], caches: tuple[ir.Value, ir.Value]) -> None:
    attributes: dict[str, Any] = {"interleaved": int(found.interleaved)}
    if found.partial:  # ORT requires num_heads with rotary_embedding_dim, though a 4-D input carries the heads
        attributes |= {"rotary_embedding_dim": found.rotary_dim, "num_heads": found.num_heads}
    if found.bsnd:  # a 4-D input is [B, N, S, D] to the kernel: [B, S, N, D] goes in flat, with its heads
        attributes["num_heads"] = found.num_heads
    anchor = found.anchor
    old = anchor.outputs[0]
    positions = found.cos.positions
    feeds = [found.x, positions, *caches]
    if positions.dtype == ir.DataType.INT32:  # RotaryEmbedding takes int64 position_ids
        cast = ir.node("Cast", [positions], {"to": ir.DataType.INT64}, name=f"{anchor.name}/rotary_positions")
        graph.insert_before(anchor, cast)
        feeds[1] = cast.outputs[0]
    if found.cos.shared:  # [sequence] -> [1, sequence], then one row per batch entry below
        zero = ir.tensor(np.array([0], np.int64))
        axis = ir.node("Constant", [], {"value": zero}, name=f"{anchor.name}/rotary_axis")
        row = ir.node("Unsqueeze", [feeds[1], axis.outputs[0]], name=f"{anchor.name}/rotary_positions_2d")
        graph.insert_before(anchor, [axis, row])
        feeds[1] = row.outputs[0]
    start = positions.name == "rotary_emb.position_start"  # one element: every row starts at 0
    if not start and found.cos.kind != "per_token" and (found.cos.shared or not _batched(positions, graph)):
        # Positions a model computes itself (arange(S)[None]) broadcast over the batch in the original; the
        # kernel wants one row per batch entry.
        name = f"{anchor.name}/rotary_positions"
        batch = ir.node("Shape", [found.x], {"start": 0, "end": 1}, name=f"{name}_batch")
        one = ir.node("Constant", [], {"value": ir.tensor(np.array([1], np.int64))}, name=f"{name}_one")
        target = ir.node("Concat", [batch.outputs[0], one.outputs[0]], {"axis": 0}, name=f"{name}_shape")
        expand = ir.node("Expand", [feeds[1], target.outputs[0]], name=f"{name}_expand")
        graph.insert_before(anchor, [batch, one, target, expand])
        feeds[1] = expand.outputs[0]
    if found.bsnd:
        flat_shape = _int64(f"{anchor.name}/rotary_bsh", [0, 0, -1])
        flat = ir.node("Reshape", [found.x, flat_shape.outputs[0]], name=f"{anchor.name}/rotary_bsh")
        graph.insert_before(anchor, [flat_shape, flat])
        if found.x.dtype is not None:
            flat.outputs[0].dtype = found.x.dtype
        feeds[0] = flat.outputs[0]
    # An interleaved rotation goes flat too: onnxscript 0.7.2's MultiHeadAttention rule re-creates the
    # RotaryEmbedding it finds on heads-first q/k without its attributes (interleaved lost: wrong outputs,
    # rejected by fuse_transformer's check, attention left unfused); on the flat form it reads opaque q/k.
    bnsh = (old in outputs or found.interleaved) and not found.partial and not found.bsnd
    heads_first = _transposed_heads(found.x) if bnsh else None
    if heads_first is not None:  # a present read after attention fusion too: rotate it where fuse_gqa will
        flat_shape = _int64(f"{anchor.name}/rotary_flat", [0, 0, -1])
        flat = ir.node("Reshape", [heads_first, flat_shape.outputs[0]], name=f"{anchor.name}/rotary_flat")
        graph.insert_before(anchor, [flat_shape, flat])
        feeds[0] = flat.outputs[0]
    node = ir.node("RotaryEmbedding", feeds, attributes, domain=_MS, name=f"{anchor.name}/RotaryEmbedding")
    new = node.outputs[0]
    new.name = f"{anchor.name}/RotaryEmbedding_output_0"
    graph.insert_before(anchor, node)
    if heads_first is not None:
        head_size = 2 * caches[0].shape[1]  # full rotary: the cache holds half the head's columns
        split_shape = _int64(f"{anchor.name}/rotary_heads", [0, 0, -1, head_size])
        split = ir.node("Reshape", [new, split_shape.outputs[0]], name=f"{anchor.name}/rotary_heads")
        back = ir.node("Transpose", [split.outputs[0]], {"perm": [0, 2, 1, 3]}, name=f"{anchor.name}/rotary_bnsh")
        graph.insert_before(anchor, [split_shape, split, back])
        new.name = f"{anchor.name}/RotaryEmbedding_bsh"
        for value in (flat.outputs[0], new, split.outputs[0]):
            if (dtype := old.dtype or found.x.dtype) is not None:  # TorchScript leaves intermediates untyped
                value.dtype = dtype
        new = back.outputs[0]
        new.name = f"{anchor.name}/RotaryEmbedding_output_0"
    if found.bsnd:
        heads_shape = _int64(f"{anchor.name}/rotary_bsnd", [0, 0, int(found.num_heads or 0), -1])
        split = ir.node("Reshape", [new, heads_shape.outputs[0]], name=f"{anchor.name}/rotary_bsnd")
        graph.insert_before(anchor, [heads_shape, split])
        new.name = f"{anchor.name}/RotaryEmbedding_bsh"
        if (dtype := old.dtype or found.x.dtype) is not None:
            new.dtype = dtype
        new = split.outputs[0]
        new.name = f"{anchor.name}/RotaryEmbedding_output_0"
    if (dtype := old.dtype or found.x.dtype) is not None:
        new.dtype = dtype
    new.shape = old.shape or found.x.shape
    if old in outputs:  # the rotated value is a graph output itself: the new one takes its place and name
        index = list(graph.outputs).index(old)
        name = old.name
        old.name = f"{name}/unfused"
        graph.outputs[index] = new
        new.name = name
    ir.convenience.replace_all_uses_with(old, new)


def _transposed_heads(x: ir.Value) -> ir.Value | None:
    """``y`` where ``x = Transpose(y, perm=[0, 2, 1, 3])``: [B, S, N, D] heads-last, as the projection's Reshape
    wrote it.

    Why: a rotated key that is also a graph output (the present of a decoder without a past, Optimum's
    no-cache branch) outlives attention fusion. fuse_gqa feeds GroupQueryAttention [B, S, N*D] and redoes a
    heads-first rotation on that flat value, so the present's rotation stayed beside it: the keys rotated
    twice per layer. Rotated flat here instead, ``Transpose(Reshape(RotaryEmbedding(Reshape(y, [0, 0, -1])),
    [0, 0, -1, D]))`` is the same tensor (the kernel rotates each head's row alike in either layout, by the
    same positions and caches), costs what ``RotaryEmbedding(Transpose(y))`` did, and fuse_gqa reads its
    Transpose's input straight, so the one rotation serves the present and the attention."""
    producer = x.producer()
    if producer is None or producer.op_type != "Transpose" or producer.domain not in ("", "ai.onnx"):
        return None
    if list(producer.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        return None
    return producer.inputs[0]


def _int64(name: str, values: list[int] | int) -> ir.Node:
    return _constant(name, np.array(values, np.int64))


def _constant(name: str, array: np.ndarray) -> ir.Node:
    return ir.node("Constant", [], {"value": ir.tensor(array, name=name)}, name=f"{name}_shape")


def _downstream(nodes: list[ir.Node]) -> list[ir.Node]:
    """Nodes reading the matched ones that lead nowhere (an earlier pass's leftover Identity, left for the final
    dead_node_elimination): they would keep the trigonometry alive, so they are candidates too."""
    matched = set(nodes)
    found: list[ir.Node] = []
    frontier = nodes
    for _ in range(4):
        frontier = [u.node for n in frontier for v in n.outputs for u in v.uses() if u.node not in matched]
        found += frontier
    return found


def _batched(positions: ir.Value, graph: ir.Graph) -> bool:
    """Whether position_ids has the batch's rows: a graph input (the caller feeds one row per sequence, as
    Optimum's signature does) whose first dim is not a fixed 1."""
    shape = positions.shape
    return positions in graph.inputs and shape is not None and len(shape) == 2 and shape[0] != 1


def _remove_dead(graph: ir.Graph, candidates: list[ir.Node], outputs: set[ir.Value]) -> int:
    """Remove the matched nodes, and what fed only them, once nothing reads their outputs."""
    pending = list(dict.fromkeys(candidates))
    removed = 0
    constants: list[ir.Value] = []
    while pending:
        node = pending.pop()
        if node.graph is not graph or any(v.uses() or v in outputs for v in node.outputs):
            continue
        feeders = [v for v in node.inputs if v is not None]
        graph.remove(node, safe=True)
        removed += 1
        pending.extend(p for v in feeders if (p := v.producer()) is not None)
        constants += [v for v in feeders if v.is_initializer()]
    for value in constants:  # inv_freq and the folded tables, now read by nothing
        if not value.uses() and value.name in graph.initializers and value not in graph.inputs:
            del graph.initializers[value.name]  # type: ignore[arg-type]
    return removed


def cache_rows(model: ir.Model) -> dict[str, np.ndarray]:
    """The cos/sin caches the pass wrote, by initializer name (tests and the benchmark read them)."""
    return {
        name: value.const_value.numpy()
        for name, value in model.graph.initializers.items()
        if name.startswith("rotary_emb.") and value.const_value is not None
    }
