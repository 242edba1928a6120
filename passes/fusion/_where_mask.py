"""A boolean attention mask applied with ``Where`` written as the additive mask onnxscript's SDPA rule reads.

DeBERTa-v2 (``masked_fill``) and other eager implementations do not add ``(1 - mask) * min`` to the scores;
they overwrite the masked positions with the dtype's minimum (or -inf). onnxscript's SDPA rule (0.7.2) takes
``Softmax(Add(scores, mask))`` only, so none of these attentions fused. This rule builds the additive
mask from the same condition and adds it::

    Softmax(Where(masked, fill, s))             Softmax(Add(s, Where(masked, fill, 0)))
    Softmax(Where(keep, s, fill))       ==>     Softmax(Add(s, Where(keep, 0, fill)))

after which SDPA -> MultiHeadAttention takes the computed mask as its ``attention_bias``. The fill must be
-inf or at most -1e30 (``torch.finfo(dtype).min`` in practice): ``s + fill`` then rounds to ``fill``
wherever the scores are below 1e29 in magnitude, which they are by many orders in any model, and the
Softmax gives every masked position an exact 0 (a fully masked row is uniform, or NaN for -inf, in both
forms). ``s`` must come from a ``MatMul`` (possibly scaled), i.e. be attention scores. Built with
onnxscript's exported pattern API (``RewriteRuleClassBase``, ``MatchResult.fail``).

A mask first broadcast to the scores' shape (``mask.expand_as(scores)``: XLM, FlauBERT) reads the scores
twice, through ``Expand(cond, Shape(s))``; the SDPA rule then sees the scores used outside its pattern and
matches nothing. ``Where`` broadcasts its inputs itself, and ``Expand`` broadcasts both ways, so
``Where(Expand(cond, Shape(s)), a, b)`` with ``s`` one of ``a, b`` has the shape and the values of
``Where(cond, a, b)``: the Expand is dropped with the rest of the rewrite::

    Softmax(Where(Expand(masked, Shape(s)), fill, s))   ==>   Softmax(Add(s, Where(masked, fill, 0)))

A mask applied again to the probabilities (``masked_fill(mask, 0)`` after the Softmax: the ``XSoftmax`` of SEW-D
and of DeBERTa before transformers 4.40, hand-written attention that zeroes fully masked rows) is the -inf mask
and the NaN guard the SDPA rule reads (``ZeroedMaskedRows``)::

    Where(masked, 0, Softmax(Where(masked, fill, s)))   ==>   Where(IsNaN(p), 0, p),
                                                              p = Softmax(Where(masked, -inf, s))

Where a row has a valid key, both zero the masked positions (``exp(fill - max)`` underflows to 0) and agree
on the rest; a fully masked row is uniform before the second mask zeroes it, and NaN before the guard
zeroes it: 0 in both. The guard goes after the fused op (``_nan_guard.guard_fused_attention``).

A mask subtracted from the scores (``scores - 10000 * (1 - mask)``, hand-written attention's and XLNet's) is
added negated, bit-exact (``SubtractedMask``)::

    Softmax(Sub(s, m))   ==>   Softmax(Add(s, Neg(m)))

A causal mask applied by multiplying (GPT-1's ``w * b + -1e4 * (1 - b)``, ``b`` the 0/1 lower triangle) is the
additive mask it already holds (``MultipliedMask``)::

    Add(Mul(s, b), Mul(Sub(1, b), fill))   ==>   Add(s, Mul(Sub(1, b), fill))

Where ``b`` is 1 both are ``s``; where it is 0 the product gives ``fill`` and the sum ``s + fill``. With the fill at
most -1e4 (BERT's and GPT-1's) a masked position's ``exp(. - max)`` underflows to an exact 0 either way, unless a
masked score exceeds the row's kept maximum by about 1e4; a causal row always keeps its diagonal. ``b`` must be
proven 0/1: a constant (read through Slice, Reshape, Unsqueeze, Cast and the like) or a Cast from bool.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

_LARGE_NEGATIVE = -1e30
_SCORE_OPS = ("MatMul", "Mul", "Div", "Add")


def _fill(value: ir.Value) -> float | None:
    tensor = value.const_value
    if tensor is None or tensor.size != 1:
        return None
    return float(tensor.numpy().reshape(-1)[0])


def is_masking_fill(number: float, at_most: float = _LARGE_NEGATIVE) -> bool:
    """-inf or at most ``at_most`` (-1e30: a fill whose sum with any attention score rounds to the fill, the
    module's docstring; a multiplied mask reads -1e4, ``MultipliedMask``)."""
    return bool(np.isneginf(number) or number <= at_most)


def _is_scores(value: ir.Value) -> bool:
    """``value`` is attention scores: made by a MatMul, possibly scaled or biased (what every mask form here
    must be applied to)."""
    producer = value.producer()
    return producer is not None and producer.op_type in _SCORE_OPS and producer.domain in ("", "ai.onnx")


class _WhereMask(pattern.RewriteRuleClassBase):
    fill_first: bool  # Where(cond, fill, scores) when True, Where(cond, scores, fill) otherwise
    expanded = False  # the condition is Expand(cond, Shape(scores))

    def _condition(self, op, cond, scores):
        return op.Expand(cond, op.Shape(scores)) if self.expanded else cond

    def check(self, context, scores: ir.Value, fill: ir.Value, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        number = _fill(fill)
        if number is None:
            return result.fail("the masked fill is not a one-element constant", fill)
        if not is_masking_fill(number):
            return result.fail(f"the masked fill {number} is not -inf or a large negative number", fill)
        if not _is_scores(scores):
            return result.fail("the unmasked branch is not attention scores (MatMul, scaled)", scores)
        return result

    def _bias(self, op, cond, fill):
        zero = op.Constant(value=ir.tensor(np.array(0, fill.const_value.dtype.numpy())))
        return op.Where(cond, fill, zero) if self.fill_first else op.Where(cond, zero, fill)


class WhereFillFirst(_WhereMask):
    fill_first = True

    def pattern(self, op, cond, fill, scores):
        where = op.Where(self._condition(op, cond, scores), fill, scores)
        return op.Softmax(where, _allow_other_attributes=True, _outputs=["probs"])

    def rewrite(self, op, cond, fill, scores, probs, **_):
        axis = probs.producer().attributes.get_int("axis", -1)
        return op.Softmax(op.Add(scores, self._bias(op, cond, fill)), axis=axis)


class WhereFillSecond(_WhereMask):
    fill_first = False

    def pattern(self, op, cond, scores, fill):
        where = op.Where(self._condition(op, cond, scores), scores, fill)
        return op.Softmax(where, _allow_other_attributes=True, _outputs=["probs"])

    def rewrite(self, op, cond, scores, fill, probs, **_):
        axis = probs.producer().attributes.get_int("axis", -1)
        return op.Softmax(op.Add(scores, self._bias(op, cond, fill)), axis=axis)


class ExpandedFillFirst(WhereFillFirst):
    expanded = True


class ExpandedFillSecond(WhereFillSecond):
    expanded = True


class SubtractedMask(pattern.RewriteRuleClassBase):
    """``Softmax(Sub(s, m))`` as ``Softmax(Add(s, Neg(m)))``: a mask subtracted from the scores (``scores -
    10000 * (1 - mask)`` in hand-written attention, XLNet's and Funnel's ``- INF * mask``). Bit-exact: IEEE
    subtraction is the addition of the negated operand, and negation is exact. ``s`` must be attention scores
    (a MatMul, possibly scaled or biased), as for the Where forms."""

    def pattern(self, op, scores, mask):
        return op.Softmax(op.Sub(scores, mask), _allow_other_attributes=True, _outputs=["probs"])

    def check(self, context, scores: ir.Value, mask: ir.Value, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if not _is_scores(scores):
            return result.fail("what the mask is subtracted from is not attention scores (MatMul, scaled)", scores)
        return result

    def rewrite(self, op, scores, mask, probs, **_):
        axis = probs.producer().attributes.get_int("axis", -1)
        return op.Softmax(op.Add(scores, op.Neg(mask)), axis=axis)


class _ZeroedMaskedRows(_WhereMask):
    """The masked fill before the Softmax and the zero fill after it, by the same condition, as the -inf
    mask and the NaN guard (the module's docstring)."""

    def _masked(self, op, cond, scores, fill):
        return op.Where(cond, fill, scores) if self.fill_first else op.Where(cond, scores, fill)

    def pattern(self, op, cond, scores, fill, zero):
        probs = op.Softmax(self._masked(op, cond, scores, fill), _allow_other_attributes=True, _outputs=["probs"])
        return op.Where(cond, zero, probs) if self.fill_first else op.Where(cond, probs, zero)

    def check(self, context, scores: ir.Value, fill: ir.Value, zero: ir.Value, **_) -> pattern.MatchResult:
        result = super().check(context, scores=scores, fill=fill)
        if result and _fill(zero) != 0:
            return result.fail("the probabilities' fill is not a one-element zero", zero)
        return result

    def rewrite(self, op, cond, scores, fill, probs, **_):
        dtype = fill.const_value.dtype.numpy()
        neg_inf = op.Constant(value=ir.tensor(np.array(-np.inf, dtype)))
        axis = probs.producer().attributes.get_int("axis", -1)
        guarded = op.Softmax(self._masked(op, cond, scores, neg_inf), axis=axis)
        return op.Where(op.IsNaN(guarded), op.Constant(value=ir.tensor(np.array(0, dtype))), guarded)


class ZeroedMaskedRowsFillFirst(_ZeroedMaskedRows):
    fill_first = True


class ZeroedMaskedRowsFillSecond(_ZeroedMaskedRows):
    fill_first = False


_SELECTIONS = ("Slice", "Reshape", "Unsqueeze", "Squeeze", "Cast", "Expand", "Identity", "Transpose", "Gather")
_MULTIPLIED_FILL = -1e4  # BERT's and GPT-1's additive mask value: the largest fill read as masking here


def _binary(value: ir.Value | None) -> bool:
    """Whether ``value`` holds 0s and 1s only: a Cast from bool, or a constant's elements selected and
    converted (Slice, Reshape, Cast, ...) that are all 0 or 1."""
    for _ in range(8):
        if value is None:
            return False
        if value.const_value is not None:
            array = value.const_value.numpy()
            return bool(array.size) and bool(np.isin(array, (0, 1)).all())
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in _SELECTIONS:
            return False
        if node.op_type == "Cast" and node.inputs[0] is not None and node.inputs[0].dtype == ir.DataType.BOOL:
            return True
        value = node.inputs[0]
    return False


class MultipliedMask(pattern.RewriteRuleClassBase):
    """``Add(Mul(s, b), Mul(Sub(1, b), fill))`` as ``Add(s, Mul(Sub(1, b), fill))`` (the module's docstring)."""

    def pattern(self, op, scores, keep, one, fill):
        return op.Add(op.Mul(scores, keep), op.Mul(op.Sub(one, keep), fill))

    def check(self, context, scores, keep, one, fill, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if _fill(one) != 1:
            return result.fail("the complement is not taken from a one-element 1", one)
        number = _fill(fill)
        if number is None or not is_masking_fill(number, at_most=_MULTIPLIED_FILL):
            return result.fail("the masked positions' value is not a constant at most -1e4", fill)
        if not _is_scores(scores):
            return result.fail("what the mask multiplies is not attention scores (MatMul, scaled)", scores)
        if not _binary(keep):
            return result.fail("the multiplying mask is not proven to hold 0s and 1s only", keep)
        return result

    def rewrite(self, op, scores, keep, one, fill, **_):
        return op.Add(scores, op.Mul(op.Sub(one, keep), fill))


# the expanded forms first: the plain ones would take the Expand as the condition and keep the second read
_masks = pattern.RewriteRuleSet(
    [
        ExpandedFillFirst.rule(),
        ExpandedFillSecond.rule(),
        WhereFillFirst.rule(),
        WhereFillSecond.rule(),
        SubtractedMask.rule(),
    ]
)
_zeroed_rows = pattern.RewriteRuleSet([ZeroedMaskedRowsFillFirst.rule(), ZeroedMaskedRowsFillSecond.rule()])
_multiplied = pattern.RewriteRuleSet([MultipliedMask.rule()], commute=True)  # either operand order of Add and Mul


def apply(model: ir.Model) -> int:
    """Every mask form of this module rewritten in ``model``; how many. The zeroed rows go first, in a sweep of
    their own: a rule set tries its rules node by node, and the Softmax, which the mask rules root at, comes
    before the zeroing Where, which the zeroed-rows rules root at."""
    return _zeroed_rows.apply_to_model(model) + _multiplied.apply_to_model(model) + _masks.apply_to_model(model)
