"""Softmax and score forms of attention that onnxscript's SDPA rule (0.7.2) does not read, written in the one it
does.

The rule wants ``Softmax(axis=-1)`` of the scaled scores plus a bias. Four forms of the same function miss it:

* **The last axis by number.** An exporter that writes a custom ``softmax`` symbolic (SEW-D's and older
  DeBERTa's ``XSoftmax``) gives the axis as ``3`` on rank-4 scores; the rule compares the attribute with -1.
  ``softmax_last_axis`` writes -1 where the axis is the input's last by its known rank: the same op.
* **PB-Relax** (CogView; LayoutLMv3's ``cogview_attention``): the scores divided by ``alpha``, their row
  maximum subtracted, multiplied by ``alpha`` again, against overflow in half precision::

      Softmax((s / a - max(s / a)) * a)   ==>   Softmax(s)

  A Softmax is unchanged by a shift constant along its axis, and the shift here is the row maximum (a
  ``ReduceMax`` over the Softmax's axis, kept or unsqueezed); ``(s / a) * a`` is ``s`` up to one rounding,
  exactly ``s`` where ``a`` is a power of two (LayoutLMv3's 32) and the scores are normal numbers. The
  scaling may also be written ``Mul(s, 1 / a)``.
* **The scale over a biased product** (BROS: ``(q @ k^T + q . bbox) / sqrt(d) + mask``; XLNet-like relative
  terms): the rule reads a scaled product with additive terms after the scale, so the scale is distributed::

      Div(Add(MatMul(q, kT), b), c)   ==>   Add(Div(MatMul(q, kT), c), Div(b, c))      (Mul by c alike)

  within one rounding of each term; only where the sum goes to a Softmax (directly or through one more
  ``Add``, the mask), so that only attention scores are touched.
* **Decomposed relative positions** (ViTDet, SAM's image encoder: ``add_decomposed_relative_positions``): the
  folded scores viewed as [B*H, qh, qw, kh, kw], a height term [.., kh, 1] and a width term [.., 1, kw] added,
  then viewed back. The two terms are one bias of the scores' own shape (``decomposed_rel_pos``, run before the
  folded heads are unfolded)::

      Reshape(Add(Add(Reshape(s, 5-D), Unsqueeze(h, -1)), Unsqueeze(w, -2)), 3-D)
          ==>   Add(s, Reshape(Add(Unsqueeze(h, -1), Unsqueeze(w, -2)), 3-D))

  the sum regrouped: within one rounding.

Built with onnxscript's exported pattern API (``RewriteRuleClassBase``, ``MatchResult.fail``).
"""

from __future__ import annotations

import math

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.rewriter import pattern

from passes.fusion._rotary_eval import axes_of
from passes.fusion._rotary_eval import scalar as _scalar
from passes.fusion._rotary_interleaved import _producer

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
        axes = axes_of(reduce)
        keep = reduce.attributes.get_int("keepdims", 1)
        if axes is None or [a % rank for a in axes] != [softmax_axis]:
            return result.fail(f"the maximum is taken over axes {axes}, not the Softmax's {softmax_axis}", row_max)
        if keep == int(self.unsqueezed):
            return result.fail("the maximum does not keep the reduced axis for the subtraction", row_max)
        if self.unsqueezed:
            (unsqueeze,) = [use for use, _ in row_max.uses() if use.op_type == "Unsqueeze"]
            restored = axes_of(unsqueeze)
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


