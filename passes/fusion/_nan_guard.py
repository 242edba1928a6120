"""The NaN guard of TorchScript's scaled_dot_product_attention, in the scalar form onnxscript's SDPA rule reads.

torch.onnx's TorchScript exporter (``dynamo=False``, ``attn_implementation="sdpa"``) writes the guard that
zeroes fully-masked rows with a one-element ``[1]`` constant; onnxscript's ``SDPA`` pattern wants the scalar
``0.0`` and otherwise stops there ("is not a scalar, expecting 0.0")::

    p = Softmax(s)                          p = Softmax(s)
    Where(IsNaN(p), zero[1] = {0}, p)  ==>  Where(IsNaN(p), zero[] = 0, p)

Exact: ``p`` has rank >= 1, so a ``[1]`` tensor and a scalar broadcast to the same shape and values. Built
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
