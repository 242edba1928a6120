"""The graph's declared inputs and outputs, kept through any pass that runs shape inference.

Used by ``cleanup/shape_inference`` (ONNX inference on the model itself) and ``fusion/fuse_transformer``
(inference on its candidates). fuse_transformer builds its candidates on copies that ORT's symbolic shape
inference and ONNX's (through onnxscript/onnx-ir, which overwrite declared shapes) have annotated.
On an export with a fixed image size they resolve the sequence axis of the output, declared as a symbol,
to a number (ViT 32x32 with 8x8 patches: 16 patches + CLS = 17), and the candidate then declared
``last_hidden_state: float[batch, 17, 32]`` where the upload said ``float[batch, seq, hidden]``. The number
is right for that model, but the declared signature is what users' code reads and what the pipeline's
ledger holds each pass to (a pass that turns a symbolic axis into a number is rolled back), so the returned
model declares its inputs and outputs exactly as its input model did, whatever inference found inside::

    in:  pixel_values float[batch,3,32,32]  ->  last_hidden_state float[batch,s1,s2]
    candidate after inference:                  last_hidden_state float[batch,17,32]
    returned:                                   last_hidden_state float[batch,s1,s2]

A candidate that renamed, reordered, dropped or retyped a graph input or output computes something else
than the signature says; it is refused (``SignatureChanged``) rather than relabelled.
"""

from __future__ import annotations

import copy
import dataclasses

import onnx_ir as ir


class SignatureChanged(ValueError):
    """A candidate's graph inputs or outputs are not the original's (names, order or element types)."""


@dataclasses.dataclass(frozen=True)
class Declared:
    """One graph input or output as declared: its name, type and shape (None where none is declared)."""

    name: str
    type: ir.TypeProtocol | None
    shape: ir.Shape | None


@dataclasses.dataclass(frozen=True)
class Signature:
    inputs: tuple[Declared, ...]
    outputs: tuple[Declared, ...]


def _declared(value: ir.Value) -> Declared:
    return Declared(value.name or "", _copy_type(value.type), _copy_shape(value.shape))


def _copy_type(type_: ir.TypeProtocol | None) -> ir.TypeProtocol | None:
    # Setting a value's dtype edits its type object in place: no two models may share one.
    return copy.deepcopy(type_)


def _copy_shape(shape: ir.Shape | None) -> ir.Shape | None:
    if shape is None:
        return None
    return ir.Shape(shape.dims, denotations=[shape.get_denotation(axis) for axis in range(shape.rank())])


def _graph_inputs(graph: ir.Graph) -> list[ir.Value]:
    # Initializers listed as inputs (IR < 4 exports) are weights, not part of the signature users feed.
    return [v for v in graph.inputs if v.name not in graph.initializers]


def capture(model: ir.Model) -> Signature:
    """The declarations of ``model``'s graph inputs (initializers excluded) and outputs."""
    graph = model.graph
    return Signature(tuple(_declared(v) for v in _graph_inputs(graph)), tuple(_declared(v) for v in graph.outputs))


def restore(model: ir.Model, signature: Signature) -> int:
    """Declare ``model``'s graph inputs and outputs as in ``signature``, in place; how many declarations
    changed. Raises SignatureChanged where a name, the order or an element type differs."""
    graph = model.graph
    changed = 0
    for kind, values, declared in (
        ("input", _graph_inputs(graph), signature.inputs),
        ("output", list(graph.outputs), signature.outputs),
    ):
        names = [v.name for v in values]
        if names != [d.name for d in declared]:
            raise SignatureChanged(f"graph {kind}s changed: {[d.name for d in declared]} -> {names}")
        for value, want in zip(values, declared, strict=True):
            if value.dtype is not None and want.type is not None and value.dtype != want.type.dtype:
                raise SignatureChanged(f"graph {kind} {want.name!r} changed type: {want.type} -> {value.type}")
            before = _declared(value)
            if want.type is not None:
                value.type = _copy_type(want.type)
            value.shape = _copy_shape(want.shape)
            changed += before != _declared(value)
    return changed
