"""Turn ``Gather(data, Range(start, limit, delta))`` into one ``Slice``, only where that is exact.

Re-implements ORT's ``GatherToSliceFusion`` (``onnxruntime/core/optimizer/gather_fusion.cc``, PR #13599)::

    start  limit  delta                         start   limit   delta
       \\     |     /                              |       |       |
        \\    |    /                              [s]   Max(.,0)   [d]      (constants stay initializers;
         Range (int32|int64)         ==>           |    Reshape[1]  |        Max only for a dynamic limit)
           |  (its only use)                       |       |       |
    data --Gather(axis) --> y              data --Slice(starts, ends, axes=[axis], steps) --> y

Fixes over ORT, which checks only "one output edge, into Gather's indices":

* The index sequence must not cross zero and ``ends`` must avoid Slice's special values. Range's negative
  indices count from the end one by one, while Slice maps a negative start or end once; Range's ``-1``
  means "before index 0" when counting down but Slice's ``-1`` is the last element. Stock ORT 1.20-1.32
  therefore returns 0 rows for ``Range(-3, 1, 1)`` (4 rows) and for ``Range(7, -1, -1)`` (8 rows)
  whenever the Range is not constant-folded first (e.g. the limit is a graph input).
  The accepted cases (start and delta constant, delta != 0):

  ======================  ==========================  ===============================================
  case                    limit                       emitted ``ends``
  ======================  ==========================  ===============================================
  delta > 0, start >= 0   constant or dynamic         ``Max(limit, 0)``: a negative limit is empty
  delta < 0, start >= 0   constant >= -1              ``limit``; -1 becomes INT64_MIN (INT32_MIN)
  start < 0               constant < 0                ``limit`` as is (both ends wrap once)
  ======================  ==========================  ===============================================

* **The guard.** Every Range->Gather pair refused above still matches ORT's pattern, and ORT applies its
  fusion at the default level (``ORT_ENABLE_ALL``) whenever an input of the Range is not constant-folded
  first. With a dynamic ``limit``, ORT 1.32 gets 600 of the 1,728 branches of the test sweep (start
  -8..7, limit -9..8, delta +-1..3, n=8) wrong: 492 cross zero (refused here) and 108 have a negative
  limit that Slice misreads (fused here with ``Max(limit, 0)`` or INT_MIN). So a refused
  pair gets ``Reshape(range, [-1])`` between Range and Gather, a no-op ORT does not remove (Identity, a
  same-type Cast and ``Add(x, 0)`` are all removed first, re-exposing the pattern; checked on ORT 1.32).
  After the pass the sweep has 0 mismatches with graph optimizations off and at ``ORT_ENABLE_ALL``, with
  constant and dynamic limits, int64 and int32 (``tests/passes/test_range_gather_to_slice.py``).

* **Shared Ranges.** ORT needs the Range's only output edge to be the Gather's indices. Exporters share
  one Range among several Gathers, put a no-op ``Reshape(range, [-1])`` between them, or use the Range
  elsewhere too: XLNet's ``index_select(x, 3, arange(klen))`` is, in every layer, a Gather on
  ``Reshape(arange, [-1])`` of one ``arange`` that also builds a mask, so ORT fuses none of the six. Here
  each Gather reading the Range's values as indices, directly or through ``Reshape(., [-1])`` (the
  identity on a 1-D tensor), becomes its own Slice by the rules above; the Range (and the Reshape) stay
  while anything else reads them. Such a shape is not ORT's pattern, so a refusal there needs no guard.

A Range whose output is a graph output is left alone and needs no guard: ORT requires no graph output,
too. ``ranges_fused`` counts the Gathers turned into Slices. Functions are not visited (they cannot hold
the initializers this pass adds); subgraphs are.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes._match import graphs_of, node_label
from passes.compute_order._upstream_rules import FreshNames

_ONNX_DOMAINS = ("", "ai.onnx")
_INT_TYPES = {ir.DataType.INT32: np.int32, ir.DataType.INT64: np.int64}
GUARD_REASON = (
    "ORT's GatherToSliceFusion would miscompile this Range (its indices may cross zero or end at -1, "
    "which Slice reads differently), so a Reshape(-1) now separates it from the Gather"
)


class RangeGatherToSliceOptions(PassOptions):
    """The pass has no options; the model exists so unknown keys are refused like for every pass."""


@dataclasses.dataclass(frozen=True)
class _Fuse:
    range_node: ir.Node
    gathers: tuple[ir.Node, ...]  # each becomes one Slice
    reshapes: tuple[ir.Node, ...]  # Reshape(range, [-1]) between the Range and some of the gathers
    dtype: ir.DataType
    start: int
    delta: int
    ends: int | None  # None: dynamic limit, emit Max(limit, 0)


@dataclasses.dataclass(frozen=True)
class _Refuse:
    reason: str
    guard: bool  # the pair still matches ORT's fusion, which would miscompile it


def _scalar(value: ir.Value | None) -> int | None:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is None or tensor.size != 1 or tensor.dtype not in _INT_TYPES:
        return None
    return int(tensor.numpy().reshape(()))


def _is_gather_indices(node: ir.Node, idx: int) -> bool:
    return node.op_type == "Gather" and node.domain in _ONNX_DOMAINS and idx == 1


def _is_flatten_1d(node: ir.Node, idx: int) -> bool:
    """``Reshape(range, [-1])``: the identity on the 1-D Range output."""
    if node.op_type != "Reshape" or node.domain not in _ONNX_DOMAINS or idx != 0 or len(node.inputs) < 2:
        return False
    shape = ir.convenience.get_const_tensor(node.inputs[1])
    return shape is not None and shape.numpy().reshape(-1).tolist() == [-1]


def _gathers(out: ir.Value) -> tuple[list[ir.Node], list[ir.Node]]:
    """Gathers whose indices are the Range's values, directly or through Reshape(., [-1]); and those
    Reshapes. A Gather reading the same values twice is listed once."""
    gathers: list[ir.Node] = []
    reshapes: list[ir.Node] = []
    for use in out.uses():
        if _is_gather_indices(use.node, use.idx):
            gathers.append(use.node)
        elif _is_flatten_1d(use.node, use.idx) and not use.node.outputs[0].is_graph_output():
            found = [u.node for u in use.node.outputs[0].uses() if _is_gather_indices(u.node, u.idx)]
            if found:
                reshapes.append(use.node)
                gathers.extend(found)
    return list(dict.fromkeys(gathers)), reshapes


def _decide(node: ir.Node, graph: ir.Graph, opset: int) -> _Fuse | _Refuse:
    """Classify one Range on the unmodified graph. Never edits anything."""
    out = node.outputs[0]
    uses = list(out.uses())
    if out.is_graph_output():
        return _Refuse(f"Range output {out.name!r} is a graph output", guard=False)
    # Exactly ORT's pattern (one edge, into a Gather's indices): every refusal below needs the guard.
    ort_pair = len(uses) == 1 and _is_gather_indices(uses[0].node, uses[0].idx)
    gathers, reshapes = _gathers(out)
    if not gathers:
        if len(uses) == 1:
            where = f"{uses[0].node.op_type} input {uses[0].idx}"
            return _Refuse(f"Range output feeds {where}, not a Gather's indices", guard=False)
        return _Refuse(f"Range output {out.name!r} has {len(uses)} uses, none a Gather's indices", guard=False)
    dtype = out.dtype or (node.inputs[0].dtype if node.inputs[0] is not None else None)
    if dtype not in _INT_TYPES:
        return _Refuse(f"Range type is {dtype}, not int32/int64", guard=ort_pair)
    start, delta = _scalar(node.inputs[0]), _scalar(node.inputs[2])
    limit_value = node.inputs[1]
    limit = _scalar(limit_value)
    if start is None or delta is None:
        return _Refuse("start or delta is not a constant, so the sign of the indices is unknown", guard=ort_pair)
    if delta == 0:
        return _Refuse("delta is 0 (Range fails at run time)", guard=ort_pair)

    def fuse(ends: int | None) -> _Fuse:
        return _Fuse(node, tuple(gathers), tuple(reshapes), dtype, start, delta, ends)

    if start >= 0 and delta > 0:
        if limit is None and opset < 12:
            return _Refuse(f"dynamic limit needs Max on integers (opset 12), model has {opset}", guard=ort_pair)
        return fuse(None if limit is None else max(limit, 0))
    if start >= 0:  # delta < 0
        if limit is None:
            return _Refuse(
                "delta < 0 with a dynamic limit: Range's -1 ends before index 0, Slice's -1 is the last "
                "element, and a limit below -1 crosses zero",
                guard=ort_pair,
            )
        if limit < -1:
            return _Refuse(f"delta < 0 from start {start} to limit {limit} crosses zero", guard=ort_pair)
        return fuse(limit if limit >= 0 else int(np.iinfo(_INT_TYPES[dtype]).min))
    if limit is None or limit >= 0:
        shown = "dynamic" if limit is None else str(limit)
        return _Refuse(f"start {start} < 0 with limit {shown} may cross zero", guard=ort_pair)
    return fuse(limit)


def _const(graph: ir.Graph, names: FreshNames, base: str, array: np.ndarray) -> ir.Value:
    value = ir.val(names(base), const_value=ir.tensor(array))
    value.dtype = ir.DataType.from_numpy(array.dtype)
    value.shape = ir.Shape(array.shape)
    graph.register_initializer(value)
    return value


def _fuse(plan: _Fuse, graph: ir.Graph, names: FreshNames) -> None:
    np_type = _INT_TYPES[plan.dtype]
    r = plan.range_node.outputs[0]
    base = r.name or "range"
    if plan.ends is None:  # one clamp for every Slice, right after the Range (the limit is computed before it)
        zero = _const(graph, names, f"{base}_zero", np.array(0, np_type))
        one_d = _const(graph, names, f"{base}_one_d", np.array([1], np.int64))
        clamp = ir.node("Max", [plan.range_node.inputs[1], zero], name=names(f"{base}_ends_max"))
        clamp.outputs[0].name = names(f"{base}_ends_scalar")
        reshape = ir.node("Reshape", [clamp.outputs[0], one_d], name=names(f"{base}_ends_1d"))
        ends = reshape.outputs[0]
        ends.name, ends.dtype, ends.shape = names(f"{base}_ends"), plan.dtype, ir.Shape([1])
        graph.insert_after(plan.range_node, [clamp, reshape])
    else:
        ends = _const(graph, names, f"{base}_ends", np.array([plan.ends], np_type))
    starts = _const(graph, names, f"{base}_starts", np.array([plan.start], np_type))
    steps = _const(graph, names, f"{base}_steps", np.array([plan.delta], np_type))
    axes_by_value: dict[int, ir.Value] = {}
    for gather in plan.gathers:
        y = gather.outputs[0]
        axis = gather.attributes.get_int("axis", 0)
        if axis not in axes_by_value:
            axes_by_value[axis] = _const(graph, names, f"{base}_axes", np.array([axis], np_type))
        inputs = [gather.inputs[0], starts, ends, axes_by_value[axis], steps]
        slice_node = ir.node("Slice", inputs, name=names(f"{gather.name or y.name or base}_slice"))
        out = slice_node.outputs[0]
        out.dtype, out.shape = y.dtype, y.shape
        graph.insert_before(gather, slice_node)
        old_name = y.name
        ir.convenience.replace_all_uses_with(y, out, replace_graph_outputs=True)
        graph.remove(gather, safe=True)
        # The Slice takes over the Gather's output name, so graph outputs and downstream names are unchanged.
        out.name = old_name or names(f"{base}_sliced")
    for node in (*plan.reshapes, plan.range_node):  # what nothing reads any more
        if not list(node.outputs[0].uses()) and not node.outputs[0].is_graph_output():
            orphans = [v for v in node.inputs if v is not None and v.is_initializer()]
            graph.remove(node, safe=True)
            for value in orphans:  # start/delta (and a constant limit), a Reshape's shape
                if not list(value.uses()) and not value.is_graph_input() and not value.is_graph_output():
                    graph.initializers.pop(value.name, None)


def _guard(range_node: ir.Node, gather: ir.Node, graph: ir.Graph, names: FreshNames) -> None:
    r = range_node.outputs[0]
    shape = _const(graph, names, f"{r.name}_guard_shape", np.array([-1], np.int64))
    guard = ir.node("Reshape", [r, shape], name=names(f"{range_node.name or r.name}_ort_fusion_guard"))
    guard.outputs[0].name = names(f"{r.name}_guarded")
    guard.outputs[0].dtype, guard.outputs[0].shape = r.dtype, r.shape
    graph.insert_after(range_node, guard)
    gather.replace_input_with(1, guard.outputs[0])


class RangeGatherToSlice(Pass[RangeGatherToSliceOptions]):
    name = "range_gather_to_slice"
    summary = "Gather(Range) -> Slice where exact; guard the rest against ORT's unsound fusion."
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        fused = guarded = 0
        non_matches: list[NonMatch] = []
        guarded_names: list[str] = []
        for graph in list(graphs_of(model.graph)):
            assert isinstance(graph, ir.Graph)
            # Match on the unmodified graph, then rewrite: plans hold node references only.
            ranges = [n for n in graph if n.op_type == "Range" and n.domain in _ONNX_DOMAINS]
            plans = [(node, _decide(node, graph, opset)) for node in ranges]
            names = FreshNames(graph)
            for node, plan in plans:
                if isinstance(plan, _Fuse):
                    _fuse(plan, graph, names)
                    fused += len(plan.gathers)
                    continue
                reason = plan.reason
                if plan.guard:
                    gather = next(iter(node.outputs[0].uses())).node
                    _guard(node, gather, graph, names)
                    guarded += 1
                    guarded_names.append(node_label(node))
                    reason = f"{reason}; guarded: {GUARD_REASON}"
                label = node_label(node)
                non_matches.append(NonMatch(f"Range {label!r} kept: {reason}", label, "Range"))
        notes = {"guarded_ranges": guarded_names, "guard_reason": GUARD_REASON} if guarded else {}
        return PassResult(
            model,
            modified=bool(fused or guarded),
            counts={"ranges_fused": fused, "guarded": guarded},
            non_matches=non_matches,
            notes=notes,
        )
