"""A key laid out ``[B, h, d, S]`` by its own projection handed to the SDPA rule as the transpose of a ``[B, h, S,
d]`` key.

SqueezeBERT projects q, k and v with 1-D convolutions over ``[B, C, S]`` and views k straight to ``[B, h, d, S]``
(its ``transpose_key_for_scores`` is a view, no permute): the scores are ``MatMul(q, kT)`` with no Transpose in
front of ``kT``. onnxscript's SDPA rule reads the key as ``Transpose(k, [0, 1, 3, 2])`` and found no match at all
(0/2 under both exporters). Such a key is written as the transpose of its transpose::

    MatMul(q, kT)   ==>   MatMul(q, Transpose(Transpose(kT, [0, 1, 3, 2]), [0, 1, 3, 2]))

Exact: the two transposes cancel. The rule then takes ``Transpose(kT, [0, 1, 3, 2])`` as k. Run just before the
SDPA step, after onnxscript's optimizer, which would fold the pair away. Only scores that reach a ``Softmax``
and whose key is a ``Reshape``'s view are touched: a transposed key, or one scaled after its transpose (torch's
SDPA decomposition), is a form the rule reads itself.
"""

from __future__ import annotations

import onnx_ir as ir

from passes.fusion._attention_shapes import reaches_softmax

_ONNX = ("", "ai.onnx")
_SWAP = [0, 1, 3, 2]


def expose(model: ir.Model) -> int:
    """Every rank-4 score product whose key is viewed to ``[B, h, d, S]`` by a Reshape given the transpose pair;
    how many."""
    done = 0
    for product in list(model.graph):
        if product.op_type != "MatMul" or product.domain not in _ONNX or len(product.inputs) != 2:
            continue
        q, key = product.inputs
        if q is None or key is None or q.shape is None or key.shape is None or len(q.shape) != 4:
            continue
        if len(key.shape) != 4 or key.const_value is not None:
            continue
        producer = key.producer()
        if producer is None or producer.domain not in _ONNX or producer.op_type != "Reshape":
            continue  # only a view to [B, h, d, S]; a transposed or scaled key is a form the rule reads itself
        if not reaches_softmax(product.outputs[0]):
            continue
        _through_pair(model, product, key, _SWAP, product.name or f"scores_{done}")
        done += 1
    return done


_READ = ([0, 1, 3, 2], [0, 2, 3, 1])  # k^T of heads-first keys, or of [B, S, h, d] keys: read as they are


def split_permuted(model: ir.Model) -> int:
    """Every rank-4 score product whose key is ``Transpose(X, p)`` with another permutation than the two the
    matcher reads, rewritten ``Transpose(Transpose(X, [p0, p1, p3, p2]), [0, 1, 3, 2])``; how many."""
    done = 0
    for product in list(model.graph):
        if product.op_type != "MatMul" or product.domain not in _ONNX or len(product.inputs) != 2:
            continue
        key = product.inputs[1]
        producer = key.producer() if key is not None else None
        if producer is None or producer.op_type != "Transpose" or producer.domain not in _ONNX:
            continue
        perm = list(producer.attributes.get_ints("perm", []))
        if len(perm) != 4 or perm in _READ or perm == sorted(perm) or not reaches_softmax(product.outputs[0]):
            continue
        _through_pair(
            model, product, producer.inputs[0], [perm[0], perm[1], perm[3], perm[2]], product.name or f"scores_{done}"
        )
        done += 1
    return done


def _through_pair(model: ir.Model, product: ir.Node, source: ir.Value, perm: list[int], prefix: str) -> None:
    """``product``'s key read as ``Transpose(Transpose(source, perm), [0, 1, 3, 2])``: the inner one the ``[B, h,
    S, d]`` key the rules read, ``perm`` what makes it from ``source``."""
    key = product.inputs[1]
    inner = ir.node("Transpose", [source], {"perm": perm}, name=f"{prefix}/key")
    swap = ir.node("Transpose", [inner.outputs[0]], {"perm": _SWAP}, name=f"{prefix}/key_t")
    if key.dtype is not None:  # an untyped key (no value_info) leaves both untyped: Tensor(None) cannot serialize
        inner.outputs[0].dtype = swap.outputs[0].dtype = key.dtype
    if key.shape is not None:
        dims = list(key.shape)
        inner.outputs[0].shape = ir.Shape([dims[0], dims[1], dims[3], dims[2]])
        swap.outputs[0].shape = key.shape
    model.graph.insert_before(product, [inner, swap])
    product.replace_input_with(1, swap.outputs[0])
