"""quantize_dynamic: int8 weights, activations quantized at run time (ORT ``quantize_dynamic``).

Wraps ``onnxruntime.quantization.quantize_dynamic`` (QOperator format): each quantized ``MatMul`` with a
constant weight becomes::

    x --> DynamicQuantizeLinear --> MatMulInteger(x_q, W_q, x_zp, W_zp) --> Cast --> Mul(x_scale * W_scale) --> y

which ORT fuses at session level 2 into ``com.microsoft::DynamicQuantizeMatMul`` (``MatMulIntegerToFloat``
with the bias ``Add``). A fused ``com.microsoft::Attention`` (after ``fuse_transformer``) becomes
``QAttention``. Not exact: the pass measures the accuracy of every float output on the context's samples and,
when it misses the budget, keeps the most sensitive nodes in float (see ``passes/precision/_quantization.py``).

Defaults, for x86-64 CPUs: **u8 activations x s8 weights** (``weight_type=QInt8``, ORT's default). The
activations of ``DynamicQuantizeLinear`` are always uint8; s8 weights give the u8s8 kernels that AVX-512
VNNI / AVX-VNNI (``vpdpbusd``) and AMX run natively. On AVX2-only CPUs the u8s8 path (``vpmaddubsw``) can
saturate: set ``reduce_range`` (7-bit weights) there. ``QUInt8`` weights (u8u8) exist for old ARM builds
and are slower on x86. Default op types are ``MatMul`` and ``Attention``: quantizing the embedding
``Gather`` (ORT's default list includes it) saves memory but adds a dequantization and no speed.

Attention: ORT's ``AttentionQuant`` leaves an Attention with ``qkv_hidden_sizes`` in float, and ``QAttention``
has no ``attention_bias`` input, so the Attention that onnxscript's fusion emits for transformers-5 exports
(both) cannot be quantized; such nodes get a NonMatch saying so. Their packed QKV projection would stay float
(a quarter of the encoder's linear FLOPs), so the ``int8`` preset runs ``fuse_transformer`` with
``attention="mha", pack_qkv=True`` first: MultiHeadAttention keeps the attention core fused and the Q|K|V
projection is one constant-weight MatMul, which this pass turns into one ``DynamicQuantizeMatMul`` (one
activation quantization, one GEMM of width 3·hidden instead of three).

Refuses (no change, with a reason) when ``nodes_to_exclude`` names a node the graph does not have, when no
node can be quantized, and when the accuracy budget is missed even with ``max_exclusions`` nodes in float.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import onnx
import onnx_ir as ir
from pydantic import Field

from passes._infra import NonMatch, Pass, PassContext, PassResult
from passes.precision import _quantization as q
from passes.precision import _weight_matmuls as weight_matmuls

DynamicOpType = Literal["MatMul", "Attention", "Conv", "Gather", "LSTM", "EmbedLayerNormalization"]
# Which input must be a constant for ORT to quantize the node (its weight).
_WEIGHT_INPUT = {"MatMul": 1, "Attention": 1, "Conv": 1, "Gather": 0, "LSTM": 1, "EmbedLayerNormalization": 2}


class QuantizeDynamicOptions(q.QuantizationOptions):
    op_types: list[DynamicOpType] = Field(
        default_factory=lambda: ["MatMul", "Attention"],
        min_length=1,
        description="Op types to quantize. MatMul (constant weight only) and com.microsoft Attention (after "
        "fuse_transformer) carry the compute of a transformer; Gather quantizes embedding tables (smaller, "
        "not faster).",
    )
    weight_type: Literal["QInt8", "QUInt8"] = Field(
        "QInt8",
        description="Weight element type. QInt8 (u8 activations x s8 weights) is the fast path on x86-64 "
        "with VNNI/AMX and ORT's default; QUInt8 (u8 x u8) is slower on x86.",
    )


class QuantizeDynamic(Pass[QuantizeDynamicOptions]):
    name = "quantize_dynamic"
    summary = "int8 weights with run-time activation quantization (MatMulInteger), accuracy-checked per output."
    exact = False
    in_place = False

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        options = q.with_job_tolerance(self.options, ctx.tolerance)
        unknown = q.unknown_node_names(model, options.nodes_to_exclude)
        if unknown:
            return q.refused(model, unknown)
        unfused = 0
        if "MatMul" in options.op_types and weight_matmuls.sites(model, ("FusedMatMul",)):
            model = ir.serde.deserialize_model(ir.serde.serialize_model(model))  # functional: input untouched
            unfused = weight_matmuls.unfuse(model, ("FusedMatMul",)).get("FusedMatMul", 0)
        candidates, non_matches = _candidates(model, options)
        notes: dict[str, Any] = {
            "weight_type": options.weight_type,
            "activation_type": "QUInt8 (DynamicQuantizeLinear)",
            "per_channel": options.per_channel,
            "reduce_range": options.reduce_range,
            "op_types": list(options.op_types),
            "candidates": len(candidates),
            "fused_matmuls_unfused": unfused,
        }
        if not candidates:
            reason = f"no node of op types {', '.join(options.op_types)} with a constant weight to quantize"
            non_matches.append(NonMatch(reason))
            notes["decision"] = "skipped: nothing to quantize"
            return PassResult(q.unchanged(model), False, {"nodes_quantized": 0}, non_matches, notes)

        def quantize(src: Path, dst: Path, exclude: list[str], large: bool) -> None:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantize_dynamic(
                src,
                dst,
                op_types_to_quantize=list(options.op_types),
                per_channel=options.per_channel,
                reduce_range=options.reduce_range,
                weight_type=QuantType[options.weight_type],
                nodes_to_exclude=exclude,
                use_external_data_format=large,
                extra_options={"MatMulConstBOnly": True},
            )

        out = q.drive(
            model,
            ctx.samples,
            options,
            candidates=candidates,
            quantize=quantize,
            quantized_nodes=replaced_nodes,
            notes=notes,
        )
        non_matches += out.non_matches
        if out.model is None:
            return PassResult(q.unchanged(model), False, out.counts, non_matches, out.notes)
        return PassResult(out.model, True, out.counts, non_matches, out.notes)


def _candidates(model: ir.Model, options: QuantizeDynamicOptions) -> tuple[list[str], list[NonMatch]]:
    excluded = set(options.nodes_to_exclude)
    found, non_matches = [], []
    for node in model.graph:
        if node.op_type not in options.op_types:
            continue
        expected_domain = (
            ("com.microsoft",) if node.op_type in ("Attention", "EmbedLayerNormalization") else ("", "ai.onnx")
        )
        if node.domain not in expected_domain or not node.name or node.name in excluded:
            continue
        index = _WEIGHT_INPUT[node.op_type]
        weight = node.inputs[index] if len(node.inputs) > index else None
        if weight is None or weight.const_value is None:
            non_matches.append(
                NonMatch("weight input is not a constant: ORT quantizes only constant weights", node.name, node.op_type)
            )
            continue
        if node.op_type == "Attention" and (
            "qkv_hidden_sizes" in node.attributes or any(v is not None for v in node.inputs[5:])
        ):
            # ORT's AttentionQuant falls back to float for qkv_hidden_sizes, and QAttention has no
            # attention_bias/past inputs: say so instead of counting the node as quantizable.
            non_matches.append(
                NonMatch(
                    "Attention with qkv_hidden_sizes or inputs past mask_index (attention_bias, past) has no "
                    "QAttention form in ORT: left float. fuse_transformer with attention='mha' (the int8 preset) "
                    "keeps the Q/K/V MatMuls outside the attention op, so they are quantized",
                    node.name,
                    node.op_type,
                )
            )
            continue
        found.append(node.name)
    return found, non_matches


def replaced_nodes(original: onnx.ModelProto, quantized: onnx.ModelProto, candidates: Sequence[str]) -> list[str]:
    """Candidates ORT replaced by a quantized form (it removes the float node and adds ``<name>_quant``)."""
    remaining = {n.name for n in quantized.graph.node}
    return [name for name in candidates if name not in remaining]
