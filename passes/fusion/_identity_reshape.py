"""Reshapes that give back their input's shape, dropped before fusion so that they hide no pattern.

torch's TorchScript SDPA symbolic (``attn_implementation="sdpa"``, the default of transformers' BERT-style
models) reshapes the attention output to ``[B, -1, S, d]``, its own shape, with a target computed at run time
from three other tensors' shapes::

    P --MatMul(v)--> a[B,h,S,d] --Reshape(Concat(Shape(a)[0], -1, Shape(q)[2], Shape(v)[3]))--> a'[B,h,S,d]
        --Transpose(0,2,1,3)--Reshape([B,S,h*d])-->

onnxscript's MHA rule reads ``Reshape(Transpose(SDPA))`` and stops at the SDPA instead, so after fusion
``MultiHeadAttention`` was followed by a Reshape, Transpose, Reshape, Transpose chain back to ``[B, S, h*d]``
that ORT cannot cancel across the middle Reshape (distilbert, TorchScript SDPA, one thread: 6% of its time at
batch 1 / 64 tokens). With ORT's symbolic shapes (``_symbolic_shapes``, which ``fuse_transformer`` runs first)
the Reshape's input and output shapes read the same, dim for dim (equal ints or the same symbol); a Reshape
keeps the element order, so it is then the identity and its output is replaced by its input. Exact. A graph
output is left alone (its name is the model's interface), and so is a Reshape whose shapes are not fully
known: an unknown dim proves nothing. Symbolic inference equates dims where it must assume (broadcasting); a
wrong assumption would show as a shape mismatch in the candidate's verification against the original, which
``fuse_transformer`` runs on every candidate before choosing it.
"""

from __future__ import annotations

import onnx_ir as ir


def _same_shape(a: ir.Shape | None, b: ir.Shape | None) -> bool:
    if a is None or b is None or len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, int) or isinstance(y, int):
            if not (isinstance(x, int) and isinstance(y, int) and x == y):
                return False
        elif x.value is None or y.value is None or x.value != y.value:
            return False
    return True


def drop_identity_reshapes(model: ir.Model) -> int:
    """Replace the output of every Reshape whose known input and output shapes are the same by its input."""
    outputs = set(model.graph.outputs)
    dropped = 0
    for node in list(model.graph):
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        x, y = node.inputs[0], node.outputs[0]
        if x is None or y in outputs or not _same_shape(x.shape, y.shape):
            continue
        ir.convenience.replace_all_uses_with(y, x)
        model.graph.remove(node, safe=True)
        dropped += 1
    return dropped
