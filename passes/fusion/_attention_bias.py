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
import onnx_ir.passes.common as common_passes
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


def _dims_of(value: ir.Value | None) -> list | None:
    return None if value is None or value.shape is None else list(value.shape)


def _same_dim(a: object, b: object) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return isinstance(a, ir.SymbolicDim) and isinstance(b, ir.SymbolicDim) and a.value is not None and a == b


def _shape_entries(value: ir.Value | None) -> list | None:
    """A shape operand's entries: ints where constant, the dim read where a ``Shape`` slice of a value with
    a known shape; None when any entry is neither."""
    if value is None:
        return None
    if value.const_value is not None:
        return [int(x) for x in value.const_value.numpy().reshape(-1)]
    node = value.producer()
    if node is None or node.domain not in _ONNX_DOMAINS:
        return None
    if node.op_type == "Constant":
        attr = node.attributes.get("value") or node.attributes.get("value_ints")
        if attr is None:
            return None
        data = attr.value.numpy().reshape(-1) if hasattr(attr.value, "numpy") else attr.value
        return [int(x) for x in data]
    if node.op_type == "Shape":
        dims = _dims_of(node.inputs[0])
        if dims is None:
            return None
        rank = len(dims)
        return dims[slice(node.attributes.get_int("start", 0), node.attributes.get_int("end", rank))]
    if node.op_type == "Concat":
        entries: list = []
        for part in node.inputs:
            got = _shape_entries(part)
            if got is None:
                return None
            entries += got
        return entries
    return None


def drop_noop_bias_expands(model: ir.Model) -> int:
    """Remove an ``Expand`` of a fused attention's ``attention_bias`` that changes nothing.

    onnxscript's ``sdpa_via_mha`` rule (0.7.2, "TODO: optimize to avoid broadcast if not needed") always
    expands the bias to ``[1, 1, S, 1]`` before ``MultiHeadAttention``, which copies a full ``[B, h, S, T]``
    bias (DeBERTa's relative terms with the mask: several MB per layer) for nothing. Where every target
    entry is 1 or the bias's own dim (the same int or symbol: the query length read with ``Shape``), the
    Expand is the identity and the bias is read directly. Exact. The number removed."""
    removed = 0
    for node in list(model.graph):
        if node.op_type != "Expand" or node.domain not in _ONNX_DOMAINS:
            continue
        out = node.outputs[0]
        readers = [u.node for u in out.uses()]
        if not readers or out.is_graph_output():
            continue
        if any(r.domain != "com.microsoft" or r.op_type not in ("MultiHeadAttention", "Attention") for r in readers):
            continue
        dims, target = _dims_of(node.inputs[0]), _shape_entries(node.inputs[1])
        if dims is None or target is None or len(target) > len(dims):
            continue
        aligned = dims[len(dims) - len(target) :]
        if all(t == 1 or _same_dim(t, d) for t, d in zip(target, aligned, strict=True)):
            ir.convenience.replace_all_uses_with(out, node.inputs[0])
            removed += 1
    if removed:
        common_passes.RemoveUnusedNodesPass()(model)
    return removed
