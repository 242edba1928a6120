"""A scaled query (or key) that another product reads too, given a scaling of its own for the scores.

DeBERTa (v1) scales the query once and reads it twice: in the scores ``q/s @ k^T`` and in the content-to-position
term ``q/s @ pos_k^T`` added to them. onnxscript's SDPA rule (0.7.2) matches ``MatMul(Div(q, s), kT)`` and then
refuses the whole attention because the ``Div`` it would replace has another reader ("Matched nodes have other
uses preventing replacement"); it does not fall back to its unscaled alternative. This step gives the scores'
``MatMul`` a copy of the scaling, read by nothing else::

    qs = Div(q, s)                                   qs = Div(q, s)          (still read by the other product)
    MatMul(qs, kT) -> ... -> Softmax       ==>       MatMul(Div(q, s), kT) -> ... -> Softmax
    MatMul(qs, pos_kT)                               MatMul(qs, pos_kT)

Exact: the copy computes the same values. Run right before the SDPA rule, after the optimizer's common
subexpression elimination, which would merge the copy back. The SDPA rule then takes ``q`` and the scale; the
relative terms stay outside it, added to the scores as the attention bias (``_attention_bias``).
"""

from __future__ import annotations

import onnx_ir as ir

from passes.fusion._attention_shapes import reaches_softmax

_ONNX = ("", "ai.onnx")


def _scalar_scaling(value: ir.Value | None) -> ir.Node | None:
    """The ``Mul``/``Div`` by a one-element constant producing ``value``, when ``value`` has other readers too."""
    node = value.producer() if value is not None else None
    if node is None or node.domain not in _ONNX or node.op_type not in ("Mul", "Div") or len(value.uses()) < 2:
        return None
    scale = ir.convenience.get_const_tensor(node.inputs[1]) if node.inputs[1] is not None else None
    return node if scale is not None and scale.size == 1 else None


def give_scores_their_own_scale(model: ir.Model) -> int:
    """The copies made (module docstring): one per operand of a scores ``MatMul`` that leads to a Softmax."""
    made = 0
    for matmul in list(model.graph):
        if matmul.op_type != "MatMul" or matmul.domain not in _ONNX or not reaches_softmax(matmul.outputs[0], depth=3):
            continue
        for index in (0, 1):
            scaling = _scalar_scaling(matmul.inputs[index])
            if scaling is None:
                continue
            copy = ir.node(scaling.op_type, list(scaling.inputs), name=f"{scaling.name}/for_scores_{made}")
            model.graph.insert_before(matmul, [copy])
            copy.outputs[0].shape, copy.outputs[0].type = scaling.outputs[0].shape, scaling.outputs[0].type
            matmul.replace_input_with(index, copy.outputs[0])
            made += 1
    return made
