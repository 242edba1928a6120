"""T5's relative position bias and its padding mask added as one ``attention_bias``, the form the SDPA rule reads.

T5 (and every model with a learned bias on the scores) adds two terms to the scaled scores before the Softmax:
the relative position bias ``[1, heads, S, S]`` and the padding mask ``[B, 1, S, S]``. onnxscript's SDPA
rule (0.7.2) takes one ``Add(scores, mask)`` and stops at the second ("None of the alternatives matched"), so
no T5 attention fused. This rule adds the two terms first::

    s = MatMul(q, kT) [* or / scale]                     s = MatMul(q, kT) [* or / scale]
    Softmax(Add(Add(s, bias), mask))             ==>     Softmax(Add(s, Add(bias, mask)))

after which SDPA -> MultiHeadAttention takes ``bias + mask`` as its ``attention_bias`` ``[B, heads, S, S]``.
Exact up to float reassociation (one rounding: ``(s + b) + m`` against ``s + (b + m)``); a fully masked row
holds the same large negative value in every position either way. Built with onnxscript's exported pattern
API (``RewriteRuleClassBase``, ``MatchResult.fail``).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

_ONNX_DOMAINS = ("", "ai.onnx")


def _op(value: ir.Value | None) -> str | None:
    producer = value.producer() if value is not None else None
    return producer.op_type if producer is not None and producer.domain in _ONNX_DOMAINS else None


def _is_scores(value: ir.Value) -> bool:
    """``MatMul(q, kT)``, possibly scaled by a Mul or Div: the attention scores."""
    if _op(value) == "MatMul":
        return True
    if _op(value) in ("Mul", "Div"):
        return any(_op(v) == "MatMul" for v in value.producer().inputs)
    return False


class GroupAttentionBiases(pattern.RewriteRuleClassBase):
    def pattern(self, op, scores, bias, mask):
        return op.Add(op.Add(scores, bias), mask, _outputs=["biased"])

    def check(self, context, scores: ir.Value, bias: ir.Value, mask: ir.Value, biased: ir.Value, **_):
        result = pattern.MatchResult()
        if not _is_scores(scores):
            return result.fail("the first term is not MatMul(q, kT) or its scaled form", scores)
        if _is_scores(bias) or _is_scores(mask):
            return result.fail("a second MatMul product is added: not a bias on the scores", bias)
        uses = biased.uses()
        if not uses or any(u.node.op_type != "Softmax" or u.node.domain not in _ONNX_DOMAINS for u in uses):
            return result.fail("the biased scores do not feed a Softmax only", biased)
        if scores.shape is not None and scores.shape.rank() != 4:
            return result.fail(f"scores of rank {scores.shape.rank()}, expected [B, heads, S, S]", scores)
        for term in (bias, mask):
            if term.shape is not None and term.shape.rank() > 4:
                return result.fail("a bias term of rank > 4 would change the scores' rank", term)
        return result

    def rewrite(self, op, scores, bias, mask, **_):
        return op.Add(scores, op.Add(bias, mask))


rules = pattern.RewriteRuleSet([GroupAttentionBiases.rule()], commute=True)
