"""The NaN guard of TorchScript's scaled_dot_product_attention, in the scalar form onnxscript's SDPA rule reads.

torch.onnx's TorchScript exporter (``dynamo=False``, ``attn_implementation="sdpa"``) writes the guard that
zeroes fully-masked rows with a one-element ``[1]`` constant; onnxscript's ``SDPA`` pattern wants the scalar
``0.0`` and otherwise stops there ("is not a scalar, expecting 0.0")::

    p = Softmax(s)                          p = Softmax(s)
    Where(IsNaN(p), zero[1] = {0}, p)  ==>  Where(IsNaN(p), zero[] = 0, p)

Exact: ``p`` has rank >= 1, so a ``[1]`` tensor and a scalar broadcast to the same shape and values. The SDPA
rule then drops the guard, so ``guard_fused_attention`` puts it back on the fused op's output. Built
with onnxscript's exported pattern API (``RewriteRuleClassBase``, ``MatchResult.fail``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern


class ScalarNanGuard(pattern.RewriteRuleClassBase):
    def pattern(self, op, probs, zero):
        return op.Where(op.IsNaN(probs), zero, probs)

    def check(self, context, probs: ir.Value, zero: ir.Value, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if zero.const_value is None:
            return result.fail("the guard's fill value is not a constant", zero)
        if zero.const_value.shape != (1,):
            return result.fail(f"fill shape {zero.const_value.shape}, expected [1]", zero)
        if zero.const_value.numpy().reshape(-1)[0] != 0:
            return result.fail("the guard fills with a non-zero value", zero)
        producer = probs.producer()
        if producer is None or producer.op_type != "Softmax" or producer.domain not in ("", "ai.onnx"):
            return result.fail("the guarded value is not a Softmax output", probs)
        if probs.shape is not None and probs.shape.rank() == 0:
            return result.fail("Softmax output of rank 0: a [1] fill would change the output shape", probs)
        return result

    def rewrite(self, op, probs, zero, **_):
        fill = op.Constant(value=ir.tensor(np.array(0, zero.const_value.dtype.numpy())))
        return op.Where(op.IsNaN(probs), fill, probs)


rules = pattern.RewriteRuleSet([ScalarNanGuard.rule()])


# The fused ops whose rows follow the Softmax of the attention they replaced; attention_bias is input 5 of both.
_FUSED_ATTENTION = ("Attention", "MultiHeadAttention")
_BIAS_INPUT = 5
_WALK_LIMIT = 64  # nodes read above a bias: a mask's subgraph is a handful of ops, a score path never reached


def _holds_neg_inf(tensor: ir.TensorProtocol | None) -> bool:
    if tensor is None or tensor.dtype is None or not tensor.dtype.is_floating_point():
        return False
    return bool(np.isneginf(tensor.numpy()).any())


def _may_hold_neg_inf(bias: ir.Value) -> bool:
    """Whether ``bias`` is computed from a constant holding -inf (TorchScript SDPA's ``Where(mask, 0, -inf)``),
    so that a row can be masked in full; a finite fill (``finfo.min``) cannot give a NaN Softmax."""
    seen: set[int] = set()
    stack = [bias]
    while stack and len(seen) < _WALK_LIMIT:
        value = stack.pop()
        if _holds_neg_inf(value.const_value):
            return True
        node = value.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type == "Constant":
            attr = node.attributes.get("value")
            if attr is not None and _holds_neg_inf(attr.as_tensor()):
                return True
            continue
        stack.extend(v for v in node.inputs if v is not None)
    return False


def count_guards(model: ir.Model) -> int:
    """``Where(IsNaN(Softmax(..)), 0, ..)`` nodes: attentions whose fully masked rows the model defines as 0."""
    found = 0
    for node in model.graph:
        if node.op_type != "Where" or node.domain not in ("", "ai.onnx") or node.inputs[0] is None:
            continue
        test = node.inputs[0].producer()
        probs = test.inputs[0].producer() if test is not None and test.op_type == "IsNaN" else None
        found += probs is not None and probs.op_type == "Softmax"
    return found


def guard_fused_attention(model: ir.Model) -> int:
    """Restore the NaN guard that onnxscript's SDPA rule absorbs, on the fused op's output.

    The guard zeroes a row of probabilities that is NaN, i.e. a query whose every key is masked with -inf (a
    padded query outside every sliding window: ModernBERT's local layers; a row whose attention mask is all
    zeros). ``Attention``/``MultiHeadAttention`` return NaN for that query instead, and the next layer's
    ``probs @ V`` spreads it to every valid token (0 * NaN). Zeroing the fused output's NaN rows is the same::

        Where(IsNaN(p), 0, p) @ V  ==  Where(IsNaN(y), 0, y),  y = p @ V

    since a Softmax row is NaN in full or not at all and V is finite on finite inputs (the guarded model never
    makes a NaN). Added only where the bias can hold -inf: a finite fill never gives a NaN row."""
    added = 0
    for node in list(model.graph):
        if node.domain != "com.microsoft" or node.op_type not in _FUSED_ATTENTION:
            continue
        bias = node.inputs[_BIAS_INPUT] if len(node.inputs) > _BIAS_INPUT else None
        if bias is None or not _may_hold_neg_inf(bias):
            continue
        out = node.outputs[0]
        readers = list(out.uses())  # before the guard reads it too
        made = zero_nan_rows(out)
        guarded = made[-1].outputs[0]
        for reader, index in readers:
            reader.replace_input_with(index, guarded)
        outputs = model.graph.outputs
        for i, value in enumerate(outputs):
            if value is out:  # the model's output keeps its name, now on the guarded value
                name, out.name = out.name, None
                guarded.name = name
                outputs[i] = guarded
        model.graph.insert_after(node, made)
        added += 1
    return added


_TYPE_SEARCH_DEPTH = 8


def zero_nan_rows(out: ir.Value) -> list[ir.Node]:
    """``Where(IsNaN(out), 0, out)``: the nodes to insert after ``out``'s producer, the last one's output the
    guarded value (same type and shape). Rewiring ``out``'s readers is the caller's."""
    zero = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(0, _float_type(out)))})
    isnan = ir.node("IsNaN", [out])
    where = ir.node("Where", [isnan.outputs[0], zero.outputs[0], out])
    where.outputs[0].shape, where.outputs[0].type = out.shape, out.type
    return [zero, isnan, where]


def _float_type(out: ir.Value) -> np.dtype:
    """The guarded value's element type. A fused op's new output is often untyped, and so are the reshapes a
    rewrite puts before it: the first typed float value up its data inputs (input 0: the query, whose type the
    attention returns) gives it. A float32 zero beside a float16 output is a model ORT refuses to load."""
    value: ir.Value | None = out
    for _ in range(_TYPE_SEARCH_DEPTH):
        if value is None:
            break
        if value.type is not None and value.type.dtype.is_floating_point():
            return value.type.dtype.numpy()
        producer = value.producer()
        value = producer.inputs[0] if producer is not None and producer.inputs else None
    return np.dtype(np.float32)
