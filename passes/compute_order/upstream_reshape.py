"""Move a ``[B,S,H] -> [B*S,H]`` Reshape above the ops that produce its input.

Re-implements ORT's training-only ``UpStreamReshapeGraphTransformer`` (``onnxruntime/core/optimizer/
compute_optimizer/upstream_reshape.cc`` and ``upstream_reshape_actors.cc``).
An LM head ends in ``logits.view(-1, V)`` for the loss; moving the flatten up makes the head 2-D, so a
row filter on axis 0 (``label_sparsity``'s Gather, moved by ``upstream_slice``) can then climb the head::

    before:  h[B,S,H] --LayerNorm(-1)--> MatMul(W[H,V]) --> Add(b[V]) --> Reshape([-1,V]) --> [B*S,V] --> loss
    after:   h[B,S,H] --Reshape([-1,H])--> LayerNorm(axis 1) --> MatMul(W) --> Add(b) --> [B*S,V] --> loss

Entry: any Reshape whose input is rank 3 and output rank 2 with the same, known, last dim. That is
exactly "flatten the two leading dims", whatever the shape input (constant ``[-1,H]``, ``[B*S,H]`` or
computed from ``Shape``). Each move puts ``Reshape(x, [-1, d2])`` on the inputs of P that carry the
leading dims and enqueues those Reshapes.

Rules (input ``x`` of P, output ``O = [B,S,H]``):

* element-wise ops (``upstream_slice``'s list, which is longer than ORT's Add/Cast/Dropout/BiasGelu):
  ``x`` rank 3 with both leading dims equal to O's, or both 1, gets the Reshape; rank <= 1 or a rank-2
  ``[1, d]`` broadcasts the same way against ``[B*S,H]`` and is left alone; anything else refuses.
  Its last dim must equal H or be 1.
* LayerNormalization, Softmax, LogSoftmax: axis 2 (or -1) only, which becomes 1; only ``X`` is reshaped.
* ReduceMean over axis -1 alone with keepdims (an RMS norm's statistic): only ``X`` is reshaped, the axis
  stays -1, so a flatten crosses a whole RMS norm instead of splitting it.
* MatMul: lhs rank 3 and rhs rank 2; only lhs is reshaped.

Fixes over ORT: a rank-2 ``[1,H]`` or ``[B,S,1]`` input is accepted (ORT refuses every broadcast but the
rank-1 one); a P output that is a graph output refuses; a branch reaching a graph input ends only that
branch; the copy's shape constant is ``[-1, d2]`` with d2 a positive known value, so -1 is inferable
even for an empty batch; copies meeting on a shared value merge: when every reader of P's output is the
same flatten (the two halves of an erf-GELU, the FFN and the residual Add reading one LayerNorm), they
become one and it moves on, where ORT stops at the first value with two consumers. On a BERT masked-LM
the flatten then crosses the LM head's transform and the last layer's FFN, residual Adds and LayerNorms
up to the attention's merged heads, so with ``label_sparsity`` only the last attention (its Q, K, V
projections and scores) still runs on every token.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import onnx_ir as ir
from pydantic import Field

from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes._match import drop_orphans, node_label
from passes.cleanup.shape_inference import ensure_shapes
from passes.compute_order._upstream_rules import (
    POINTWISE,
    Dim,
    FreshNames,
    producer_to_cross,
    same_dim,
    same_input,
)

_ONNX = ("", "ai.onnx")
_NORMS = ("LayerNormalization", "Softmax", "LogSoftmax")


class UpstreamReshapeOptions(PassOptions):
    max_rounds: int = Field(
        16, ge=1, le=1000, description="Sweeps over the graph before stopping even if Reshapes still move."
    )


def _dims(value: ir.Value | None) -> list[Dim] | None:
    return None if value is None or value.shape is None else list(value.shape)


def _positive(d: Dim) -> bool:
    return isinstance(d, int) and d > 0


def _entry(node: ir.Node) -> str | None:
    """Why this Reshape is not a leading-dims flatten, or None when it is."""
    src, out = _dims(node.inputs[0]), _dims(node.outputs[0])
    if src is None or out is None or len(src) != 3 or len(out) != 2:
        return "not a rank-3 -> rank-2 Reshape of known ranks"
    if not (_positive(src[2]) and same_dim(src[2], out[1])):
        return f"last dim {src[2]} -> {out[1]} is not the same known value"
    if node.outputs[0].is_graph_output():
        return "output is a graph output"
    return None


def _plan(p: ir.Node, out: list[Dim]) -> dict[int, Dim] | str:
    """P's inputs to flatten, each with its new leading dim; or why not. ``out`` is P's [B,S,H] output."""
    domain = "" if p.domain == "ai.onnx" else p.domain
    if (domain, p.op_type) in POINTWISE:
        flat: dict[int, Dim] = {}
        for i, value in enumerate(p.inputs):
            dims = _dims(value)
            if value is None:
                continue
            if dims is None:
                return f"input {i} has no shape"
            if dims and not (same_dim(dims[-1], out[2]) or dims[-1] == 1):
                return f"input {i} last dim {dims[-1]} is neither {out[2]} nor 1"
            if len(dims) <= 1 or (len(dims) == 2 and dims[0] == 1):
                continue  # broadcasts against [B*S, H] exactly as against [B, S, H]
            if len(dims) == 3 and same_dim(dims[0], out[0]) and same_dim(dims[1], out[1]):
                flat[i] = None  # the flattened count, like the entry's
            elif len(dims) == 3 and dims[0] == 1 and dims[1] == 1:
                flat[i] = 1
            else:
                return f"input {i} shape {dims} does not carry both leading dims of {out}"
        return flat
    if domain == "" and p.op_type in _NORMS:
        # Softmax before opset 13 defaults to axis 1 (and coerces to 2-D there; axis 2 is still the last).
        default = -1 if p.op_type == "LayerNormalization" or _opset(p) >= 13 else 1
        axis = p.attributes.get_int("axis", default)
        if axis % 3 != 2:
            return f"{p.op_type} axis {axis} is not the last of 3"
        return {0: None}
    if domain == "" and p.op_type == "ReduceMean":
        # An RMS norm's statistic, mean(x^2) over the last axis: the flatten goes through it like through a
        # LayerNorm. Stopping here left the norm split, its Div/Mul 2-D and its statistic 3-D, which neither
        # onnxscript nor ORT's session fuses (a MoE block's hidden.view(-1, H) after the norm, dynamo).
        if not p.attributes.get_int("keepdims", 1) or _reduce_axes(p) != [-1]:
            return "ReduceMean not over the last axis alone (-1) with keepdims"
        return {0: None}
    if domain == "" and p.op_type == "MatMul":
        lhs, rhs = _dims(p.inputs[0]), _dims(p.inputs[1])
        if lhs is None or rhs is None or len(lhs) != 3 or len(rhs) != 2:
            return "MatMul needs a rank-3 lhs and a rank-2 rhs"
        return {0: None}
    return f"{p.op_type} is not in the allow-list"


def _reduce_axes(node: ir.Node) -> list[int] | None:
    """ReduceMean's axes, from its constant second input (opset 18) or its attribute."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        tensor = ir.convenience.get_const_tensor(node.inputs[1])  # an initializer or a Constant node's
        return None if tensor is None else [int(a) for a in tensor.numpy().reshape(-1)]
    return node.attributes.get_ints("axes", None)


