"""The ONNX checker as the engine runs it on an upload and on every stage it writes, accepting graph inputs
and outputs that declare a type but no shape.

``onnx.checker.check_model`` refuses a main-graph input or output whose tensor type has no ``shape`` field
("Field 'shape' of 'type' is required but missing"), yet the ONNX IR makes the shape optional (absent: the
rank is unknown), ONNX Runtime loads and runs such graphs, and they are common: a graph output built with
``onnx.helper.make_tensor_value_info(name, elem_type, None)``, or one whose shape a tool dropped. Such a
model is checked here in full on a copy where those values carry an empty shape, the one field the checker
asks for; without ``full_check`` the checker reads no ranks from it, so nothing else is waived. The model
itself is never changed.

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


def check_model(path: Path) -> None:
    """``onnx.checker.check_model`` on the model at ``path``; a graph input or output with a type and no
    shape is accepted. Raises ``onnx.checker.ValidationError`` for anything else the checker refuses."""
    try:
        onnx.checker.check_model(str(path))
        return
    except onnx.checker.ValidationError:
        proto = onnx.load(str(path), load_external_data=False)
        shapeless = shapeless_io(proto)
        if not shapeless:
            raise
    for value in shapeless:
        getattr(value.type, value.type.WhichOneof("value")).shape.SetInParent()
    onnx.checker.check_model(proto)
