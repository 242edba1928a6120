"""mixed_precision: float16 with the fewest float32 nodes that keep the outputs within tolerance.

What onnxconverter-common's ``auto_convert_mixed_precision`` and Olive's ``OnnxFloatToFloat16`` leave to
trial and error, found automatically and reported (users report that "FP16 produces NaN or garbage, with
no explanation"):

1. convert everything with a float16 form (``passes/precision/_float16.py``); on the context's samples, compare
   the outputs with the float32 model (ORT, graph optimizations off): within ``atol``/``rtol``/
   ``min_cosine`` -> done, no node kept in float32;
2. else run the float32 model once with every intermediate exposed and rank the convertible nodes by the
   largest |value| they read or write, relative to float16's 65504: the nodes that overflow come first and
   are always kept in float32 (each named in the report with its range);
3. bisect the smallest prefix of that ranking to keep in float32 such that the outputs are within
   tolerance: log2(nodes) conversions and runs, not one per node.

::

    x --MatMul--Add--Exp(overflows)--Mul(1e-3)--> y
    ==>  x --Cast16--MatMul16--Add16--Cast32--Exp--Mul--> y      (Exp and its reader stay float32)

Refuses on target cpu unless ``force`` (see ``float16``), and when even the best split misses tolerance.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from pydantic import Field

from passes._infra import NonMatch, Pass, PassContext, PassResult
from passes.precision import _float16 as f16
from passes.precision.float16 import CPU_REFUSAL, Float16Options


class MixedPrecisionOptions(Float16Options):
    atol: float = Field(1e-2, ge=0, description="Absolute tolerance of the outputs against float32.")
    rtol: float = Field(1e-2, ge=0, description="Relative tolerance of the outputs against float32.")
    min_cosine: float = Field(0.999, ge=-1, le=1, description="Least cosine similarity of each output.")
    max_samples: int = Field(3, ge=1, description="Sample input sets used to measure the outputs.")


def _copy(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


class MixedPrecision(Pass[MixedPrecisionOptions]):
    name = "mixed_precision"
    summary = "float16 keeping the fewest nodes in float32 that meet tolerance, found by ranked bisection."
    exact = False
    in_place = False

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        opts = self.options
        if ctx.target == "cpu" and not opts.force:
            return f16.refused(_copy(model), CPU_REFUSAL)
        typed = _copy(model)
        f16.infer_types(typed, ctx)
        feeds = f16.sample_feeds(typed, ctx.samples, opts.max_samples)
        reference = f16.run(ir.serde.serialize_model(typed), feeds, ctx.target)
        trials: list[dict[str, Any]] = []

        def attempt(block: list[str]) -> tuple[ir.Model, f16.Conversion, f16.Accuracy]:
            candidate = _copy(typed)
            conv = f16.convert(
                candidate,
                keep_io_types=opts.keep_io_types,
                op_block_list=opts.op_block_list,
                node_block_list=[*opts.node_block_list, *block],
            )
            got = f16.run(ir.serde.serialize_model(candidate), feeds, ctx.target)
            acc = f16.accuracy(reference, got, opts.atol, opts.rtol, opts.min_cosine)
            trials.append({"fp32_nodes": len(block), "ok": acc.ok, "max_abs": acc.max_abs, "reason": acc.reason})
            return candidate, conv, acc

        # Rank the nodes by the largest |value| they read or write in float32. Those beyond float16's range
        # stay float32 from the start: on a GPU they give inf (ORT's CPU EP hides it by computing them in
        # float32 behind Casts, so the ranges decide, not the CPU run).
        ranges = f16.fp32_activation_ranges(typed, feeds, ctx.target)

        def peak(node: ir.Node) -> float:
            values = (v for v in (*node.inputs, *node.outputs) if v is not None and v.dtype == f16.FLOAT)
            return max((ranges.get(v.name or "", 0.0) for v in values), default=0.0)

        blocked = set(opts.node_block_list)
        ranked = sorted(
            (
                (label, peak(node))
                for label, node in f16.float_nodes(typed)
                if f16.convertible_op(node) and label not in blocked and node.op_type not in opts.op_block_list
            ),
            key=lambda item: -item[1],
        )
        labels = [label for label, _ in ranked]
        overflow = [label for label, high in ranked if high > f16.FP16_MAX]
        reasons = {
            label: f"overflows float16: max |x| {high:.4g} > 65504"
            if label in overflow
            else f"kept for accuracy (max |x| {high:.4g})"
            for label, high in ranked
        }
        lo, hi = len(overflow), len(labels)
        best = attempt(labels[:lo])
        if best[2].ok:
            hi = lo
        else:
            # Bisect the prefix of the ranking kept in float32. Invariant: prefix lo fails, prefix hi passes
            # (all nodes in float32 is the original model).
            while hi - lo > 1:
                mid = (lo + hi) // 2
                trial = attempt(labels[:mid])
                if trial[2].ok:
                    hi, best = mid, trial
                else:
                    lo = mid
            if not best[2].ok:
                best = attempt(labels[:hi])
        block = labels[:hi]
        candidate, conv, acc = best
        notes: dict[str, Any] = {
            "fp32_nodes": {label: reasons.get(label, why) for label, why in conv.kept.items()},
            "fp32_for_accuracy": block,
            "max_abs": acc.max_abs,
            "min_cosine": acc.min_cosine,
            "overflow_nodes": overflow,
            "trials": trials,
        }
        counts = {
            "nodes_fp16": len(conv.converted),
            "nodes_fp32": len(conv.kept),
            "nodes_fp32_for_accuracy": len(block),
            "casts_added": conv.casts_added,
            "conversions_tried": len(trials),
        }
        if not acc.ok or not conv.converted:
            why = acc.reason or "no node has a float16 form that is not blocked"
            notes["decision"] = "refused"
            return PassResult(
                _copy(model), False, counts, [NonMatch(f"no float16 split meets tolerance: {why}")], notes
            )
        non_matches = [NonMatch(f"stays float32: {notes['fp32_nodes'][label]}", label) for label in notes["fp32_nodes"]]
        return PassResult(candidate, True, counts, non_matches, notes)
