"""ORT's symbolic shape inference for fuse_transformer, fed Constants in the one form it reads.

TorchScript exports split heads with ``view(*input_shape, -1, head_dim)``: a runtime-computed shape holding
-1, where ONNX's inference gives every Reshape a fresh unknown heads dim and onnxscript's SDPA rule then
refuses q, k and v as of different shapes. ORT's symbolic inference follows ``Shape -> Gather -> Concat ->
Reshape`` and resolves them to the same ``[batch, sequence, heads, head_dim]``.

It reads a Constant's ``value`` attribute only, and raises on ``value_int(s)``/``value_float(s)``/
``value_string(s)``. onnxscript's constant folder (the ``constant_folding`` pass, run before fusion in the
``fast`` preset) writes the folded shape pieces of those Reshapes as ``Constant(value_ints=...)``, so under
``fast`` the inference failed, the heads dims stayed unknown and no attention fused on the TorchScript T5,
BART, GPT-2 and Llama exports::

    Constant <value_ints = [0, 0, -1, 8]>   ==>   Constant <value = int64[4] {0, 0, -1, 8}>

The two forms are the same tensor by the ONNX spec (``value_int`` a 0-d int64, ``value_ints`` a 1-D int64,
floats float32, strings string), so the rewritten model computes the same function.
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

# Constant attribute -> (numpy dtype, rank) of the tensor the ONNX spec says it stands for.
_FORMS: dict[str, tuple[type, int]] = {
    "value_int": (np.int64, 0),
    "value_ints": (np.int64, 1),
    "value_float": (np.float32, 0),
    "value_floats": (np.float32, 1),
    "value_string": (np.object_, 0),
    "value_strings": (np.object_, 1),
}


def infer(proto: onnx.ModelProto, report: dict[str, Any]) -> onnx.ModelProto:
    """``proto`` with ORT's symbolic shapes, its Constants in tensor form; ``proto`` itself (and the reason
    in ``report["symbolic_shapes"]``) when the inference refuses it, which only costs the fusions needing it."""
    # Deferred for start-up cost: the module imports sympy, which only this pass needs. Imported the way ORT's
    # transformers optimizer imports it (a top-level module on its path), not as ``onnxruntime.tools.*``: that
    # package's __init__ imports torch wherever torch is installed (seconds per job, for nothing), and the
    # optimizer in ``_ort`` would load a second copy of the module anyway.
    from passes.fusion._symbolic_gqa import infer_shapes  # ORT's, with GQA's presents typed without a past

    readable = onnx.ModelProto()
    readable.CopyFrom(proto)
    rewritten = constants_as_tensors(readable.graph)
    try:
        # On an incomplete inference ORT saves the whole model (weights as external data) into the working
        # directory for debugging: a read-only directory in a container would turn the refusal into another
        # error, and a shared one would collect a copy of every upload. Passes run one at a time per process.
        with tempfile.TemporaryDirectory(prefix="onnxforge-symshapes-") as scratch, contextlib.chdir(scratch):
            inferred = infer_shapes(readable, auto_merge=True)
    except Exception as exc:  # any refusal only costs the fusions that need it
        report["symbolic_shapes"] = f"skipped: {type(exc).__name__}: {str(exc)[:200]}"
        return proto
    if inferred is None:
        report["symbolic_shapes"] = "skipped: ORT's symbolic shape inference returned no model"
        return proto
    report["symbolic_shapes"] = "applied"
    report["constants_as_tensors"] = rewritten
    return inferred


def constants_as_tensors(graph: onnx.GraphProto) -> int:
    """Rewrite every ``Constant`` of ``graph`` and its subgraphs that uses a list/scalar attribute to the
    ``value`` tensor it stands for, in place; returns how many were rewritten."""
    count = 0
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                count += constants_as_tensors(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                count += sum(constants_as_tensors(g) for g in attr.graphs)
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
            continue
        attr = node.attribute[0]
        if attr.name not in _FORMS:
            continue
        dtype, rank = _FORMS[attr.name]
        raw = onnx.helper.get_attribute_value(attr)
        if dtype is np.object_:
            raw = [s.decode("utf-8") for s in raw] if rank else raw.decode("utf-8")
        tensor = numpy_helper.from_array(np.array(raw, dtype=dtype))
        node.ClearField("attribute")
        node.attribute.append(onnx.helper.make_attribute("value", tensor))
        count += 1
    return count
