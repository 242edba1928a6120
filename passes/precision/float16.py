"""float16: convert float32 compute to float16 for GPU targets (ORT ``transformers.float16``, onnxconverter-common).

Re-implements onnxconverter-common's ``convert_float_to_float16`` on onnx-ir (``passes/precision/_float16.py``): every
node with a float16 form computes in float16, float32 weights become float16, and ``Cast`` nodes appear only
where a float32 node (blocked by ``op_block_list`` / ``node_block_list`` or without a float16 rule) meets a
converted one. ``keep_io_types`` (default) keeps the graph's float32 inputs and outputs, so callers and the
verification feed and read the same tensors as before::

    x(f32) --MatMul(W)--Add(b)--Softmax--> y(f32)
    ==>  x(f32) --Cast(f16)--MatMul(W16)--Add(b16)--Softmax--Cast(f32)--> y(f32)

Not exact. Values beyond ±65504 become inf and small ones lose precision (users report that "FP16
produces NaN or garbage"), which the ledger's verification catches; ``mixed_precision`` finds the float32
nodes automatically. **Refuses on target cpu** unless ``force``: ORT's CPU EP has float16 kernels for few
ops and wraps the rest in Casts, so the model is usually slower there (Olive #1514).
"""

from __future__ import annotations

import onnx_ir as ir
from pydantic import Field

from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes.precision import _float16 as f16

CPU_REFUSAL = (
    "target cpu: ONNX Runtime's CPU EP has float16 kernels for few ops and wraps the others in Casts, so "
    "float16 is usually slower on CPU; set force=true to convert anyway (e.g. to build a GPU artifact)"
)


class Float16Options(PassOptions):
    keep_io_types: bool = Field(
        True, description="Keep float32 graph inputs and outputs (Casts at the edges) so callers need no change."
    )
    op_block_list: list[str] = Field(
        default_factory=list, description="Op types that stay float32 (e.g. Exp, Pow, ReduceSum that overflow)."
    )
    node_block_list: list[str] = Field(default_factory=list, description="Node names that stay float32.")
    force: bool = Field(False, description="Convert even when the target is cpu (where float16 is usually slower).")


class Float16(Pass[Float16Options]):
    name = "float16"
    summary = "Convert float32 compute to float16 for GPU targets, keeping float32 I/O and blocked ops."
    exact = False
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        opts = self.options
        if ctx.target == "cpu" and not opts.force:
            return f16.refused(model, CPU_REFUSAL)
        f16.infer_types(model, ctx)
        unknown = sorted(set(opts.node_block_list) - {n.name for n in model.graph})
        if unknown:
            reason = f"node_block_list names nodes the graph does not have: {', '.join(unknown[:5])}"
            return f16.refused(model, reason)
        conv = f16.convert(
            model,
            keep_io_types=opts.keep_io_types,
            op_block_list=opts.op_block_list,
            node_block_list=opts.node_block_list,
        )
        non_matches = [NonMatch(f"stays float32: {why}", label) for label, why in conv.kept.items()]
        counts = {
            "nodes_fp16": len(conv.converted),
            "nodes_fp32": len(conv.kept),
            "casts_added": conv.casts_added,
            "initializers_converted": conv.initializers_converted,
        }
        notes = {"fp32_nodes": conv.kept, "keep_io_types": opts.keep_io_types}
        if not conv.converted:
            non_matches.append(NonMatch("no node has a float16 form that is not blocked"))
        return PassResult(model, bool(conv.converted), counts, non_matches, notes)
