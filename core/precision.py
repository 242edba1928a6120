"""The precision a model computes in, read from its weights: what its outputs' type does not say.

ORT's float16 converter (``onnxruntime.transformers.float16``, ``keep_io_types=True``) and mixed-precision
exports keep float32 inputs and outputs around float16 (or bfloat16) arithmetic, so verification compares
float32 outputs that are only as exact as the half-precision math inside (``Tolerance.in_precision``).
"""

from __future__ import annotations

import math
from collections import Counter

import onnx

from core.config import HALF_PRECISION_FLOOR

_FLOATS = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.DOUBLE: "float64",
}


def compute_precision(proto: onnx.ModelProto) -> str | None:
    """ "float16" or "bfloat16" when most float weight elements of the main graph (initializers and Constant
    nodes; external data counted by its dims, not read) are of that type, else None."""
    tensors = [*proto.graph.initializer]
    tensors += [a.t for n in proto.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    elements: Counter[str] = Counter()
    for tensor in tensors:
        if (name := _FLOATS.get(tensor.data_type)) is not None:
            elements[name] += math.prod(tensor.dims)
    if not elements:
        return None
    top = elements.most_common(1)[0][0]
    return top if top in HALF_PRECISION_FLOOR else None
