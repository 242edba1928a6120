"""ORT's ``FusedMatMul`` read back as the ``MatMul`` and scale it was, so attention can fuse around it.

A model saved by an ONNX Runtime session (``SessionOptions.optimized_model_filepath`` at ORT_ENABLE_EXTENDED,
a common "already optimized" upload) has each attention's scaled scores folded into
``com.microsoft::FusedMatMul(q, k^T, alpha=1/sqrt(d))``. ONNX shape inference knows no shape for that op, ORT's
symbolic inference gives up on the graph ("Incomplete symbolic shape inference"), and no attention rule reads
it: the held-out probe (``bench/heldout_export_variants.py``, ``ort_saved``) had BERT and ViT at 0/2 attention.
This writes each one back as ONNX ops::

    FusedMatMul(A, B, alpha, transA, transB)  ==>  Mul(MatMul(Transpose(A)?, Transpose(B)?), alpha)

(the ``Mul`` only where alpha is not 1, the ``Transpose`` of the last two axes only where asked). The graph is
the one the exporter wrote before the session folded it, so the attention patterns match as on any export; a
``FusedMatMul`` left outside a fused attention is folded again by ORT's session when the model is loaded.
One with ``transBatchA``/``transBatchB`` (batch axes moved, not an attention's) or inputs of unknown rank is
kept as it is.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

_MS = "com.microsoft"


def _swap_last_two(rank: int) -> list[int]:
    return [*range(rank - 2), rank - 1, rank - 2]


def unfold(model: ir.Model) -> int:
    """Rewrite every unfoldable FusedMatMul of the main graph; returns how many."""
    done = 0
    for node in list(model.graph):
        if node.op_type != "FusedMatMul" or node.domain != _MS or len(node.inputs) != 2:
            continue
        attrs = node.attributes
        if attrs.get_int("transBatchA", 0) or attrs.get_int("transBatchB", 0):
            continue
        a, b = node.inputs
        ranks = [v.shape.rank() if v is not None and v.shape is not None else None for v in (a, b)]
        flags = (attrs.get_int("transA", 0), attrs.get_int("transB", 0))
        if any(f and (r is None or r < 2) for f, r in zip(flags, ranks, strict=True)):
            continue
        alpha = attrs.get_float("alpha", 1.0)
        base = node.name or f"FusedMatMul_{done}"
        new: list[ir.Node] = []
        operands = []
        for side, value, flag, rank in zip("ab", (a, b), flags, ranks, strict=True):
            if not flag:
                operands.append(value)
                continue
            t = ir.node("Transpose", [value], {"perm": _swap_last_two(rank)}, name=f"{base}/unfused_t{side}")
            new.append(t)
            operands.append(t.outputs[0])
        matmul = ir.node("MatMul", operands, name=f"{base}/unfused_matmul")
        new.append(matmul)
        out = matmul.outputs[0]
        if alpha != 1.0:
            dtype = a.dtype.numpy() if a.dtype is not None else np.float32
            scale = ir.Value(name=f"{base}/unfused_alpha", const_value=ir.tensor(np.array(alpha, dtype)))
            scale.type, scale.shape = ir.TensorType(ir.DataType.from_numpy(np.dtype(dtype))), ir.Shape([])
            model.graph.register_initializer(scale)
            mul = ir.node("Mul", [out, scale], name=f"{base}/unfused_scale")
            new.append(mul)
            out = mul.outputs[0]
        old = node.outputs[0]
        name, old.name = old.name, f"{old.name}/folded"
        out.name, out.type, out.shape = name, old.type, old.shape
        model.graph.insert_before(node, new)
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        model.graph.remove(node, safe=True)
        done += 1
    return done
