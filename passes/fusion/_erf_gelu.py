"""GELU's erf form with the half applied to ``x`` first, fused into ``com.microsoft::Gelu``.

onnxscript's ``erf_gelu`` rules (0.7.2) read ``0.5 * (x * (1 + erf(x / sqrt 2)))`` and
``x * (0.5 * (1 + erf(x / sqrt 2)))``. ESM's ``gelu`` (``x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))``),
and any module written the same way, exports as ``(x * 0.5) * (1 + erf(x / sqrt 2))`` under both exporters,
so only ORT's optimizer engine fused it, and on the TorchScript export its candidate lost to onnxscript's
(bench/heldout_text.py: ESM ts_eager and ts_sdpa, GELU 0/2)::

    Mul(Mul(h, 0.5), Add(Erf(Div(h, sqrt 2)), 1))     (or Mul(h, 1/sqrt 2); either operand order)
    ==>  Gelu(h)                                      (com.microsoft; BiasGelu once onnxscript's
                                                       bias_gelu rule takes the projection's bias)

Exact up to the kernel's rounding (``Gelu`` evaluates the same erf formula). The constants are checked with a
relative tolerance of 1e-4, and a mismatch names the constant and the value found. Built with onnxscript's
exported pattern API (``RewriteRuleClassBase``, ``MatchResult.fail``), every commuted order tried.
"""

from __future__ import annotations

import math

import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes.fusion._tanh_gelu import check_gelu


class _HalfFirstErfGelu(pattern.RewriteRuleClassBase):
    expected: dict[str, float]

    def check(self, context, h: ir.Value, **constants) -> pattern.MatchResult:
        return check_gelu(h, constants, self.expected, kernel="Gelu", form="the erf GELU")

    def rewrite(self, op, h, **_):
        return op.Gelu(h, _domain="com.microsoft")


class DivHalfFirstErfGelu(_HalfFirstErfGelu):
    expected = {"half": 0.5, "root": math.sqrt(2.0), "one": 1.0}

    def pattern(self, op, h, half, root, one):
        return op.Mul(op.Mul(h, half), op.Add(op.Erf(op.Div(h, root)), one))


class MulHalfFirstErfGelu(_HalfFirstErfGelu):
    expected = {"half": 0.5, "root": 1.0 / math.sqrt(2.0), "one": 1.0}

    def pattern(self, op, h, half, root, one):
        return op.Mul(op.Mul(h, half), op.Add(op.Erf(op.Mul(h, root)), one))


rules = pattern.RewriteRuleSet([DivHalfFirstErfGelu.rule(), MulHalfFirstErfGelu.rule()], commute=True)
