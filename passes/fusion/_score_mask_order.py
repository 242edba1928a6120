"""Attention scores masked in another order than ``Softmax(scale * (q @ k^T) + mask)``, rewritten to it.

Two eager attentions that decoders still ship order the scale and the masks otherwise, and neither
``fuse_gqa``'s match nor onnxscript's SDPA rule read them (held-out probe round 2, every exporter):

* the mask added before the scale (CodeGen: ``(q @ k^T + mask) / sqrt(d)``)::

      Softmax(Div(Add(s, mask), c))   ==>   Softmax(Add(Div(s, c), Div(mask, c)))      (Mul by c alike)

  ``(s + m) / c`` and ``s / c + m / c`` agree within one rounding; a masked position stays at most
  ``finfo.min / c``, still masked to an exact 0 by the Softmax.
* a causal ``Where`` on the raw scores, then an additive padding mask (GPT-Neo: ``where(causal, s, min) +
  mask``, no scale at all)::

      Add(Where(keep, s, fill), mask)   ==>   Add(s, Add(Where(keep, 0, fill), mask))   (fill-first alike)

  exact: where ``keep`` holds both are ``s + mask``; elsewhere ``fill + mask`` against ``s + (fill + mask)``,
  and with ``fill`` -inf or at most -1e30 (``finfo.min``) adding scores below 1e29 in magnitude leaves
  ``fill + mask`` as it is (-inf where it overflowed, in both forms).

* the masked scores clamped from below (XGLM: ``max(s + mask, finfo.min)``, between the mask and the Softmax)::

      Max(Add(s, mask), c)   ==>   Add(s, Max(mask, c))          (c a float32/64 constant at most -1e30)

  exact for scores below 1e22 in magnitude: where ``mask >= c``, ``s + mask`` is either above ``c`` in both
  forms or rounds to ``c`` plus nothing in both (the spacing of floats near -1e30 is 7e22); where the mask
  went to -inf (two ``finfo.min`` summed), ``max(-inf, c)`` is ``c`` and so is ``s + c``.

The scores must come from a ``MatMul`` (scaled or not; through the Reshape that unfolds heads folded into the
batch, for the clamp), so only attention is touched. The single additive
mask the rewrites leave is what ``_gqa_probe`` measures and what ``MultiHeadAttention`` takes as its bias.
Built with onnxscript's exported pattern API (``RewriteRuleClassBase``, ``MatchResult.fail``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes.fusion._where_mask import is_masking_fill

_ONNX = ("", "ai.onnx")


def _scalar(value: ir.Value | None) -> float | None:
    tensor = value.const_value if value is not None else None
    if tensor is None or tensor.size != 1 or not np.issubdtype(tensor.dtype.numpy(), np.floating):
        return None
    return float(tensor.numpy().reshape(-1)[0])


def _scores(value: ir.Value, result: pattern.MatchResult, *ops: str) -> bool:
    node = value.producer()
    if node is None or node.domain not in _ONNX or node.op_type not in ops:
        result.fail(f"the scores are not computed by {'/'.join(ops)}", value)
        return False
    return True


class _MaskThenScale(pattern.RewriteRuleClassBase):
    op_type: str  # Div or Mul

    def pattern(self, op, scores, mask, scale):
        masked = op.Add(scores, mask)
        scaled = op.Div(masked, scale) if self.op_type == "Div" else op.Mul(masked, scale)
        return op.Softmax(scaled, _allow_other_attributes=True, _outputs=["probs"])

    def check(self, context, scores: ir.Value, scale: ir.Value, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        c = _scalar(scale)
        if c is None or not np.isfinite(c) or c <= 0.0:
            return result.fail("the scale is not one positive constant", scale)
        _scores(scores, result, "MatMul")
        return result

    def rewrite(self, op, scores, mask, scale, probs, **_):
        axis = probs.producer().attributes.get_int("axis", -1)
        if self.op_type == "Div":
            return op.Softmax(op.Add(op.Div(scores, scale), op.Div(mask, scale)), axis=axis)
        return op.Softmax(op.Add(op.Mul(scores, scale), op.Mul(mask, scale)), axis=axis)


class DivAfterMask(_MaskThenScale):
    op_type = "Div"


class MulAfterMask(_MaskThenScale):
    op_type = "Mul"


class _WhereThenAdd(pattern.RewriteRuleClassBase):
    fill_first: bool  # Where(cond, fill, scores) when True, Where(cond, scores, fill) otherwise

    def pattern(self, op, cond, scores, fill, mask):
        where = op.Where(cond, fill, scores) if self.fill_first else op.Where(cond, scores, fill)
        return op.Softmax(op.Add(where, mask), _allow_other_attributes=True, _outputs=["probs"])

    def check(self, context, scores: ir.Value, fill: ir.Value, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        number = _scalar(fill)
        if number is None:
            return result.fail("the masked fill is not a one-element constant", fill)
        if not is_masking_fill(number):
            return result.fail(f"the masked fill {number} is not -inf or a large negative number", fill)
        _scores(scores, result, "MatMul", "Mul", "Div")
        return result

    def rewrite(self, op, cond, scores, fill, mask, probs, **_):  # noqa: PLR0917 (onnxscript binds by name)
        axis = probs.producer().attributes.get_int("axis", -1)
        zero = op.Constant(value=ir.tensor(np.array(0, fill.const_value.dtype.numpy())))
        causal = op.Where(cond, fill, zero) if self.fill_first else op.Where(cond, zero, fill)
        return op.Softmax(op.Add(scores, op.Add(causal, mask)), axis=axis)


class WhereFillFirstThenAdd(_WhereThenAdd):
    fill_first = True


class WhereFillSecondThenAdd(_WhereThenAdd):
    fill_first = False


class ClampAfterMask(pattern.RewriteRuleClassBase):
    def pattern(self, op, scores, mask, floor):
        return op.Max(op.Add(scores, mask), floor)

    def check(self, context, scores: ir.Value, floor: ir.Value, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        number = _scalar(floor)
        if number is None or floor.const_value.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
            return result.fail("the clamp is not a one-element float32/64 constant", floor)
        if not is_masking_fill(number):  # -inf or at most -1e30, as the clamp's floor
            return result.fail(f"the clamp {number} is not a large negative number", floor)
        _scores(scores, result, "MatMul", "Mul", "Div", "Reshape")
        if result and scores.producer().op_type == "Reshape":
            _scores(scores.producer().inputs[0], result, "MatMul", "Mul", "Div")
        return result

    def rewrite(self, op, scores, mask, floor, **_):
        return op.Add(scores, op.Max(mask, floor))


rules = pattern.RewriteRuleSet(
    [
        DivAfterMask.rule(),
        MulAfterMask.rule(),
        WhereFillFirstThenAdd.rule(),
        WhereFillSecondThenAdd.rule(),
        ClampAfterMask.rule(),
    ]
)
