"""pack_matmuls: the constant-weight MatMuls that read one activation become one wider MatMul and a Split.

::

    x --MatMul(Wq)--> q                                       q
    x --MatMul(Wk)--> k    ==>   x --MatMul([Wq|Wk|Wv])--Split--> k
    x --MatMul(Wv)--> v                                       v

In a decoder layer that is q/k/v (the normed hidden state) and, in gated MLPs, gate/up. Placed before
``quantize_int4``, each group becomes one MatMulNBits: a decode step is a handful of GEMVs, and every extra
kernel launch costs a few microseconds beside a ~30 us int4 GEMV (onnxruntime-genai's builder emits one
packed q/k/v MatMulNBits per layer for the same reason). Every output column is the same dot product over the
same K as before, so the rewrite is exact; constant bias Adds are packed with their MatMul. The grouping and
rewrite are ``_qkv_packing.pack_qkv`` (shared with ``fuse_transformer``'s ``pack_qkv`` option for encoders);
a group whose end is a graph output is left alone so graph output names never change.
"""

from __future__ import annotations

import onnx_ir as ir

from passes._infra import Pass, PassContext, PassOptions, PassResult
from passes.fusion._qkv_packing import pack_qkv

_ONNX_DOMAINS = ("", "ai.onnx")


class PackMatmulsOptions(PassOptions):
    """The pass has no options; the model exists so unknown keys are refused like for every pass."""


class PackMatmuls(Pass[PackMatmulsOptions]):
    name = "pack_matmuls"
    summary = (
        "Constant-weight MatMuls reading one activation (q/k/v, gate/up) -> one wider MatMul + Split, so "
        "quantize_int4 emits one MatMulNBits per group."
    )
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        before = _matmuls(model)
        groups = pack_qkv(model)
        after = _matmuls(model)
        counts = {"groups_packed": groups, "matmuls_before": before, "matmuls_after": after}
        decision = "applied" if groups else "skipped: no two constant-weight MatMuls read one activation"
        return PassResult(model, modified=groups > 0, counts=counts, notes={"decision": decision})


def _matmuls(model: ir.Model) -> int:
    return sum(1 for n in model.graph if n.op_type == "MatMul" and n.domain in _ONNX_DOMAINS)
