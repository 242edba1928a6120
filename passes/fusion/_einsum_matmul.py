"""Two-operand ``Einsum`` that is a batched matrix product, written as the ``MatMul`` the attention rules read.

CvT writes its attention with ``torch.einsum("bhlk,bhtk->bhlt", q, k)`` and ``einsum("bhlt,bhtv->bhlv", p, v)``,
and both TorchScript and dynamo export an ``Einsum`` node: onnxscript's SDPA rule matches ``MatMul`` only, so no
attention fused (bench/heldout_round2_encoders.py: CvT 0/3). An equation whose operands and result share the
same leading batch letters, in the same order, and whose last two letters are a matrix product (the one
letter contracted is in both operands, each other letter in one operand and the result) is that product::

    Einsum("bhlk,bhtk->bhlt", a, b)   ==>   MatMul(a, Transpose(b, perm=[0, 1, 3, 2]))
    Einsum("bhkl,bhkt->bhlt", a, b)   ==>   MatMul(Transpose(a, [0, 1, 3, 2]), Transpose(b, [0, 1, 3, 2]))

The same sums of the same products (MLAS may add them in another order: within float rounding). Anything
else (an ellipsis, a repeated letter, a broadcast or summed batch letter, a transposed result, more or fewer
than two operands, a graph output) is left as it is.
"""

from __future__ import annotations

import onnx_ir as ir


def _operands(equation: str) -> tuple[str, str, str] | None:
    text = equation.replace(" ", "")
    if "->" not in text or "." in text:
        return None
    inputs, output = text.split("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        return None
    return terms[0], terms[1], output


def _plan(equation: str) -> tuple[bool, bool] | None:
    """Whether the first and the second operand need their last two axes swapped, or None for no product."""
    parsed = _operands(equation)
    if parsed is None:
        return None
    a, b, out = parsed
    if len(a) != len(b) or len(a) != len(out) or len(a) < 2:
        return None
    if any(len(set(t)) != len(t) for t in (a, b, out)):
        return None
    batch = out[:-2]
    if a[:-2] != batch or b[:-2] != batch:
        return None
    i, j = out[-2], out[-1]
    shared = set(a[-2:]) & set(b[-2:])
    if len(shared) != 1:
        return None
    (k,) = shared
    if k in out or set(a[-2:]) != {i, k} or set(b[-2:]) != {k, j}:
        return None
    return a[-2:] == k + i, b[-2:] == j + k


def einsum_to_matmul(model: ir.Model) -> int:
    """Rewrite each batched-matrix-product Einsum of the main graph; returns how many."""
    rewritten = 0
    for node in list(model.graph):
        if node.op_type != "Einsum" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        equation = node.attributes.get_string("equation", "")
        plan = _plan(equation)
        if plan is None or any(v is None for v in node.inputs) or node.outputs[0].is_graph_output():
            continue  # a graph output keeps its producer: the model's interface is not this rewrite's
        rank = len(_operands(equation)[0])  # type: ignore[index]
        swap = [*range(rank - 2), rank - 1, rank - 2]
        prefix = f"{node.name or 'einsum'}/as_matmul_{rewritten}"  # unique even where the exporter named none
        operands, added = [], []
        for index, (value, transposed) in enumerate(zip(node.inputs, plan, strict=True)):
            if transposed:
                added.append(ir.node("Transpose", [value], {"perm": swap}, name=f"{prefix}/transpose_{index}"))
            operands.append(added[-1].outputs[0] if transposed else value)
        matmul = ir.node("MatMul", operands, name=f"{prefix}/matmul")
        out = node.outputs[0]
        matmul.outputs[0].shape, matmul.outputs[0].type = out.shape, out.type
        model.graph.insert_before(node, [*added, matmul])
        ir.convenience.replace_all_uses_with(out, matmul.outputs[0])
        model.graph.remove(node, safe=True)
        rewritten += 1
    return rewritten
