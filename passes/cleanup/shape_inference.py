"""Annotate every value with the element type and shape ONNX shape inference can derive.

Re-implements onnx-ir's ``ShapeInferencePass`` (``onnx_ir/passes/common/shape_inference.py``), which
calls ``onnx.shape_inference.infer_shapes`` (``data_prop=True``). ORT has no pass for this; it infers
during ``Graph::Resolve``. Later passes (constant folding's symbolic shapes, fusions checking ranks)
read these annotations, and they are serialized as ``value_info``::

    x: float[batch,16] --> MatMul(W1: [16,32]) --> h0 --> Relu --> r     h0: float[batch,32]
                                                                         r:  float[batch,32]   (added)

Like onnx-ir, initializers larger than 1 KiB, and any held in external data, are handed to ONNX as typed
graph inputs without their bytes, so a multi-GB model serializes small (protobuf stops at 2 GB) and no
external file is read; small ones keep their values so data propagation still sees shape constants.
It is re-implemented rather than wrapped because the onnx-ir pass logs and swallows an inference error,
and overwrites declared shapes with whatever inference says; here a failure becomes a ``NonMatch``, and
inference only adds knowledge: a concrete size replaces a symbol, but a declared ``batch`` is never
replaced by an anonymous dimension and a declared size never changes. The graph's inputs and outputs keep
their declarations exactly (``passes._io_signature``, shared with fuse_transformer): on an export with a
fixed image size inference resolves the declared ``last_hidden_state: float[batch, seq, hidden]`` to
``float[batch, 17, 32]``, which is true of that model but is not the signature users' code reads, and the
ledger rolls back a pass that turns a declared symbol into a number::

    upload:    pixel_values float[batch,3,32,32] -> ... -> last_hidden_state float[batch,seq,hidden]
    inferred:  inner values annotated; last_hidden_state float[batch,17,32]
    kept:      inner values annotated; last_hidden_state float[batch,seq,hidden]
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import onnx
import onnx_ir as ir
from pydantic import Field

from passes import _io_signature as io_signature
from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes._subgraphs import in_branches

_INLINE_LIMIT_BYTES = 1024


class ShapeInferenceOptions(PassOptions):
    data_prop: bool = Field(True, description="Propagate constant values through shape ops (Shape, Gather, Concat...).")
    strict: bool = Field(
        False,
        description="Stop at the first node ONNX cannot infer and leave the whole model unannotated, "
        "instead of annotating every value it can.",
    )


@contextmanager
def without_large_initializers(graph: ir.Graph) -> Iterator[None]:
    """Temporarily turn large or external initializers into typed graph inputs; restore the exact order."""
    order = list(graph.initializers.values())
    inputs = list(graph.inputs)
    moved = []
    for value in order:
        tensor = value.const_value
        if tensor is None or isinstance(tensor, ir.ExternalTensor) or tensor.nbytes > _INLINE_LIMIT_BYTES:
            moved.append(value)
    try:
        for value in moved:
            if value.const_value is not None:
                value.shape = value.shape or ir.Shape(value.const_value.shape)
                value.dtype = value.dtype or value.const_value.dtype
            if value not in inputs:
                graph.inputs.append(value)
            assert value.name is not None
            graph.initializers.pop(value.name)
        yield
    finally:
        graph.inputs.clear()
        graph.inputs.extend(inputs)
        graph.initializers.clear()
        for value in order:
            graph.initializers.add(value)


def _merge_shape(known: ir.Shape | None, inferred: ir.Shape | None) -> ir.Shape | None:
    """Per dimension: a declared size wins, then an inferred size, then a declared name, then inference."""
    if inferred is None:
        return known
    if known is None:
        return inferred
    if len(known) != len(inferred):
        return known  # the model declares something else; inference does not overrule it

    def pick(k: int | ir.SymbolicDim, i: int | ir.SymbolicDim) -> int | ir.SymbolicDim:
        if isinstance(k, int) or (k.value is not None and not isinstance(i, int)):
            return k
        return i

    return ir.Shape([pick(k, i) for k, i in zip(known, inferred, strict=True)])


def _merge(model: ir.Model, inferred: ir.Model) -> None:
    """Copy inferred types and shapes onto the model's values."""
    for graph, inferred_graph in zip(model.graphs(), inferred.graphs(), strict=False):
        inferred_values = ir.convenience.create_value_mapping(inferred_graph, include_subgraphs=False)
        for name, value in ir.convenience.create_value_mapping(graph, include_subgraphs=False).items():
            source = inferred_values.get(name)
            if source is None:
                continue
            if value.type is None and source.type is not None:
                value.type = source.type
            value.shape = _merge_shape(value.shape, source.shape)


def _annotations(model: ir.Model) -> dict[tuple[int, str], tuple[str, tuple | None]]:
    """Every value's type and dims, keyed by graph and name: what the pass counts as changed."""
    return {
        (index, name): (str(value.type), None if value.shape is None else tuple(value.shape.dims))
        for index, graph in enumerate(model.graphs())
        for name, value in ir.convenience.create_value_mapping(graph, include_subgraphs=False).items()
    }


class ShapeInference(Pass[ShapeInferenceOptions]):
    name = "shape_inference"
    summary = "Annotate values with ONNX-inferred element types and shapes (no graph change)."
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        # A merged decoder: inferred inside its If, a branch's shapes meet the outer outputs Optimum declared
        # for the other branch, and the values propagated from them are wrong (a cross-attention length of 4).
        if (branches := in_branches(self, model, ctx)) is not None:
            return branches
        options = self.options
        try:
            with without_large_initializers(model.graph):
                proto = ir.serde.serialize_model(model)
            inferred_proto = onnx.shape_inference.infer_shapes(
                proto, check_type=True, strict_mode=options.strict, data_prop=options.data_prop
            )
        except Exception as exc:  # onnx raises InferenceError, ValidationError or RuntimeError
            reason = f"ONNX shape inference failed, model left unannotated: {type(exc).__name__}: {exc}"
            return PassResult(model, modified=False, non_matches=[NonMatch(reason[:2000])])
        before = _annotations(model)
        declared = io_signature.capture(model)
        _merge(model, ir.serde.deserialize_model(inferred_proto))
        io_signature.restore(model, declared)
        after = _annotations(model)
        typed = sum(1 for key, annotation in after.items() if before.get(key) != annotation)
        untyped = sum(
            1
            for graph in model.graphs()
            for value in ir.convenience.create_value_mapping(graph, include_subgraphs=False).values()
            if value.type is None or value.shape is None
        )
        return PassResult(model, modified=typed > 0, counts={"values_typed": typed, "values_untyped": untyped})


def ensure_shapes(model: ir.Model, ctx: PassContext) -> dict[str, str]:
    """For a pass that reads every value's rank and dims (upstream_reshape, upstream_slice): run shape
    inference first when a node output has no shape. Returns the notes that say so, for the caller's result."""
    if all(o.shape is not None for n in model.graph for o in n.outputs):
        return {}
    ShapeInference()(model, ctx)
    return {"shape_inference": "ran first: some values had no shape"}
