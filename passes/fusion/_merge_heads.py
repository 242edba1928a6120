"""Attention's merge-heads Reshape kept rank 3, so that onnxscript's MHA rule cannot swallow a flattening.

onnxscript's ``MultiHeadAttention`` rule (0.7.2) matches ``Reshape(Transpose(SDPA(q, k, v), [0, 2, 1, 3]),
ANY)`` and replaces the whole chain with ``MultiHeadAttention``, whose output is ``[B, S, h*d]``, without
reading the Reshape's target shape ("TODO: verify Reshapes"). When the merge of the heads and a flattening
that follows it are one Reshape, the flattening is lost and the next op reads a tensor of the wrong rank.
``padding_elimination`` makes exactly that graph (its ``FlattenAndUnpad`` reshapes the attention output to
``[B*S, H]`` before gathering the valid tokens, and onnxscript's optimizer folds the two Reshapes into one),
so ``fast`` broke every attention fusion on the models it unpads. This rule splits the Reshape back::

    a[B,h,S,d] --Transpose(0,2,1,3)--Reshape(shape)-->            (shape not of rank 3)
    ==>  a --Transpose(0,2,1,3)--Reshape([0, 0, -1])--> [B,S,h*d] --Reshape(shape)-->

Exact: a Reshape keeps the element order, so reshaping through ``[B, S, h*d]`` first gives the same
tensor, provided the outer shape's 0 entries (copy the input's dim) sit where both inputs agree: axes 0 and
1. The MHA rule then absorbs the rank-3 merge and the flattening stays in the graph. Built with onnxscript's
exported pattern API (``RewriteRuleClassBase``, ``MatchResult.fail``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern


class SplitFlatteningMergeHeads(pattern.RewriteRuleClassBase):
    def pattern(self, op, attention, shape):
        return op.Reshape(op.Transpose(attention, perm=[0, 2, 1, 3]), shape, _outputs=["merged"])

    def check(self, context, attention: ir.Value, shape: ir.Value, merged: ir.Value, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if attention.shape is None or attention.shape.rank() != 4:
            return result.fail("the transposed value is not known to be rank 4 [B, heads, S, head_dim]", attention)
        if shape.const_value is None:
            return result.fail("the target shape is computed at run time", shape)
        target = shape.const_value.numpy().reshape(-1)
        if target.size == 3:
            return result.fail("already the rank-3 merge the MHA rule expects", merged)
        if any(v == 0 for v in target[2:]):
            return result.fail(f"target {target.tolist()} copies a dim beyond axis 1 (0 entry)", shape)
        reshape = merged.producer()
        if reshape is not None and reshape.attributes.get_int("allowzero", 0):
            return result.fail("allowzero Reshape: a 0 entry means an empty dim", merged)
        return result

    def rewrite(self, op, attention, shape, **_):
        merge = op.Constant(value=ir.tensor(np.array([0, 0, -1], np.int64)))
        heads_merged = op.Reshape(op.Transpose(attention, perm=[0, 2, 1, 3]), merge)
        return op.Reshape(heads_merged, shape)


rules = pattern.RewriteRuleSet([SplitFlatteningMergeHeads.rule()])
