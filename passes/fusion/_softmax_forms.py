"""Softmax forms of attention that onnxscript's SDPA rule (0.7.2) does not read, written in the one it does.

The rule wants ``Softmax(axis=-1)`` of the scores. Two forms of the same function miss it:

* **The last axis by number.** An exporter that writes a custom ``softmax`` symbolic (SEW-D's and older
  DeBERTa's ``XSoftmax``) gives the axis as ``3`` on rank-4 scores; the rule compares the attribute with -1.
  ``softmax_last_axis`` writes -1 where the axis is the input's last by its known rank: the same op.
* **PB-Relax** (CogView; LayoutLMv3's ``cogview_attention``): the scores divided by ``alpha``, their row
  maximum subtracted, multiplied by ``alpha`` again, against overflow in half precision::

      Softmax((s / a - max(s / a)) * a)   ==>   Softmax(s)

  A Softmax is unchanged by a shift constant along its axis, and the shift here is the row maximum (a
  ``ReduceMax`` over the Softmax's axis, kept or unsqueezed); ``(s / a) * a`` is ``s`` up to one rounding,
  exactly ``s`` where ``a`` is a power of two (LayoutLMv3's 32) and the scores are normal numbers. The
  scaling may also be written ``Mul(s, 1 / a)``. Built with onnxscript's exported pattern API
  (``RewriteRuleClassBase``, ``MatchResult.fail``).
"""

from __future__ import annotations

import math

import onnx_ir as ir
from onnxscript.rewriter import pattern

_ONNX = ("", "ai.onnx")
_RECIPROCAL_RTOL = 1e-6  # 1 / a written as a float32 constant


def softmax_last_axis(model: ir.Model) -> int:
    """Every ``Softmax`` of the main graph whose axis is its input's last by number given ``axis=-1``; how
    many."""
    changed = 0
    for node in model.graph:
        if node.op_type != "Softmax" or node.domain not in _ONNX or node.inputs[0] is None:
            continue
        shape = node.inputs[0].shape
        axis = node.attributes.get_int("axis", -1)
        if shape is not None and axis >= 0 and axis == shape.rank() - 1:
            node.attributes["axis"] = ir.AttrInt64("axis", -1)
            changed += 1
    return changed


def _scalar(value: ir.Value) -> float | None:
    tensor = value.const_value
    if tensor is None or tensor.size != 1:
        return None
    return float(tensor.numpy().reshape(-1)[0])


def _axes(node: ir.Node) -> list[int] | None:
    """A ReduceMax's or Unsqueeze's axes, from its attribute (before opset 18/13) or constant input."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        tensor = node.inputs[1].const_value
        return None if tensor is None else [int(a) for a in tensor.numpy().reshape(-1)]
    attribute = node.attributes.get("axes")
    return None if attribute is None else [int(a) for a in attribute.as_ints()]


class _RelaxedSoftmax(pattern.RewriteRuleClassBase):
    reciprocal = False  # the scores scaled by Mul(s, 1 / a) instead of Div(s, a)
    unsqueezed = False  # the row maximum taken without keepdims, then unsqueezed

    def _scaled(self, op, scores, inner):
        return op.Mul(scores, inner) if self.reciprocal else op.Div(scores, inner)

    def pattern(self, op, scores, inner, outer):
        scaled = self._scaled(op, scores, inner)
        row_max = op.ReduceMax(scaled, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["row_max"])
        if self.unsqueezed:
            row_max = op.Unsqueeze(row_max, _allow_other_inputs=True, _allow_other_attributes=True)
        shifted = op.Mul(op.Sub(scaled, row_max), outer)
        return op.Softmax(shifted, _allow_other_attributes=True, _outputs=["probs"])

    def check(self, context, *, scores, inner, outer, row_max, probs, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        a, b = _scalar(inner), _scalar(outer)
        if a is None or b is None or b <= 0 or a == 0:
            return result.fail("the scalings are not positive one-element constants", outer)
        if not math.isclose(a * b if self.reciprocal else a, 1.0 if self.reciprocal else b, rel_tol=_RECIPROCAL_RTOL):
            return result.fail(f"the scores are scaled by {a} and {b}, which do not undo each other", outer)
        shape = scores.shape
        if shape is None:
            return result.fail("the scores' rank is unknown: the maximum's axis cannot be read", scores)
        rank = shape.rank()
        softmax_axis = probs.producer().attributes.get_int("axis", -1) % rank
        reduce = row_max.producer()
        axes = _axes(reduce)
        keep = reduce.attributes.get_int("keepdims", 1)
        if axes is None or [a % rank for a in axes] != [softmax_axis]:
            return result.fail(f"the maximum is taken over axes {axes}, not the Softmax's {softmax_axis}", row_max)
        if keep == int(self.unsqueezed):
            return result.fail("the maximum does not keep the reduced axis for the subtraction", row_max)
        if self.unsqueezed:
            (unsqueeze,) = [use for use, _ in row_max.uses() if use.op_type == "Unsqueeze"]
            restored = _axes(unsqueeze)
            if restored is None or [a % rank for a in restored] != [softmax_axis]:
                return result.fail(f"the maximum is unsqueezed at {restored}, not at {softmax_axis}", row_max)
        return result

    def rewrite(self, op, scores, probs, **_):
        return op.Softmax(scores, axis=probs.producer().attributes.get_int("axis", -1))


class RelaxedSoftmax(_RelaxedSoftmax):
    pass


class RelaxedSoftmaxUnsqueezed(_RelaxedSoftmax):
    unsqueezed = True


class RelaxedSoftmaxReciprocal(_RelaxedSoftmax):
    reciprocal = True


class RelaxedSoftmaxReciprocalUnsqueezed(_RelaxedSoftmax):
    reciprocal = True
    unsqueezed = True


relaxed_rules = pattern.RewriteRuleSet(
    [
        RelaxedSoftmax.rule(),
        RelaxedSoftmaxUnsqueezed.rule(),
        RelaxedSoftmaxReciprocal.rule(),
        RelaxedSoftmaxReciprocalUnsqueezed.rule(),
    ]
)


def apply(model: ir.Model) -> int:
    """Both forms rewritten in ``model``; how many Softmax nodes changed."""
    return relaxed_rules.apply_to_model(model) + softmax_last_axis(model)