class _ScaleOverBias(pattern.RewriteRuleClassBase):
    op_type: str  # Div or Mul
    product_first: bool  # Add(MatMul, bias) when True, Add(bias, MatMul) otherwise

    def pattern(self, op, product, bias, scale):
        total = op.Add(product, bias) if self.product_first else op.Add(bias, product)
        return op.Div(total, scale) if self.op_type == "Div" else op.Mul(total, scale)

    def check(self, context, *, product, scale, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        c = _scalar(scale)
        if c is None or not math.isfinite(c) or c <= 0:
            return result.fail("the scale is not one positive finite constant", scale)
        maker = product.producer()
        if maker is None or maker.op_type != "MatMul" or maker.domain not in _ONNX:
            return result.fail("the scaled sum holds no MatMul product", product)
        readers = [use for use, _ in context.root.outputs[0].uses()]
        if len(readers) == 1 and readers[0].op_type == "Add":  # the mask
            readers = [use for use, _ in readers[0].outputs[0].uses()]
        if not readers or any(r.op_type != "Softmax" or r.domain not in _ONNX for r in readers):
            return result.fail("the scaled sum does not go to a Softmax: not attention scores", scale)
        return result

    def rewrite(self, op, product, bias, scale, **_):
        if self.op_type == "Div":
            return op.Add(op.Div(product, scale), op.Div(bias, scale))
        return op.Add(op.Mul(product, scale), op.Mul(bias, scale))


class DivOverBias(_ScaleOverBias):
    op_type, product_first = "Div", True


class DivOverBiasFirst(_ScaleOverBias):
    op_type, product_first = "Div", False


class MulOverBias(_ScaleOverBias):
    op_type, product_first = "Mul", True


class MulOverBiasFirst(_ScaleOverBias):
    op_type, product_first = "Mul", False


relaxed_rules = pattern.RewriteRuleSet(
    [
        RelaxedSoftmax.rule(),
        RelaxedSoftmaxUnsqueezed.rule(),
        RelaxedSoftmaxReciprocal.rule(),
        RelaxedSoftmaxReciprocalUnsqueezed.rule(),
    ]
)


scale_rules = pattern.RewriteRuleSet(
    [DivOverBias.rule(), DivOverBiasFirst.rule(), MulOverBias.rule(), MulOverBiasFirst.rule()]
)


def _unsqueezed_at(value: ir.Value | None, axis: int) -> bool:
    node = _producer(value, "Unsqueeze")
    axes = axes_of(node) if node is not None else None
    return axes is not None and len(axes) == 1 and axes[0] in (axis, 5 + axis)


def _rel_pos_terms(outer: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """(scores, height term, width term) of ``Reshape(Add(Add(Reshape(scores, 5-D), h), w), 3-D)`` read by
    Softmax nodes only, the terms in either order and either side of each Add."""
    readers = [u.node for u in outer.outputs[0].uses()]
    if not readers or any(r.op_type != "Softmax" or r.domain not in _ONNX for r in readers):
        return None
    second = _producer(outer.inputs[0], "Add")
    for inner_index in (0, 1):
        first = _producer(second.inputs[inner_index], "Add") if second is not None else None
        if first is None:
            continue
        other = second.inputs[1 - inner_index]
        for view_index in (0, 1):
            view = _producer(first.inputs[view_index], "Reshape")
            term = first.inputs[1 - view_index]
            scores = view.inputs[0] if view is not None else None
            if scores is None or scores.shape is None or scores.shape.rank() != 3:
                continue
            for height, width in ((term, other), (other, term)):
                if _unsqueezed_at(height, -1) and _unsqueezed_at(width, -2):
                    return scores, height, width  # type: ignore[return-value]
    return None


def decomposed_rel_pos(model: ir.Model) -> int:
    """ViTDet's and SAM's relative-position terms as one bias of the folded scores (the form above); how many
    rewrites. Written by hand, not as a rule: the bias takes the scores' shape, which the folded-heads unfold
    (``_batched_heads``) reads next."""
    done = 0
    for outer in list(model.graph):
        if outer.op_type != "Reshape" or outer.domain not in _ONNX or outer.outputs[0].is_graph_output():
            continue
        found = _rel_pos_terms(outer)
        if found is None:
            continue
        scores, height, width = found
        prefix = outer.name or f"rel_pos_{done}"
        both = ir.node("Add", [height, width], name=f"{prefix}/rel_pos")
        bias = ir.node("Reshape", [both.outputs[0], outer.inputs[1]], dict(outer.attributes), name=f"{prefix}/bias")
        total = ir.node("Add", [scores, bias.outputs[0]], name=f"{prefix}/scores")
        for node in (bias, total):
            node.outputs[0].shape, node.outputs[0].dtype = scores.shape, scores.dtype
        model.graph.insert_before(outer, [both, bias, total])
        ir.convenience.replace_all_uses_with(outer.outputs[0], total.outputs[0])
        done += 1
    if done:
        common_passes.RemoveUnusedNodesPass()(model)
    return done


def apply(model: ir.Model) -> int:
    """Every form rewritten in ``model``; how many rewrites."""
    return relaxed_rules.apply_to_model(model) + softmax_last_axis(model) + scale_rules.apply_to_model(model)