def _opset(node: ir.Node) -> int:
    graph = node.graph
    return 1 if graph is None else graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 1))


def _is_twin(reshape: ir.Node, other: ir.Node, index: int) -> bool:
    """Whether ``other``, reading the same value at ``index``, is the same flatten as ``reshape``.

    Branches of one value (the two halves of an erf-GELU, a residual Add and the FFN reading one
    LayerNorm) each get a copy of the flatten; once all of them have arrived the copies are merged and the
    flatten moves on, where ORT (and a single pass here) stops at the first value with two consumers."""
    return (
        other.op_type == "Reshape"
        and other.domain in _ONNX
        and index == 0
        and other.attributes.get_int("allowzero", 0) == reshape.attributes.get_int("allowzero", 0)
        and same_input(other.inputs[1], reshape.inputs[1])
        and _entry(other) is None
    )


def _step(reshape: ir.Node) -> tuple[ir.Node, dict[int, Dim], list[ir.Node]] | str:
    found = producer_to_cross(reshape, lambda other, index: _is_twin(reshape, other, index))
    if isinstance(found, str):
        return found
    p, twins = found
    data = reshape.inputs[0]
    assert data is not None and data.shape is not None
    label = repr(node_label(p))
    plan = _plan(p, list(data.shape))
    if isinstance(plan, str):
        return f"{label} ({plan})"
    if not plan:
        return f"{label} (no input carries the leading dims)"
    for i in plan:
        if not _positive(p.inputs[i].shape[-1]):
            return f"{label} (input {i} last dim {p.inputs[i].shape[-1]} is not a known positive value)"
    return p, plan, twins


def _merge(graph: ir.Graph, keep: ir.Node, twins: list[ir.Node]) -> None:
    """Readers of each twin read ``keep`` instead; the twins go."""
    for twin in twins:
        ir.convenience.replace_all_uses_with(twin.outputs[0], keep.outputs[0])
        inputs = list(twin.inputs)
        graph.remove(twin, safe=True)
        drop_orphans(graph, inputs)


