"""Move shrinking slices (Gather, Slice, GatherND) above the ops that produce their data.

Re-implements ORT's training-only ``UpStreamGatherGraphTransformer`` ("compute optimizer",
``onnxruntime/core/optimizer/compute_optimizer/upstream_gather.cc``, PR #13672), which stock
``onnxruntime`` inference never runs. RoBERTa's classification head takes
``features[:, 0, :]``; moved up, the last layer's LayerNorm, FFN and residual Adds run on one token::

    before:  x[B,S,H] --MatMul(W)--> Add(b) --> LayerNorm(-1) --> Gather(axis 1, 0) --> [B,H] --> Tanh

    after:   x[B,S,H] --Gather(axis 1, 0)--> [B,H] --Unsqueeze(1)--> [B,1,H] --MatMul(W)--> Squeeze(1)
                 --> [B,H] --> Add(b) --> LayerNorm(axis 1) --> Tanh
             (W[H,H] is not sliced; b[H] broadcasts and is left alone; LN's axis drops by one)

Entry slices: Gather with scalar indices (the axis is removed) or 1-D indices of known length K below
the data dim; Gather whose indices come from ``Squeeze(NonZero(.))`` with any length (the "shrinking"
form ``label_sparsity`` emits, standing in for ORT's ShrunkenGather); Slice on one constant axis (axes
absent or empty only for 1-D data); GatherND with rank-3 data and indices, ``batch_dims=1`` and
indices ``[B, K, 1]``. The op rules (which inputs to slice, on which axis) are in ``_upstream_rules.py``.

Driver: for each slice, a queue of slices; pop S, take its data producer P, stop (with a reason) or put
a copy of S on each input the rule picks, rewire S's consumers to P and enqueue the copies; the whole
sweep repeats until nothing moves. Each step decides on the graph as it stands, then rewrites.
Duplicate copies (several branches of one value) are left for ``common_subexpression_elimination``.

Fixes over ORT:

* a branch that reaches a graph input or initializer ends only that branch (ORT breaks the whole queue);
* refused when P's output feeding S, or any other output of P, is a graph output (its shape would change);
* a slice whose own output is a graph output (the CLS pooling ``last_hidden_state[:, 0]`` as a model output)
  moves too: the value that replaces it (P's output, or the Squeeze after P) takes the output's name, so
  the model's signature is unchanged; ORT declines it;
* the broadcast rule slices a lower-rank input at ``axis - (rank(out) - rank(input))``, not ``axis``;
* a scalar slice with a broadcast input gets one Squeeze after P feeding *all* former consumers of S;
* Reshape requires every dim before (or after) the axis to be unchanged, honours ``allowzero=1``, and
  rewrites any 0 entry that would copy a different input dim; scalar slices need no 0 entry. A shape
  computed at run time (the torch exporter's ``Concat(Shape(x)[0:2], [heads, dim])``) is replaced by a
  constant derived from the inferred dims, where ORT requires a constant;
* Sub, Mul, ONNX Gelu, Tanh, other element-wise ops, Gemm and opset-17 LayerNormalization are accepted;
* a scalar slice through Transpose drops the axis from ``perm`` instead of adding Unsqueeze/Squeeze;
* copies meeting on a shared value merge: when every reader of P's output is the same slice (same op,
  axis, attributes and indices/starts/ends, equal as constants or the same value), the copies that the
  branches brought (the two halves of an erf-GELU, the FFN and the residual Add reading one LayerNorm)
  become one and it moves on. ORT stops at any value with two consumers and relies on CSE plus another
  run; here one run reaches that fixpoint (RoBERTa's CLS slice crosses the whole last layer but K and V).

A Slice that crops the trailing end of a Conv's spatial axis (``x[..., :-r]``: start 0, a constant negative end,
step 1; wav2vec2, HuBERT, WavLM, SEW and Data2Vec-audio trim their positional convolution's extra output this
way, ``SamePad`` for an even kernel) moves into the Conv itself: its end padding shrinks by ``r * stride`` on
that axis and the Slice goes. Each kept output reads the same inputs and weights as before (exact). Taken only
where the Conv's padding stays at least what a 'same' convolution needs (``begin + end >= dilation * (kernel -
1)`` after the change), so its output is never empty where the cropped one was not, and only where nothing else
reads the Conv's output (a cropped graph output: the Conv's output takes its name). The convolution computes
``r`` fewer columns and no copy of its output is made; and ORT's symbolic shape inference (the fusion engines')
no longer simplifies the crop of a length that went through the feature encoder's seven strided convolutions
(0.3 s a run on a bench-size wav2vec2, three runs a job).

The indices (or starts/ends) of a slice cannot depend on P's output: P has exactly one use, S's data.
They may be computed after P in node order, so the graph is sorted topologically after a move.
Only the main graph is visited; shapes come from ONNX shape inference, run first when any are missing.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import onnx_ir as ir
from pydantic import Field

from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes._match import const_ints, drop_orphans, node_label, take_graph_output
from passes.cleanup.shape_inference import ensure_shapes
from passes.compute_order._upstream_rules import (
    Dim,
    FreshNames,
    Move,
    SliceInfo,
    producer_to_cross,
    rule_for,
    same_dim,
    same_input,
)

_ONNX = ("", "ai.onnx")


class UpstreamSliceOptions(PassOptions):
    max_rounds: int = Field(
        16, ge=1, le=1000, description="Sweeps over the graph before stopping even if slices still move."
    )


def _is_shrinking(indices: ir.Value) -> bool:
    """Indices ``Squeeze(NonZero(mask))``: at most the data length, so any length is a shrink."""
    squeeze = indices.producer()
    if squeeze is None or squeeze.op_type != "Squeeze" or squeeze.inputs[0] is None:
        return False
    nonzero = squeeze.inputs[0].producer()
    return nonzero is not None and nonzero.op_type == "NonZero" and nonzero.domain in _ONNX


def _entry(node: ir.Node) -> SliceInfo | str | None:
    """The slice a node performs, a reason it cannot move, or None if it is no slice op at all."""
    if node.domain not in _ONNX or node.op_type not in ("Gather", "Slice", "GatherND"):
        return None
    data = node.inputs[0]
    if data is None or data.shape is None:
        return "data shape unknown"
    rank = len(data.shape)
    if node.op_type == "Gather":
        indices = node.inputs[1]
        axis = node.attributes.get_int("axis", 0)
        axis += rank if axis < 0 else 0
        if rank < 2:
            return "data rank < 2"
        if indices is None or indices.shape is None or len(indices.shape) > 1:
            return "indices are not a scalar or 1-D of known rank"
        if len(indices.shape) == 0:
            return SliceInfo(node, axis, scalar=True, length=None)
        k, dim = indices.shape[0], data.shape[axis]
        if _is_shrinking(indices):
            return SliceInfo(node, axis, scalar=False, length=k, shrinking=True)
        if not isinstance(k, int) or not (k == 1 or (isinstance(dim, int) and k < dim)):
            return f"{k} indices are not known to be fewer than the {dim} entries of axis {axis}"
        return SliceInfo(node, axis, scalar=False, length=k)
    if node.op_type == "GatherND":
        indices = node.inputs[1]
        shape = indices.shape if indices is not None else None
        if node.attributes.get_int("batch_dims", 0) != 1 or rank != 3 or shape is None or len(shape) != 3:
            return "GatherND needs batch_dims=1 with rank-3 data and indices"
        if shape[2] != 1:
            return "GatherND indices' last dim is not 1"
        return SliceInfo(node, 1, scalar=False, length=shape[1])
    # Slice: starts/ends/steps may be dynamic, but the axis must be one known axis.
    axes = node.inputs[3] if len(node.inputs) > 3 else None
    axes_tensor = ir.convenience.get_const_tensor(axes) if axes is not None else None
    if axes is not None and axes_tensor is None:
        return "Slice axes are not a constant"
    values = axes_tensor.numpy().reshape(-1).tolist() if axes_tensor is not None else []
    starts = node.inputs[1]
    if starts is None or starts.shape is None or list(starts.shape) != [1]:
        return "Slice starts are not 1-D with one value"
    if len(values) > 1:
        return f"Slice has {len(values)} axes"
    if not values and rank != 1:
        return "Slice without axes on data of rank > 1 slices every axis"
    axis = (values[0] + rank if values[0] < 0 else values[0]) if values else 0
    out_shape = node.outputs[0].shape
    return SliceInfo(node, axis, scalar=False, length=out_shape[axis] if out_shape is not None else None)


def _is_twin(s: SliceInfo, other: ir.Node, index: int) -> bool:
    """Whether ``other``, reading S's data at ``index``, is the same slice as S.

    Copies of one slice arrive on each branch of a shared value (the residual Add and the FFN both read a
    LayerNorm; the two halves of an erf-GELU read one bias Add). Once all readers are such copies they are
    merged into S and S moves on: ORT, and a single sweep without CSE, stop at the shared value."""
    info = _entry(other) if index == 0 else None
    attrs = {k: v.value for k, v in s.node.attributes.items() if k != "axis"}
    return (
        isinstance(info, SliceInfo)
        and other.op_type == s.node.op_type
        and (info.axis, info.scalar) == (s.axis, s.scalar)
        and {k: v.value for k, v in other.attributes.items() if k != "axis"} == attrs
        and len(other.inputs) == len(s.node.inputs)
        and all(same_input(a, b) for a, b in zip(other.inputs[1:], s.node.inputs[1:], strict=True))
        and not other.outputs[0].is_graph_output()
    )


def _step(s: SliceInfo) -> tuple[ir.Node, int, Move, list[ir.Node]] | str:
    """Decide whether S moves above its data producer P, on the graph as it stands. Never edits."""
    found = producer_to_cross(s.node, lambda other, index: _is_twin(s, other, index))
    if isinstance(found, str):
        return found
    p, twins = found
    data = s.node.inputs[0]
    assert data is not None
    label = repr(node_label(p))
    rule = rule_for(p)
    if rule is None:
        return f"{label} ({p.op_type} is not in the allow-list)"
    if data.shape is None:
        return f"{label} (output shape unknown)"
    move = rule(p, s, list(data.shape))
    if isinstance(move, str):
        return f"{label} ({move})"
    if not move.sliced:
        return f"{label} (no input carries the sliced axis)"
    if s.node.op_type == "GatherND":
        for i, axis in move.sliced.items():
            shape = p.inputs[i].shape
            if axis != 1 or shape is None or len(shape) != 3 or not same_dim(shape[0], data.shape[0]):
                return f"{label} (GatherND copy needs input {i} as [B, S, .] sliced on axis 1)"
    return p, data.index(), move, twins


def _resized(shape: ir.Shape | None, axis: int, length: Dim, drop: bool) -> ir.Shape | None:
    if shape is None or len(shape) <= axis:
        return shape
    dims = list(shape)
    if drop:
        del dims[axis]
    else:
        dims[axis] = length
    return ir.Shape(dims)


class _Rewriter:
    def __init__(self, graph: ir.Graph, opset: int) -> None:
        self.graph, self.opset, self.names = graph, opset, FreshNames(graph)
        self.squeezes = 0
        self.merged = 0

    def const(self, base: str, array: np.ndarray) -> ir.Value:
        value = ir.val(self.names(base), const_value=ir.tensor(array))
        value.dtype, value.shape = ir.DataType.from_numpy(array.dtype), ir.Shape(array.shape)
        self.graph.register_initializer(value)
        return value

    def node(self, op: str, inputs: list, attrs: dict, base: str, *, dtype, shape) -> ir.Node:
        node = ir.node(op, inputs, attrs, name=self.names(base))
        out = node.outputs[0]
        out.name, out.dtype, out.shape = self.names(f"{base}_out"), dtype, shape
        return node

    def axes_node(self, op: str, value: ir.Value, axis: int, base: str, shape) -> ir.Node:
        """Squeeze/Unsqueeze of one axis: an ``axes`` input from opset 13, an attribute before."""
        if self.opset >= 13:
            axes = self.const(f"{base}_axes", np.array([axis], np.int64))
            return self.node(op, [value, axes], {}, base, dtype=value.dtype, shape=shape)
        return self.node(op, [value], {"axes": [axis]}, base, dtype=value.dtype, shape=shape)

    def copy(self, s: SliceInfo, value: ir.Value, axis: int, base: str) -> ir.Node:
        """S applied to ``value`` at ``axis``: same indices, starts, ends, steps."""
        shape = _resized(value.shape, axis, s.length, drop=s.scalar)
        rest = list(s.node.inputs[1:])
        if s.node.op_type == "Gather":
            return self.node("Gather", [value, *rest], {"axis": axis}, base, dtype=value.dtype, shape=shape)
        if s.node.op_type == "GatherND":
            return self.node("GatherND", [value, *rest], {"batch_dims": 1}, base, dtype=value.dtype, shape=shape)
        starts = rest[0]
        axes = self.const(f"{base}_axes", np.array([axis], starts.dtype.numpy() if starts.dtype else np.int64))
        steps = rest[3:4] if len(rest) > 3 else []
        return self.node("Slice", [value, rest[0], rest[1], axes, *steps], {}, base, dtype=value.dtype, shape=shape)

    def merge(self, keep: ir.Node, twins: list[ir.Node]) -> None:
        """Readers of each twin read ``keep`` instead; the twins go."""
        for twin in twins:
            ir.convenience.replace_all_uses_with(twin.outputs[0], keep.outputs[0])
            inputs = list(twin.inputs)
            self.graph.remove(twin, safe=True)
            drop_orphans(self.graph, inputs)
            self.merged += 1

    def apply(self, s: SliceInfo, p: ir.Node, k: int, move: Move, twins: list[ir.Node]) -> list[SliceInfo]:
        """Rewrite: copies of S on P's inputs, P updated, S's consumers read P (or one Squeeze of it)."""
        self.merge(s.node, twins)
        before, copies = [], []
        # Copies are named <entry>@<op>_in<i>; a copy that later acts as an entry keeps the first name.
        origin = (s.origin or s.node.name or "slice").split("@")[0]
        base = f"{origin}@{p.name or p.op_type}"
        for i, axis in move.sliced.items():
            value = p.inputs[i]
            copy = self.copy(s, value, axis, f"{base}_in{i}")
            before.append(copy)
            feed = copy.outputs[0]
            if move.keep_dim:  # scalar slice: restore the axis with size 1 so P keeps its rank
                unsq = self.axes_node("Unsqueeze", feed, axis, f"{base}_in{i}_unsqueeze", value.shape)
                unsq.outputs[0].shape = _resized(value.shape, axis, 1, drop=False)
                before.append(unsq)
                feed = unsq.outputs[0]
            p.replace_input_with(i, feed)
            copies.append(SliceInfo(copy, axis, s.scalar, s.length, s.shrinking, origin))
        if move.reshape_shape is not None:  # a new constant: the old one may be shared
            old = p.inputs[1]
            p.replace_input_with(1, self.const(f"{base}_shape", move.reshape_shape))
            drop_orphans(self.graph, [old])
        self.graph.insert_before(p, before)
        for name, attr in move.attributes.items():
            p.attributes[name] = attr
        out = p.outputs[k]
        old_shape = out.shape
        for o in p.outputs:
            o.shape = _resized(o.shape, s.axis, 1 if move.keep_dim else s.length, drop=s.scalar and not move.keep_dim)
        replacement = out
        if move.keep_dim:  # one Squeeze after P; every consumer of S reads it
            squeeze = self.axes_node("Squeeze", out, s.axis, f"{base}_squeeze", None)
            squeeze.outputs[0].shape = _resized(old_shape, s.axis, None, drop=True)
            self.graph.insert_after(p, squeeze)
            replacement = squeeze.outputs[0]
            self.squeezes += 1
        if take_graph_output(self.graph, s.node.outputs[0], replacement, "/sliced"):
            replacement.shape = s.node.outputs[0].shape  # the same dims; keep the names the model declares
        ir.convenience.replace_all_uses_with(s.node.outputs[0], replacement)
        inputs = list(s.node.inputs)
        self.graph.remove(s.node, safe=True)
        drop_orphans(self.graph, inputs)  # e.g. the axes constant of an earlier copy
        return copies


def _conv_crop(node: ir.Node) -> tuple[ir.Node, list[int]] | None:
    """The Conv whose trailing output ``node`` (a Slice) crops, and the Conv's pads with the crop taken in."""
    if node.op_type != "Slice" or node.domain not in _ONNX or len(node.inputs) < 4:
        return None
    data = node.inputs[0]
    conv = data.producer() if data is not None else None
    if conv is None or conv.op_type != "Conv" or conv.domain not in _ONNX or data.is_graph_output():
        return None
    if len(list(data.uses())) != 1 or data.shape is None:
        return None
    starts, ends, axes = (const_ints(node.inputs[i]) for i in (1, 2, 3))
    steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
    if starts != [0] or steps != [1] or ends is None or len(ends) != 1 or axes is None or len(axes) != 1:
        return None
    rank = len(data.shape)
    axis, crop = axes[0] + (rank if axes[0] < 0 else 0), -ends[0]
    spatial = rank - 2
    if axis < 2 or axis >= rank or crop <= 0 or crop >= 2**31:  # an end of INT64_MIN-like size is no crop
        return None
    if conv.attributes.get_string("auto_pad", "NOTSET") != "NOTSET":
        return None
    weight = conv.inputs[1].shape if len(conv.inputs) > 1 and conv.inputs[1] is not None else None
    kernel = conv.attributes.get_ints("kernel_shape", None) or (list(weight)[2:] if weight is not None else None)
    if kernel is None or len(kernel) != spatial or not isinstance(kernel[axis - 2], int):
        return None
    j = axis - 2
    pads = list(conv.attributes.get_ints("pads", [0] * 2 * spatial))
    stride = list(conv.attributes.get_ints("strides", [1] * spatial))[j]
    dilation = list(conv.attributes.get_ints("dilations", [1] * spatial))[j]
    pads[spatial + j] -= crop * stride
    if pads[spatial + j] < 0 or pads[j] + pads[spatial + j] < dilation * (kernel[j] - 1):
        return None
    return conv, pads


