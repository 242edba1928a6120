"""A projection bias written first, ``Add(bias, MatMul(x, W))``, turned to ``Add(MatMul(x, W), bias)`` (issue 17).

The TorchScript exporter writes every ``nn.Linear`` with its bias as the first operand of the Add; the dynamo
exporter writes it second. onnxscript's ``mha_bias`` rule (0.7.2) reads only the second order, so on
TorchScript exports the Q/K/V biases stayed outside MultiHeadAttention, its ``attention`` rule then had no
biased projections to pack into ``com.microsoft::Attention``, and ``pack_qkv`` left a packed MatMul, its bias
Add and a Split in front of every MultiHeadAttention. On TorchScript-eager BERT, RoBERTa, DistilBERT, ALBERT and
CLIP's text tower at 8 x 256 that was 2-10% slower than the upload under ORT's default level, where the dynamo
export of the same model, fused into ``Attention``, ran 1.4-1.5x faster (bench/README.md, quiet host section).

Float addition is commutative, so the swap is exact. Only the Adds that feed a MultiHeadAttention's query, key or
value directly are turned, and only where the other operand is a MatMul output and the bias a 1-D constant as
wide as the MatMul's last dimension: a projection bias, nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx_ir as ir

from passes._match import is_constant
from passes.fusion._batched_heads import same_dim

_ONNX = ("", "ai.onnx")


def _bias_first(add: ir.Node) -> bool:
    """True when ``add`` is ``Add(bias, MatMul(..))`` with ``bias`` a 1-D constant as wide as the product."""
    if add.op_type != "Add" or add.domain not in _ONNX or len(add.inputs) != 2:
        return False
    bias, product = add.inputs
    if bias is None or product is None or not is_constant(bias) or is_constant(product):
        return False
    matmul = product.producer()
    if matmul is None or matmul.op_type != "MatMul" or matmul.domain not in _ONNX:
        return False
    if bias.shape is None or product.shape is None or len(bias.shape) != 1 or len(product.shape) == 0:
        return False
    return same_dim(bias.shape[0], product.shape[-1])


def put_projection_biases_last(model: ir.Model) -> int:
    """Swap the operands of every projection-bias Add feeding a MultiHeadAttention's Q, K or V; how many."""
    turned = 0
    for node in model.graph:
        if node.op_type != "MultiHeadAttention" or node.domain != "com.microsoft":
            continue
        for value in list(node.inputs)[:3]:
            add = value.producer() if value is not None else None
            if add is None or not _bias_first(add):
                continue
            bias, product = add.inputs
            add.replace_input_with(0, product)
            add.replace_input_with(1, bias)
            turned += 1
    return turned


def not_projection_biases(bindings: Mapping[str, object]) -> str | None:
    """Why a match of onnxscript's FuseBiasMHA (its ``q_bias``, ``k_bias``, ``v_bias`` bindings) is not three
    projection biases, None when every bias present is 1-D: a term of higher rank added to a projection
    (conditional DETR's ``k_content + k_pos``) cannot join MultiHeadAttention's 1-D ``bias``."""
    for name in ("q_bias", "k_bias", "v_bias"):
        bias = bindings.get(name)
        if not isinstance(bias, ir.Value):
            continue
        if bias.shape is None or len(bias.shape) != 1:
            rank = "unknown rank" if bias.shape is None else f"rank {len(bias.shape)}"
            return f"{name} {bias.name!r} has {rank}: a term added to the projection, not a 1-D bias"
    return None


def standing_attention(model: ir.Model) -> bool:
    """True when the graph holds MultiHeadAttention and none with a cache (past key/value inputs or presents).

    Those came from an earlier pass (fuse_gqa's exact fallback), not from onnxscript's rules, which alone would
    pack them; decoders with a cache keep the layout fuse_gqa chose for them."""
    found = False
    for node in model.graph:
        if node.op_type != "MultiHeadAttention" or node.domain != "com.microsoft":
            continue
        if any(v is not None for v in list(node.inputs)[6:]) or len(node.outputs) > 1:
            return False
        found = True
    return found