def _reshape_source(value: ir.Value) -> tuple[ir.Value, ir.Node | None]:
    """What the copy flattens: the input of the Reshape that made ``value``, when one did; else ``value``.

    A Reshape only relabels row-major data, so ``Reshape(Reshape(x, s), [-1, d])`` is ``Reshape(x, [-1, d])``
    for any ``s`` and allowzero (the copy's shape has no 0). Leaving the chain hands the fusions a
    Reshape(Reshape) on every merged-heads output (LeViT's attentions), which onnxscript 0.7.2 collapses once
    per optimizer round into an initializer named ``<output>/shape``: the second collapse on one output
    re-registers that name, evicting the first initializer while other Reshapes still read it, and the
    fused candidate is refused as a graph with a dangling value."""
    producer = value.producer()
    if producer is not None and producer.op_type == "Reshape" and producer.domain in _ONNX:
        source = producer.inputs[0]
        if source is not None:
            return source, producer
    return value, None


def _apply(
    graph: ir.Graph, names: FreshNames, entry: ir.Node, p: ir.Node, plan: dict[int, Dim], *, twins: list[ir.Node]
) -> list[ir.Node]:
    _merge(graph, entry, twins)
    flat = entry.outputs[0].shape[0]  # B*S as the entry's output knows it (a value, a symbol or unknown)
    origin = (entry.name or "reshape").split("@")[0]
    copies = []
    for i, lead in plan.items():
        value = p.inputs[i]
        last = value.shape[-1]
        shape = ir.val(names(f"{origin}@{p.name}_in{i}_shape"), const_value=ir.tensor(np.array([-1, last], np.int64)))
        shape.dtype, shape.shape = ir.DataType.INT64, ir.Shape([2])
        graph.register_initializer(shape)
        source, folded = _reshape_source(value)
        copy = ir.node("Reshape", [source, shape], name=names(f"{origin}@{p.name}_in{i}"))
        copy.outputs[0].name = names(f"{origin}@{p.name}_in{i}_out")
        copy.outputs[0].dtype = value.dtype
        copy.outputs[0].shape = ir.Shape([flat if lead is None else lead, last])
        graph.insert_before(p, copy)
        p.replace_input_with(i, copy.outputs[0])
        if folded is not None and not list(folded.outputs[0].uses()) and not folded.outputs[0].is_graph_output():
            folded_inputs = list(folded.inputs)
            graph.remove(folded, safe=True)
            drop_orphans(graph, folded_inputs)
        copies.append(copy)
    if p.op_type in _NORMS:
        p.attributes["axis"] = ir.AttrInt64("axis", 1)
    for o in p.outputs:  # Y, and LN's Mean/InvStdDev or Dropout's mask: [B,S,d] -> [B*S,d]
        if o.shape is not None and len(o.shape) == 3:
            o.shape = ir.Shape([flat, o.shape[2]])
    ir.convenience.replace_all_uses_with(entry.outputs[0], p.outputs[entry.inputs[0].index()])
    inputs = list(entry.inputs)
    graph.remove(entry, safe=True)
    drop_orphans(graph, inputs)  # the shape constant of the entry or of an earlier copy
    return copies


class UpstreamReshape(Pass[UpstreamReshapeOptions]):
    name = "upstream_reshape"
    summary = "Move [B,S,H]->[B*S,H] Reshapes above element-wise ops, LayerNorm, Softmax and MatMul."
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        graph = model.graph
        notes = ensure_shapes(model, ctx)
        names = FreshNames(graph)
        moved_entries: set[str] = set()
        crossed = merged = 0
        non_matches: list[NonMatch] = []
        for _ in range(self.options.max_rounds):
            non_matches, moved = [], 0  # only the last sweep's stops are the final state
            for node in list(graph):
                if node.graph is not graph or node.op_type != "Reshape" or node.domain not in _ONNX:
                    continue
                label = node_label(node)
                if (why := _entry(node)) is not None:
                    non_matches.append(NonMatch(f"Reshape {label!r} is no flatten to move: {why}", label, "Reshape"))
                    continue
                queue = deque([node])
                while queue:
                    reshape = queue.popleft()
                    if reshape.graph is not graph:
                        continue  # a twin merged into another copy
                    step = _step(reshape)
                    if isinstance(step, str):
                        where = node_label(reshape)
                        non_matches.append(NonMatch(f"Reshape {where!r} stops at {step}", where, "Reshape"))
                        continue
                    p, plan, twins = step
                    merged += len(twins)
                    queue.extend(_apply(graph, names, reshape, p, plan, twins=twins))
                    moved += 1
                    moved_entries.add(label.split("@")[0])
            crossed += moved
            if not moved:
                break
        counts = {"reshapes_moved": len(moved_entries), "ops_crossed": crossed, "copies_merged": merged}
        return PassResult(model, modified=crossed > 0, counts=counts, non_matches=non_matches, notes=notes)