def _fold_conv_crops(graph: ir.Graph) -> int:
    """Each Slice ``_conv_crop`` reads, taken into its Conv's end padding (the module docstring)."""
    folded = 0
    for node in list(graph):
        found = _conv_crop(node)
        if found is None:
            continue
        conv, pads = found
        conv.attributes["pads"] = ir.AttrInt64s("pads", pads)
        conv.outputs[0].shape = node.outputs[0].shape
        take_graph_output(graph, node.outputs[0], conv.outputs[0], "/cropped")  # the signature keeps its names
        ir.convenience.replace_all_uses_with(node.outputs[0], conv.outputs[0])
        inputs = list(node.inputs)
        graph.remove(node, safe=True)
        drop_orphans(graph, inputs)
        folded += 1
    return folded


class UpstreamSlice(Pass[UpstreamSliceOptions]):
    name = "upstream_slice"
    summary = (
        "Move shrinking Gather/Slice/GatherND above element-wise ops, LayerNorm, Softmax, MatMul, Reshape; "
        "fold a Conv's trailing crop into its padding."
    )
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        graph = model.graph
        notes = ensure_shapes(model, ctx)
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        rewriter = _Rewriter(graph, opset)
        folded = _fold_conv_crops(graph)
        moved_entries: set[str] = set()
        crossed = 0
        non_matches: list[NonMatch] = []
        for _ in range(self.options.max_rounds):
            # Only the last sweep's stops are reported: earlier ones are superseded by later moves.
            non_matches, moved = [], 0
            for node in list(graph):
                if node.graph is not graph:
                    continue  # removed by an earlier move in this sweep
                info = _entry(node)
                if info is None:
                    continue
                label = node_label(node)
                if isinstance(info, str):
                    non_matches.append(
                        NonMatch(f"{node.op_type} {label!r} is no slice to move: {info}", label, node.op_type)
                    )
                    continue
                queue = deque([info])
                while queue:
                    s = queue.popleft()
                    if s.node.graph is not graph:
                        continue  # a twin merged into another copy
                    step = _step(s)
                    if isinstance(step, str):
                        where = node_label(s.node)
                        non_matches.append(
                            NonMatch(f"{s.node.op_type} {where!r} stops at {step}", where, s.node.op_type)
                        )
                        continue
                    queue.extend(rewriter.apply(s, *step))
                    moved += 1
                    moved_entries.add(label.split("@")[0])
            crossed += moved
            if not moved:
                break
        if crossed:
            graph.sort()  # copies read indices that may be computed after P
        counts = {
            "slices_moved": len(moved_entries),
            "ops_crossed": crossed,
            "squeezes_added": rewriter.squeezes,
            "copies_merged": rewriter.merged,
            "conv_crops_folded": folded,
        }
        modified = crossed > 0 or folded > 0
        return PassResult(model, modified=modified, counts=counts, non_matches=non_matches, notes=notes)
