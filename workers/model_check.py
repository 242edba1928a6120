"""The ONNX checker as the engine runs it on an upload and on every stage it writes, accepting graph inputs
and outputs that declare a type but no shape.

``onnx.checker.check_model`` refuses a main-graph input or output whose tensor type has no ``shape`` field
("Field 'shape' of 'type' is required but missing"), yet the ONNX IR makes the shape optional (absent: the
rank is unknown), ONNX Runtime loads and runs such graphs, and they are common: a graph output built with
``onnx.helper.make_tensor_value_info(name, elem_type, None)``, or one whose shape a tool dropped. Such a
model is checked here in full on a copy where those values carry an empty shape, the one field the checker
asks for; without ``full_check`` the checker reads no ranks from it, so nothing else is waived. The model
itself is never changed.

The other waiver: ``SimplifiedLayerNormalization`` in the ONNX domain, the RMS norm ORT registers there (ONNX has
no schema for it) and writes there itself: a Llama-style model saved by an ORT session
(``optimized_model_filepath``) or by ORT's transformers optimizer holds it, ORT loads and runs it, and the checker
refused the whole upload ("No Op registered for SimplifiedLayerNormalization"). The copy checked has each such
norm written out in standard ops (``passes.fusion._rms_norm``, the form ORT's session fuses back); a norm that
cannot be written out (another axis, its statistics read) stays, and the checker names it.

The third: nodes out of topological order, which ONNX requires and ORT does not (it sorts the graph on load).
ORT's own float16 converter (``onnxruntime.transformers.float16``, ``keep_io_types=True``) appends the Casts of
the graph inputs after the nodes that read them. The copy checked is sorted (``sorted_copy``); the engine
sorts the model it works on the same way (``workers.artifacts``), and the upload itself is not changed.

Runs after ``workers/validate.py`` has vetted the upload (external-data locations and ranges included), so
the copy's check, which cannot open external data beside the file, loses nothing that validation does not
already enforce.
"""

from __future__ import annotations

from pathlib import Path

import onnx


def shapeless_io(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The main graph's inputs and outputs that have a tensor (or sparse tensor) type without a shape."""
    found = []
    for value in (*proto.graph.input, *proto.graph.output):
        kind = value.type.WhichOneof("value")
        if kind in ("tensor_type", "sparse_tensor_type") and not getattr(value.type, kind).HasField("shape"):
            found.append(value)
    return found


def ort_onnx_domain_norms(proto: onnx.ModelProto) -> int:
    """Default-domain ``SimplifiedLayerNormalization`` nodes of the main graph (ORT's, no ONNX schema)."""
    return sum(n.op_type == "SimplifiedLayerNormalization" and n.domain in ("", "ai.onnx") for n in proto.graph.node)


def unsorted_nodes(proto: onnx.ModelProto) -> int:
    """Main-graph nodes that read a value no graph input, initializer or earlier node gives (out of order, or
    reading a value nothing produces, which the checker still names after sorting)."""
    known = {v.name for v in proto.graph.input} | {t.name for t in proto.graph.initializer} | {""}
    count = 0
    for node in proto.graph.node:
        count += any(name not in known for name in node.input)
        known.update(node.output)
    return count


def sorted_copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with its nodes in topological order (onnx-ir's sort, subgraphs included)."""
    import onnx_ir as ir

    model = ir.serde.deserialize_model(proto)
    model.graph.sort()
    return ir.serde.serialize_model(model)


def _norms_written_out(proto: onnx.ModelProto) -> onnx.ModelProto:
    import onnx_ir as ir

    from passes.fusion._rms_norm import expand_simplified_layer_norms

    model = ir.serde.deserialize_model(proto)
    expand_simplified_layer_norms(model)
    return ir.serde.serialize_model(model)


def check_model(path: Path) -> None:
    """``onnx.checker.check_model`` on the model at ``path``; a graph input or output with a type and no
    shape, ORT's ONNX-domain ``SimplifiedLayerNormalization`` and nodes out of topological order are accepted.
    Raises ``onnx.checker.ValidationError`` for anything else the checker refuses."""
    try:
        onnx.checker.check_model(str(path))
        return
    except onnx.checker.ValidationError:
        proto = onnx.load(str(path), load_external_data=False)
        shapeless = shapeless_io(proto)
        unsorted = unsorted_nodes(proto)
        if not shapeless and not ort_onnx_domain_norms(proto) and not unsorted:
            raise
    if unsorted:
        proto = sorted_copy(proto)
        shapeless = shapeless_io(proto)
    for value in shapeless:
        getattr(value.type, value.type.WhichOneof("value")).shape.SetInParent()
    if ort_onnx_domain_norms(proto):
        proto = _norms_written_out(proto)
    onnx.checker.check_model(proto)
