"""Decoder RMS norms in the form ORT's session fuses into ``SimplifiedLayerNormalization``.

The dynamo exporter writes ``torch.rsqrt`` as ``Reciprocal(Sqrt(.))``; ORT's ``LayerNormFusion`` (simplified
form) looks for ``Div`` after the ``Sqrt`` and leaves every such norm of a dynamo-exported Llama, Qwen2,
Mistral or Phi-3 as six elementwise nodes (measured on tests/models/decoders: 5 of 5 norms unfused at ORT's
default level, while the TorchScript export of the same model fuses all 5)::

    Mul(x, Reciprocal(Sqrt(Add(ReduceMean(Pow(x, 2), [-1]), eps))))
    ==>  Mul(x, Div(1, Sqrt(Add(ReduceMean(Pow(x, 2), [-1]), eps))))

``1 / s`` is the operation ``Reciprocal`` computes (IEEE division, correctly rounded), so the values are
unchanged; the session then fuses the norm with its weight ``Mul`` whichever operand order the exporter wrote.
Gemma 4 writes the root as ``torch.pow(ms, -0.5)`` (for JAX's sake), ``Pow(Add(ReduceMean(Pow(x, 2)), eps),
-0.5)``, which the session fuses neither: it becomes ``Div(1, Sqrt(.))`` too (``pow(y, -0.5)`` and ``1 /
sqrt(y)`` differ by at most an ulp or two; the pass's verification bounds it like any other).
Writing ``SimplifiedLayerNormalization`` into the artifact instead is not an option: ONNX has no such schema
in the default domain and the checker refuses it (``_rms_norm``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.fusion._rotary_eval import axes_of, const, scalar

_ONNX = ("", "ai.onnx")


def _rms_sqrt(reciprocal: ir.Node) -> ir.Value | None:
    """The Sqrt output under ``reciprocal`` when it is an RMS norm's root mean square over the last axis."""
    sqrt = reciprocal.inputs[0].producer() if reciprocal.inputs[0] is not None else None
    if sqrt is None or sqrt.op_type != "Sqrt" or not _mean_square(sqrt.inputs[0]):
        return None
    return reciprocal.inputs[0]


def _mean_square(value: ir.Value | None) -> bool:
    """Whether ``value`` is ``Add(ReduceMean(Pow(x, 2)) over the last axis, eps)``."""
    add = value.producer() if value is not None else None
    if add is None or add.op_type != "Add":
        return False
    for i in (0, 1):
        mean = add.inputs[i].producer() if add.inputs[i] is not None else None
        if mean is None or mean.op_type != "ReduceMean" or scalar(add.inputs[1 - i]) is None:
            continue
        power = mean.inputs[0].producer() if mean.inputs[0] is not None else None
        squares = power is not None and power.op_type == "Pow" and scalar(power.inputs[1]) == 2.0
        if squares and power is not None and (axes_of(mean) == [-1] or _last_axis(mean, power)):
            return True
    return False


def _last_axis(mean: ir.Node, power: ir.Node) -> bool:
    axes = axes_of(mean)
    shape = power.inputs[0].shape if power.inputs[0] is not None else None
    return axes is not None and shape is not None and axes == [len(shape) - 1]


def _dtype(root: ir.Value | None, inverse: ir.Node) -> ir.DataType | None:
    """The root's type: annotated (on it or on ``inverse``, the Reciprocal or Pow it replaces), else the epsilon
    constant's (an export without value_info, T5's dynamo files, annotates nothing before shape inference;
    ``Add(mean, eps)`` has one type)."""
    if root is None:
        return None
    if root.dtype is not None or inverse.outputs[0].dtype is not None:
        return root.dtype or inverse.outputs[0].dtype
    add = root.producer().inputs[0].producer()  # Sqrt(Add(..)): _rms_sqrt's, or the one made for a Pow
    eps = next((array for v in add.inputs if (array := const(v)) is not None), None)  # a Constant's (TorchScript)
    return ir.DataType.from_numpy(eps.dtype) if eps is not None and np.issubdtype(eps.dtype, np.floating) else None


def divide_rms_norms(graph: ir.Graph) -> int:
    """Rewrite each RMS norm's ``Reciprocal(Sqrt(.))`` as ``Div(1, Sqrt(.))``, and its ``Pow(., -0.5)`` as
    ``Div(1, Sqrt(.))``; the number rewritten."""
    rewritten = 0
    for node in list(graph):
        if node.domain not in _ONNX or node.outputs[0] in graph.outputs:
            continue
        if node.op_type == "Reciprocal":
            root, sqrt = _rms_sqrt(node), []
        elif node.op_type == "Pow" and scalar(node.inputs[1]) == -0.5 and _mean_square(node.inputs[0]):
            sqrt = [ir.node("Sqrt", [node.inputs[0]], name=f"{node.name}/sqrt")]
            root = sqrt[0].outputs[0]
            root.name, root.shape = f"{node.outputs[0].name}/sqrt", node.inputs[0].shape
        else:
            continue
        dtype = _dtype(root, node)
        if root is None or dtype is None:
            continue
        root.dtype = root.dtype or dtype
        one = ir.node("Constant", [], {"value": ir.tensor(np.array(1, dtype.numpy()))}, name=f"{node.name}/one")
        div = ir.node("Div", [one.outputs[0], root], name=f"{node.name}/as_div")
        div.outputs[0].name = f"{node.outputs[0].name}/as_div"
        div.outputs[0].dtype, div.outputs[0].shape = node.outputs[0].dtype or dtype, node.outputs[0].shape
        graph.insert_before(node, [*sqrt, one, div])
        ir.convenience.replace_all_uses_with(node.outputs[0], div.outputs[0])
        graph.remove(node, safe=True)
        rewritten += 1
    return rewritten
