"""Evaluate nodes whose inputs are all constants and store the results as initializers.

Wraps onnxscript's constant folder (``onnxscript.optimizer.fold_constants``, the ``FoldConstantsPass`` over
onnx-ir), the counterpart of ORT's ``ConstantFolding`` transformer
(``onnxruntime/core/optimizer/constant_folding.cc``). The folder also propagates shapes symbolically
(``Shape`` of a static shape becomes a constant), bypasses ``Identity``, and inlines an ``If`` whose
condition is constant.

What this wrapper adds is a bound on memory *before* anything runs. onnxscript checks its output size
limit only after the reference evaluator has built the array, so ``Expand(1.0, [2**40])`` would allocate
4 TiB first. Here every candidate node is shape-inferred on its constant inputs (``onnx.shape_inference
.infer_node_outputs`` with data propagation, which never trusts the model's own value_info) and declined,
with a ``NonMatch``, when its outputs would exceed ``max_output_bytes`` or their size cannot be known.
onnxscript's own refusals (ConstantOfShape and (De)QuantizeLinear are never folded; inputs over
``max_input_elements``) are silent: they are policy, not a property of this model.
Constant nodes the folded nodes read, and Identity nodes the folder bypassed, are removed when nothing
reads them any more::

    Constant(2) --\\                                         b1' (initializer = b1 + (2*3 - 6))
                   Mul --> Sub(six) --> Add(b1) --> Add      h0 --> Add(b1') --> ...
    Constant(3) --/                                 ^
                                             h0 ---/
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript.optimizer
from pydantic import Field

from passes import _io_signature as io_signature
from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult, op_histogram
from passes._match import all_graphs, node_label


class ConstantFoldingOptions(PassOptions):
    max_output_bytes: int | None = Field(
        None,
        ge=0,
        description="A node is folded only if its outputs take at most this many bytes. "
        "Unset: the job's constant_fold_max_bytes (1 MiB by default).",
    )
    max_input_elements: int = Field(
        8192,
        ge=0,
        description="Nodes with a constant input of more elements are not folded (onnxscript's "
        "input_size_limit), so large weights are not duplicated into new initializers.",
    )
    onnx_shape_inference: bool = Field(
        False,
        description="Run ONNX shape inference node by node while folding. Slower; useful when "
        "shape_inference did not run first.",
    )


def _restore_signature(model: ir.Model, declared: io_signature.Signature) -> int:
    """``io_signature.restore``, except where folding replaced a graph output (a constant output is kept as the
    folder left it; the ledger judges the result)."""
    try:
        return io_signature.restore(model, declared)
    except io_signature.SignatureChanged:
        return 0


def _type_proto(tensor: ir.TensorProtocol) -> onnx.TypeProto:
    return onnx.helper.make_tensor_type_proto(int(tensor.dtype), list(tensor.shape.numpy()))


class _SizeGuard:
    """``should_fold`` callback: decline nodes whose outputs would be too large, before evaluation."""

    def __init__(self, model: ir.Model, max_bytes: int, max_input_elements: int) -> None:
        self.opsets = dict(model.opset_imports)
        self.max_bytes = max_bytes
        self.max_input_elements = max_input_elements
        self.non_matches: list[NonMatch] = []
        self.over_cap = 0  # the rest of non_matches are outputs whose size could not be bounded

    def __call__(self, node: ir.Node) -> bool | None:
        reason = self._reason(node)
        if reason is None:
            return None  # onnxscript's own rules decide (its blacklist, input size limit)
        self.non_matches.append(NonMatch(reason, node=node_label(node), op_type=node.op_type))
        return False

    def _reason(self, node: ir.Node) -> str | None:
        try:
            schema = onnx.defs.get_schema(node.op_type, self.opsets.get(node.domain, 1), node.domain)
        except onnx.defs.SchemaError:
            return f"no ONNX schema for {node.domain or 'ai.onnx'}::{node.op_type}; output size unknown"
        types, data = {}, {}
        for value in node.inputs:
            if value is None or value.const_value is None:
                continue
            tensor = value.const_value
            types[value.name] = _type_proto(tensor)
            # The values of small inputs (shapes, repeats, limits) decide the output size; large ones
            # are only needed for their type, and serializing them would cost what the cap protects.
            if tensor.size <= self.max_input_elements:
                data[value.name] = ir.serde.serialize_tensor(tensor)
        try:
            inferred = onnx.shape_inference.infer_node_outputs(schema, ir.serde.serialize_node(node), types, data)
        except Exception as exc:  # onnx raises several unrelated types for an inconsistent node
            return f"shape inference failed on constant inputs ({type(exc).__name__}); output size unknown"
        total = 0
        for output in node.outputs:
            type_proto = inferred.get(output.name)
            if type_proto is None or not type_proto.HasField("tensor_type"):
                return f"output {output.name!r} has no inferable tensor type; size unknown"
            tensor_type = type_proto.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
            if not tensor_type.HasField("shape") or None in dims:
                return f"output {output.name!r} has no static shape before evaluation; size unknown"
            dtype = ir.DataType(tensor_type.elem_type)
            if dtype == ir.DataType.STRING:
                return f"output {output.name!r} is a string tensor; size unknown"
            # itemsize is fractional for 4-bit types; object dtype keeps 2**40-element products exact.
            total += math.ceil(int(np.prod(dims, dtype=object)) * dtype.itemsize)
        if total > self.max_bytes:
            self.over_cap += 1
            return f"folded outputs would take {total} bytes > max_output_bytes {self.max_bytes}"
        return None


class ConstantFolding(Pass[ConstantFoldingOptions]):
    name = "constant_folding"
    summary = "Precompute nodes whose inputs are all constants, within an output-size cap."
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        options = self.options
        max_bytes = ctx.constant_fold_max_bytes if options.max_output_bytes is None else options.max_output_bytes
        guard = _SizeGuard(model, max_bytes, options.max_input_elements)
        ops_before = op_histogram(model)
        initializers_before = set(_initializers(model))
        # Objects, not ids: a folded node is freed and its id may be reused by a node the folder adds.
        read_before = {n for g in all_graphs(model) for n in g if any(o.uses() for o in n.outputs)}
        existed = {n for g in all_graphs(model) for n in g}

        declared = io_signature.capture(model)
        static_dims = _fold_static_dims(model)
        result = onnxscript.optimizer.fold_constants(
            model,
            onnx_shape_inference=options.onnx_shape_inference,
            input_size_limit=options.max_input_elements,
            # Elements, not bytes; never tighter than the guard, which already bounded the bytes.
            output_size_limit=max(max_bytes, 1),
            should_fold=guard,
        )
        orphans = _remove_orphans(model, read_before, existed)
        # The folder's shape propagation writes what it found onto the graph's outputs: TorchScript's placeholder
        # names for a head count and head size (Whisper's decoder presents, Concatpresent.0.decoder.key_dim_1)
        # became 4 and 8, and the job rolled the pass back for making declared axes static. Users' code and the
        # ledger read the declared signature, so it is kept (where an output's name or type changed, nothing is).
        restored = _restore_signature(model, declared)

        removed = ops_before - op_histogram(model)
        added = op_histogram(model) - ops_before
        created = sum(1 for v in _initializers(model) if v not in initializers_before)
        counts = {
            "nodes_removed": sum(removed.values()),
            "initializers_created": created,
            "skipped_over_cap": guard.over_cap,
            "skipped_size_unknown": len(guard.non_matches) - guard.over_cap,
        }
        if static_dims:
            counts["static_dims_folded"] = static_dims
        if restored:
            counts["io_declarations_restored"] = restored
        if added:
            counts["nodes_added"] = sum(added.values())  # an inlined If branch
        notes = {"removed_by_op": dict(sorted(removed.items()))} if removed else {}
        if orphans:
            notes["orphans_removed"] = orphans
        return PassResult(
            model,
            modified=result.modified or orphans > 0 or static_dims > 0,
            counts=counts,
            non_matches=guard.non_matches,
            notes=notes,
        )


def _fold_static_dims(model: ir.Model) -> int:
    """``Gather(Shape(x), i)`` with a scalar ``i`` (how torch exports ``x.size(i)``) and ``Slice(Shape(x), a, b)``
    (``x.shape[a:b]``; TorchScript's decomposed SDPA reads the head size as ``Shape(q)[-1:]``) become constants
    when the dims they pick are static, however many other dims of x are symbolic. onnxscript's folder folds
    neither there (it takes only 1-D Gather indices, and no Slice of a partly symbolic shape), so a static size
    read off a dynamic tensor stayed a chain: the SDPA scale ``1/sqrt(head_size)`` stayed computed at run time
    (Falcon), and attention fusions look for a constant scale."""
    folded = 0
    for graph in list(all_graphs(model)):
        for node in list(graph):
            if node.op_type not in ("Gather", "Slice") or node.domain not in ("", "ai.onnx"):
                continue
            picked = _static_dims_picked(node)
            if picked is None or node.outputs[0].is_graph_output():
                continue  # a graph output keeps its name, which a replacement value would not
            dims, scalar = picked
            array = np.array(dims[0] if scalar else dims, np.int64)
            tensor = ir.tensor(array, name=f"{node.outputs[0].name}_static")
            constant = ir.Node("", "Constant", [], attributes=[ir.AttrTensor("value", tensor)])
            constant.outputs[0].name = tensor.name
            constant.outputs[0].shape, constant.outputs[0].dtype = ir.Shape(array.shape), ir.DataType.INT64
            graph.insert_before(node, constant)
            ir.convenience.replace_all_uses_with(node.outputs[0], constant.outputs[0])
            graph.remove(node, safe=True)
            folded += 1
    return folded


def _static_dims_picked(node: ir.Node) -> tuple[list[int], bool] | None:
    """The static dims a Gather/Slice of ``Shape(x)`` picks, and whether the result is a scalar; None when
    it is not one or any picked dim is symbolic."""
    source = node.inputs[0] if node.inputs else None
    shape_node = source.producer() if source is not None else None
    if shape_node is None or shape_node.op_type != "Shape" or shape_node.domain not in ("", "ai.onnx"):
        return None
    data = shape_node.inputs[0]
    if data is None or data.shape is None:
        return None
    first, last = (shape_node.attributes.get(k) for k in ("start", "end"))
    dims = list(data.shape)[first.as_int() if first else 0 : last.as_int() if last else None]
    if node.op_type == "Gather":
        axis = node.attributes.get("axis")
        index = _constant(node.inputs[1]) if len(node.inputs) == 2 else None
        if (axis is not None and axis.as_int() != 0) or index is None or index.shape.rank() != 0:
            return None  # 1-D indices are onnxscript's own rule
        i = int(index.numpy())
        picked, scalar = ([dims[i]] if -len(dims) <= i < len(dims) else None), True
    else:
        bounds = [_constant(v) if v is not None else None for v in node.inputs[1:5]]
        starts, ends = bounds[0], bounds[1] if len(bounds) > 1 else None
        axes = bounds[2] if len(bounds) > 2 else None
        steps = bounds[3] if len(bounds) > 3 else None
        if starts is None or ends is None or starts.numpy().shape != (1,) or ends.numpy().shape != (1,):
            return None
        if axes is not None and [int(a) for a in axes.numpy()] not in ([0], [-1]):
            return None
        if len(node.inputs) > 3 and node.inputs[3] is not None and axes is None:
            return None  # axes given but not constant
        if len(node.inputs) > 4 and node.inputs[4] is not None and (steps is None or list(steps.numpy()) != [1]):
            return None
        # with step 1 ONNX clamps starts and ends as Python slicing does (INT64_MAX: to the end)
        picked, scalar = dims[int(starts.numpy()[0]) : int(ends.numpy()[0])], False
    if picked is None or not all(isinstance(d, int) for d in picked):
        return None
    return picked, scalar


def _constant(value: ir.Value | None) -> ir.TensorProtocol | None:
    """An initializer's or a Constant node's tensor (the folder has not run yet, so Constant outputs carry
    no const_value)."""
    if value is None or value.const_value is not None:
        return None if value is None else value.const_value
    producer = value.producer()
    if producer is None or producer.op_type != "Constant" or producer.domain not in ("", "ai.onnx"):
        return None
    attr = producer.attributes.get("value")
    return attr.as_tensor() if attr is not None else None


def _remove_orphans(model: ir.Model, read_before: set[ir.Node], existed: set[ir.Node]) -> int:
    """Remove nodes that had readers before folding and have none now (feeder Constants, bypassed
    Identities), and the unread nodes the folder itself added: it rewrites a no-op (a Cast to its input's type,
    a one-input Concat) to an Identity and then bypasses that Identity, which stayed behind reading the value.
    A rewrite rule that requires its matched values to have no other reader (onnxscript's SDPA, on scores
    that TorchScript casts to float before the Softmax: XLM) then refused the match. Nodes that were already
    dead are left for dead_node_elimination to report."""
    removed = 0
    for graph in list(all_graphs(model)):
        # Reverse order: removing a node can orphan its producers, which come earlier.
        for node in reversed(list(graph)):
            if node not in read_before and node in existed:
                continue
            if any(o.uses() or o.is_graph_output() for o in node.outputs):
                continue
            graph.remove(node, safe=True)
            removed += 1
    return removed


def _initializers(model: ir.Model) -> list[ir.Value]:
    return [v for g in all_graphs(model) if isinstance(g, ir.Graph) for v in g.initializers.values()]
