"""padding_elimination: run the token-wise part of an encoder on the valid tokens only.

Re-implements ONNX Runtime's training-only ``PaddingElimination``
(orttraining/core/optimizer/compute_optimizer/padding_elimination.cc) over plain ONNX for inference. The
word-embedding lookup reads only the valid tokens, flattened to one dim ``K``; every token-wise op after
it (projections, biases, residual Adds, LayerNorm, FFN, Gelu) runs on ``[K, ...]`` instead of
``[B, S, ...]``; attention, which mixes tokens, stays padded. Before (one BERT layer)::

    ids[B,S] -> Gather(E) -> ... -> LN -> h[B,S,H] -> MatMul+Add (Q,K,V) -> Reshape(heads) -> attention
    attention -> Reshape(merge) -> MatMul(Wo)+Add -> Add(h) -> LN -> FFN -> Add -> LN -> out[B,S,H]

After::

    idx[K] = Squeeze(NonZero(Reshape(mask != 0 with column 0 forced, [-1])), 0)
    ids -> Reshape[-1] -> Gather(idx) -> Gather(E) -> ... -> LN -> h[K,H] -> MatMul+Add (Q,K,V) --+
      +-- PadAndUnflatten -> Reshape(heads) -> attention -> Reshape(merge) -> FlattenAndUnpad --+
      +-- MatMul(Wo)+Add -> Add(h) -> LN -> FFN -> Add -> LN -> PadAndUnflatten -> out[B,S,H]

    FlattenAndUnpad(x) = Gather(Reshape(x, [-1, rest]), idx, axis=0)
    PadAndUnflatten(y) = Reshape(ScatterND(zeros[B*S, rest], Unsqueeze(idx, -1), y), [B, S, rest])

Validity comes from the ``attention_mask`` input (``mask_input`` names another), or ``ids !=
pad_token_id``. Position 0 of every row is always kept: ``K >= 1`` whenever ``B*S > 0`` (ORT 1.32 runs
every op here on empty tensors, but other runtimes need not), and a CLS readout ``h[:, 0]`` is exact even
under left padding. A row with no valid token keeps its CLS position but attends only to padding in the
original graph too; its values there are not preserved.

Pad positions of the outputs become undefined: the re-padding writes zeros where the original computed
values from pad tokens. Before rewriting, every reader of a re-padded tensor is traced (``PadReads`` in
``_padding_rules``); it is accepted only if it reaches attention keys or values behind the extended mask
(``Add(mask-derived) -> Softmax``, ``probs @ V``), query rows that stay aligned with tokens, re-entry into
the unpadded subgraph, masked pooling (``h * mask``), the forced position 0, or a graph output with the
token dims at axes 0 and 1. Such outputs are listed in the result's ``valid_positions`` (and its notes) as
``{"<output>": {"mask_input": "<mask input>", "axes": [0, 1]}}``: the verifier compares only the entries
whose mask is nonzero. Anything else (unmasked mean pooling, a Gather on the sequence axis) is refused.

Fixes over ORT: validity from the attention mask (an ONNX export has no ``padding_idx``); graph outputs
inside the subgraph are re-padded (ORT leaves them ``[K, ...]``); pad reads are checked; operands of a
joined op whose producers are token-wise with a single consumer are unpadded at the top of that chain
(the attention output projection ``MatMul(Wo) -> Add(bo)`` runs unpadded, and ``token_type`` and position
embeddings gather only the rows they need) where ORT unpads the ``[B,S,H]`` result; ``[1,S,H]``
position embeddings are read at ``idx mod S`` instead of expanded to ``[B,S,H]``. Gated like ORT's input
inspector: applied only when the token density on the samples is below ``density_threshold``.

Checked on a HF ``BertModel`` exported by ``torch.onnx`` (dynamo) with eager attention (a ``[B,1,S,S]``
``Where`` mask, the pooler's CLS slice): exact on valid positions. Not handled yet: the SDPA
decomposition, which reshapes K to ``[-1, S, dh]`` with a shape computed from ``Shape`` ops; the pad-read
trace cannot prove that Reshape keeps the token axes and the pass refuses.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any

import numpy as np
import onnx_ir as ir
from pydantic import Field

from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes._match import node_label, take_graph_output
from passes.compute_order._padding_rules import (
    BINARY,
    PadReads,
    Rule,
    const_array,
    dims,
    operand_kind,
    pull_up,
    rank,
    token_rule,
    varies,
)

_MASK_NAME = re.compile(r"attention_mask|(^|_)mask$", re.IGNORECASE)
_IDS_NAME = re.compile(r"input_ids|(^|_)ids$", re.IGNORECASE)
_INT_MAX = np.iinfo(np.int64).max
_PREFIX = "padding_elimination"


class PaddingEliminationOptions(PassOptions):
    mask_input: str | None = Field(
        None,
        description="Graph input holding the [batch, seq] attention mask (nonzero = valid token); default: "
        "the input named like attention_mask.",
    )
    pad_token_id: int | None = Field(
        None,
        description="Take validity from input_ids != pad_token_id instead of the mask; the model must mask "
        "exactly those tokens in attention.",
    )
    density_threshold: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Apply only when the share of valid tokens on the samples is below this (ORT's input "
        "inspector uses 0.9).",
    )
    force: bool = Field(False, description="Apply without measuring the token density (no samples needed).")


@dataclasses.dataclass
class _Plan:
    source: ir.Value  # the validity input: the mask, or the ids with pad_token_id
    mask: ir.Value | None  # the attention mask input, when the graph has one
    seed: ir.Node
    rules: dict[ir.Node, Rule]  # every node that runs unpadded, in graph order, seed included
    unpads: list[tuple[ir.Node, int, str]]  # (node, input, operand kind) read through FlattenAndUnpad
    inside: dict[ir.Value, list[Any]]  # unpadded values -> their original dims
    boundaries: list[ir.Value]  # unpadded values also read padded (outside consumers, graph outputs)


class PaddingElimination(Pass[PaddingEliminationOptions]):
    name = "padding_elimination"
    summary = "Run an encoder's token-wise ops (projections, FFN, LayerNorm) on valid tokens only."
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        options = self.options
        notes: dict[str, Any] = {"threshold": options.density_threshold}
        counts = {"ops_unpadded": 0, "boundaries": 0}
        plan = self._plan(model, notes)
        if isinstance(plan, NonMatch):
            notes["decision"] = f"refused: {plan.reason}"
            return PassResult(model, False, counts, [plan], notes)

        density = _density(plan, options.pad_token_id, ctx.samples)
        notes["token_density"] = density
        if not options.force:
            reason = None
            if density is None:
                reason = "no samples to measure the token density of (give samples or force)"
            elif density >= options.density_threshold:
                reason = (
                    f"token density {density:.1%} >= threshold {options.density_threshold:.0%}: "
                    "unpadding would cost more than it saves"
                )
            if reason:
                notes["decision"] = "skipped"
                return PassResult(model, False, counts, [NonMatch(reason, node_label(plan.seed), "Gather")], notes)

        _rewrite(model.graph, plan, options.pad_token_id)
        notes["decision"] = "applied"
        notes["unpadded_op_types"] = dict(Counter(n.op_type for n in plan.rules))
        counts = {"ops_unpadded": len(plan.rules), "boundaries": len(plan.boundaries)}
        return PassResult(model, True, counts, [], notes, valid_positions=notes["valid_positions"])

    def _plan(self, model: ir.Model, notes: dict[str, Any]) -> _Plan | NonMatch:
        options = self.options
        graph = model.graph
        opset = graph.opset_imports.get("", 0)
        if opset < 13:
            return NonMatch(f"default-domain opset {opset} < 13 (Squeeze/Unsqueeze with axes inputs needed)")
        if any(v.shape is None for node in graph for v in node.outputs if v.uses() or v.is_graph_output()):
            from passes.cleanup.shape_inference import ShapeInference

            ShapeInference().call(model, PassContext())
            notes["shape_inference"] = "ran onnx shape inference first: some value shapes were missing"

        mask = _find_mask(graph, options.mask_input)
        if isinstance(mask, NonMatch):
            return mask
        seed = _find_seed(graph)
        if seed is None:
            return NonMatch("no word-embedding Gather(table[V,H], input_ids[B,S]) on a rank-2 graph input")
        ids = seed.inputs[1]
        assert ids is not None
        if options.pad_token_id is None and mask is None:
            return NonMatch(
                "no validity source: no input named like attention_mask; name it with mask_input or give pad_token_id",
                node_label(seed),
                "Gather",
            )
        source = ids if options.pad_token_id is not None else mask
        assert source is not None
        id_dims, source_dims = dims(ids) or [], dims(source) or []
        for a, b in zip(id_dims, source_dims, strict=True):
            if isinstance(a, int) and isinstance(b, int) and a != b:
                return NonMatch(f"mask {source.name} has dims {source_dims}, the ids {id_dims}")

        plan = _grow(graph, seed, opset, source, mask)
        if isinstance(plan, NonMatch):
            return plan
        # Masks the model applies count as masking pad tokens: with pad_token_id, any input named like a mask
        # (the caller asserts it masks exactly the pad ids); the ids themselves (ids != pad).
        sources = [source] if mask is None else [source, mask]
        if options.pad_token_id is not None:
            sources += [v for v in graph.inputs if _MASK_NAME.search(v.name or "") and v is not mask]
        additive, mask01 = _mask_values(graph, sources, mask)
        reads = PadReads(
            inside_nodes=set(plan.rules),
            unpad_sites={(n, i) for n, i, _ in plan.unpads},
            mask_additive=additive,
            mask01=mask01,
            opset=opset,
        )
        # h * mask is zero at pad positions in the original graph, which is what PadAndUnflatten writes there.
        zero_at_pad = {
            node.outputs[0]
            for node in plan.rules
            if node.op_type == "Mul"
            and any(v in mask01 and varies(v, rank(node.outputs[0]) or 0, 0, 1) for v in node.inputs)
        }
        refused = reads.run(graph, [v for v in plan.boundaries if v not in zero_at_pad])
        if refused is not None:
            reason, node = refused
            return NonMatch(
                f"a reader of the re-padded tensors may see pad positions: {reason}",
                node_label(node) if node else None,
                node.op_type if node else None,
            )
        # A value carrying a taint on axes (0, 1) comes from a re-padded tensor: it is [B, S, ...], so it
        # needs no Expand even where shape inference lost the symbols (the attention's head merge).
        plan.unpads = [
            (n, i, "tokens" if kind == "expand" and _from_pad(reads, n.inputs[i]) else kind)
            for n, i, kind in plan.unpads
        ]
        valid_positions = {}
        for out in graph.outputs:
            taints = reads.output_taint(out)
            if not taints:
                continue
            if taints != {("row", 0, 1)}:
                return NonMatch(
                    f"graph output {out.name} has pad-dependent entries on axes other than [batch, seq] at 0, 1"
                )
            where: dict[str, Any] = {"mask_input": (mask or source).name, "axes": [0, 1]}
            if mask is None:  # validity from the ids: valid where ids != pad_token_id
                where = {"ids_input": source.name, "pad_token_id": options.pad_token_id, "axes": [0, 1]}
            valid_positions[out.name] = where
        notes["valid_positions"] = valid_positions
        return plan


def _from_pad(reads: PadReads, value: ir.Value | None) -> bool:
    return value is not None and any(t[1:] == (0, 1) for t in reads.output_taint(value))


def _find_mask(graph: ir.Graph, name: str | None) -> ir.Value | NonMatch | None:
    if name is not None:
        found = [v for v in graph.inputs if v.name == name]
        if not found:
            return NonMatch(f"mask_input {name!r} is not a graph input")
        if rank(found[0]) != 2:
            return NonMatch(f"mask input {name} is not [batch, seq] (rank {rank(found[0])})")
        return found[0]
    candidates = [v for v in graph.inputs if _MASK_NAME.search(v.name or "") and rank(v) == 2]
    return candidates[0] if candidates else None


def _find_seed(graph: ir.Graph) -> ir.Node | None:
    """The word-embedding Gather: a constant [V,H] table indexed by a rank-2 integer graph input."""
    found = []
    for node in graph:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        table, ids = node.inputs
        if node.attributes.get_int("axis", 0) != 0 or table is None or ids is None:
            continue
        if ids.is_graph_input() and rank(ids) == 2 and rank(table) == 2 and const_array(table) is not None:
            found.append(node)
    if not found:
        return None
    named = [n for n in found if _IDS_NAME.search(n.inputs[1].name or "")]  # type: ignore[union-attr]
    return (named or sorted(found, key=lambda n: -(dims(n.inputs[0]) or [0])[0]))[0]  # type: ignore[arg-type]


def _grow(graph: ir.Graph, seed: ir.Node, opset: int, source: ir.Value, mask: ir.Value | None) -> _Plan | NonMatch:
    """Join every token-wise consumer of an unpadded value, in graph (topological) order."""
    rules: dict[ir.Node, Rule] = {seed: Rule(1)}
    unpads: list[tuple[ir.Node, int, str]] = [(seed, 1, "tokens")]
    inside: dict[ir.Value, list[Any]] = {}
    out = seed.outputs[0]
    if rank(out) != 3:
        return NonMatch("the embedding output is not [batch, seq, hidden]", node_label(seed), "Gather")
    inside[out] = dims(out) or []
    for node in graph:
        if node in rules:
            continue
        tokens = [i for i, v in enumerate(node.inputs) if v in inside]
        if not tokens:
            continue
        joined = _join(node, tokens, inside, opset)
        if joined is None:
            continue  # a boundary: the consumer reads the re-padded tensor
        rule, operands = joined
        for index, kind in operands:
            value = node.inputs[index]
            assert value is not None
            chain: list[tuple[ir.Node, Rule]] = []
            if kind not in ("leave", "squeeze") and rank(value) == rank(node.outputs[0]):
                chain, _ = pull_up(value, opset, set(inside))
            for producer, producer_rule in reversed(chain):
                rules[producer] = producer_rule
                inside.update({o: dims(o) or [] for o in producer.outputs})
            if chain:
                top, top_rule = chain[-1]
                unpads.append((top, top_rule.token_input, kind))
            else:
                unpads.append((node, index, kind))
        rules[node] = rule
        inside.update({o: dims(o) or [] for o in node.outputs if o is not None})
    ordered = {n: rules[n] for n in graph if n in rules}
    boundaries = [v for v in inside if v.is_graph_output() or any(use.node not in rules for use in v.uses())]
    return _Plan(source, mask, seed, ordered, unpads, inside, boundaries)


def _join(
    node: ir.Node, tokens: list[int], inside: dict[ir.Value, list[Any]], opset: int
) -> tuple[Rule, list[tuple[int, str]]] | None:
    rule = token_rule(node, tokens[0], opset)
    if isinstance(rule, str):
        return None
    if node.op_type not in BINARY:
        return (rule, []) if tokens == [rule.token_input] else None
    out_rank = rank(node.outputs[0])
    token = node.inputs[rule.token_input]
    if out_rank is None or token is None or any(rank(node.inputs[i]) != out_rank for i in tokens):
        return None
    operands = []
    for index, value in enumerate(node.inputs):
        if value is None or value in inside:
            continue
        kind = operand_kind(value, out_rank, inside[token][:2])
        if kind.startswith("refuse"):
            return None
        if kind != "leave":
            operands.append((index, kind))
    return rule, operands


def _mask_values(
    graph: ir.Graph, sources: list[ir.Value], mask: ir.Value | None
) -> tuple[set[ir.Value], set[ir.Value]]:
    """Values computed from the validity inputs and constants only, and the 0/1 mask behind shape ops."""
    constant: set[ir.Value] = set(graph.initializers.values())
    derived, mask01 = set(sources), {mask} if mask is not None else set()
    for node in graph:
        ins = [v for v in node.inputs if v is not None]
        outs = set(node.outputs)
        if node.op_type in ("Shape", "Size") or all(v in constant for v in ins):
            constant |= outs
        elif all(v in constant or v in derived for v in ins):
            derived |= outs
        if node.op_type in ("Cast", "Unsqueeze", "Reshape", "Expand", "Identity", "Squeeze") and ins[:1]:
            mask01 |= outs if ins[0] in mask01 else set()
    return derived, mask01


def _density(plan: _Plan, pad: int | None, samples: list[dict[str, np.ndarray]]) -> float | None:
    name = plan.source.name
    arrays = [np.asarray(s[name]) for s in samples if name in s]
    total = sum(a.size for a in arrays)
    if not total:
        return None
    valid = sum(int(np.count_nonzero(a != (0 if pad is None else pad))) for a in arrays)
    return valid / total


# ------------------------------------------------------------------------------------------------ rewrite


class _Emit:
    """Collects new nodes with readable, unique names under ``padding_elimination/``."""

    def __init__(self) -> None:
        self.nodes: list[ir.Node] = []
        self._count = 0

    def op(self, op_type: str, inputs: list[ir.Value], attrs: dict[str, Any] | None = None, stem: str = "") -> ir.Value:
        self._count += 1
        name = f"{_PREFIX}/{stem or op_type.lower()}_{self._count}"
        node = ir.node(op_type, inputs, attrs or {}, name=name)
        node.outputs[0].name = name
        self.nodes.append(node)
        return node.outputs[0]

    def const(self, array: Any, dtype: Any = np.int64, stem: str = "const") -> ir.Value:
        return self.op("Constant", [], {"value": ir.tensor(np.asarray(array, dtype=dtype))}, stem)

    def take(self) -> list[ir.Node]:
        nodes, self.nodes = self.nodes, []
        return nodes


class _Validity:
    """idx (the kept flat token positions) and the shapes PadAndUnflatten needs, built once."""

    def __init__(self, emit: _Emit, source: ir.Value, pad: int | None) -> None:
        self.emit = emit
        dtype = source.dtype.numpy() if source.dtype is not None else np.int64
        pad_value = emit.const(0 if pad is None else pad, dtype, "pad_value")
        valid = emit.op("Not", [emit.op("Equal", [source, pad_value])], stem="valid")
        first = emit.op("Slice", [valid, emit.const([0]), emit.const([1]), emit.const([1])])
        first = emit.op("Or", [first, emit.const(True, np.bool_)], stem="keep_position_0")
        rest = emit.op("Slice", [valid, emit.const([1]), emit.const([_INT_MAX]), emit.const([1])])
        keep = emit.op("Concat", [first, rest], {"axis": 1}, "keep")
        keep = emit.op("Reshape", [keep, emit.const([-1])], stem="keep_flat")
        self.idx = emit.op("Squeeze", [emit.op("NonZero", [keep]), emit.const([0])], stem="valid_token_index")
        self.tokens = ir.SymbolicDim(f"{_PREFIX}/valid_tokens")
        self.idx.dtype, self.idx.shape = ir.DataType.INT64, ir.Shape([self.tokens])
        self.bs = emit.op("Shape", [source], stem="batch_seq")
        self.flat = emit.op("Shape", [keep], stem="batch_x_seq")
        self.idx_col = emit.op("Unsqueeze", [self.idx, emit.const([-1])], stem="scatter_index")
        self.seq = emit.op("Slice", [self.bs, emit.const([1]), emit.const([2])], stem="seq")
        self.nodes = emit.take()


def _rest(emit: _Emit, rest: list[Any], of: ir.Value, skip: int) -> ir.Value | None:
    """The trailing dims as a 1-D int64 value: a constant when static, else sliced from Shape(of)."""
    if not rest:
        return None
    if all(isinstance(d, int) for d in rest):
        return emit.const(rest)
    return emit.op("Slice", [emit.op("Shape", [of]), emit.const([skip]), emit.const([_INT_MAX])])


def _unpad(emit: _Emit, valid: _Validity, x: ir.Value, kind: str, token_rank: int) -> ir.Value:
    """FlattenAndUnpad: ``x`` (broadcastable to [B,S,rest]) as [K, rest] (or [1, rest] for [1,1,...])."""
    d, dtype = dims(x) or [], x.dtype
    lead = 2 if len(d) == token_rank else 1  # a rank-(r-1) operand is [S, rest] with an implicit leading 1
    rest = d[lead:]
    if kind == "expand":
        ones = emit.const([1] * len(rest))
        x = emit.op("Expand", [x, emit.op("Concat", [valid.bs, ones], {"axis": 0})] if rest else [x, valid.bs])
        lead = 2
    if lead == 2:
        rest_value = _rest(emit, rest, x, 2)
        shape = (
            emit.const([-1]) if rest_value is None else emit.op("Concat", [emit.const([-1]), rest_value], {"axis": 0})
        )
        x = emit.op("Reshape", [x, shape], stem="flatten")
    if kind == "squeeze":
        return x
    index = {"seq": "Mod", "batch": "Div"}.get(kind)
    idx = valid.idx if index is None else emit.op(index, [valid.idx, valid.seq], stem=f"index_{kind}")
    out = emit.op("Gather", [x, idx], {"axis": 0}, "unpad")
    out.dtype = dtype
    out.shape = ir.Shape([valid.tokens, *[ir.SymbolicDim(r) if isinstance(r, str) or r is None else r for r in rest]])
    return out


def _pad(emit: _Emit, valid: _Validity, value: ir.Value, original: list[Any]) -> ir.Value:
    """PadAndUnflatten: [K, rest] back to [B, S, rest], zeros at the pad positions."""
    rest = _rest(emit, original[2:], value, 1)
    dtype = value.dtype or ir.DataType.FLOAT
    zero = ir.tensor(np.zeros(1, dtype=dtype.numpy()))
    flat_shape = valid.flat if rest is None else emit.op("Concat", [valid.flat, rest], {"axis": 0})
    zeros = emit.op("ConstantOfShape", [flat_shape], {"value": zero}, "zeros")
    scattered = emit.op("ScatterND", [zeros, valid.idx_col, value], stem="scatter")
    full_shape = valid.bs if rest is None else emit.op("Concat", [valid.bs, rest], {"axis": 0})
    padded = emit.op("Reshape", [scattered, full_shape], stem="pad")
    padded.dtype, padded.shape = value.dtype, value.shape
    return padded


def _rewrite(graph: ir.Graph, plan: _Plan, pad: int | None) -> None:
    emit = _Emit()
    valid = _Validity(emit, plan.source, pad)
    graph.insert_before(next(iter(graph)), valid.nodes)
    anchor = valid.nodes[-1]

    unpadded: dict[tuple[ir.Value, str], ir.Value] = {}
    for node, index, kind in plan.unpads:
        x = node.inputs[index]
        assert x is not None
        if (x, kind) not in unpadded:
            token_rank = len(plan.inside[node.outputs[0]]) if node is not plan.seed else 2
            if node.op_type == "Gather":
                token_rank = rank(x) or 2
            unpadded[(x, kind)] = _unpad(emit, valid, x, kind, token_rank)
            producer = x.producer()
            graph.insert_after(producer if producer is not None and producer.graph is graph else anchor, emit.take())
        node.replace_input_with(index, unpadded[(x, kind)])

    for node, rule in plan.rules.items():
        if rule.update is not None:
            rule.update(node)

    for value in plan.boundaries:
        readers = [use for use in value.uses() if use.node not in plan.rules]
        padded = _pad(emit, valid, value, plan.inside[value])
        producer = value.producer()
        assert producer is not None
        graph.insert_after(producer, emit.take())
        for use in readers:
            use.node.replace_input_with(use.idx, padded)
        take_graph_output(graph, value, padded, "/unpadded")

    for value, original in plan.inside.items():
        value.shape = ir.Shape([valid.tokens, *[_dim(d) for d in original[2:]]])
    for node in reversed(list(graph)):  # helpers no unpad needed (the sequence length for idx mod S)
        if (node.name or "").startswith(_PREFIX) and not any(o.uses() or o.is_graph_output() for o in node.outputs):
            graph.remove(node, safe=True)


def _dim(d: Any) -> int | ir.SymbolicDim:
    return d if isinstance(d, int) else ir.SymbolicDim(d)
