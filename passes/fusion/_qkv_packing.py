"""Q/K/V packing for fuse_transformer: the MatMuls that read one activation become one wider MatMul.

::

    x --MatMul(Wq)--Add(bq)--> q        x --MatMul([Wq|Wk|Wv])--Add([bq|bk|bv])--Split--> q, k, v
    x --MatMul(Wk)--Add(bk)--> k   ==>
    x --MatMul(Wv)--Add(bv)--> v

A CPU then runs one GEMM of N = 3 * hidden instead of three, and int8 quantizes the activation once. Each
output column is the same dot product over the same K, so packing is exact. A group whose end is a graph
output is left alone, so graph output names never change.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes


def pack_qkv(model: ir.Model) -> int:
    """Merge the constant-weight MatMuls (with their constant bias Adds) that read one activation into
    ``MatMul -> Add -> Split``; returns the number of groups packed. Match first, mutate after."""
    groups: dict[int, list[ir.Node]] = {}
    for node in model.graph:
        if _packable(node):
            groups.setdefault(id(node.inputs[0]), []).append(node)
    sites = []
    for members in groups.values():
        weights = [m.inputs[1].const_value.numpy() for m in members]
        if len(members) < 2 or len({(w.shape[0], w.dtype) for w in weights}) != 1:
            continue
        adds = [_bias_add(m) for m in members]
        with_bias = all(a is not None for a in adds)
        ends = [a if with_bias else m for a, m in zip(adds, members, strict=True)]
        if any(e.outputs[0].is_graph_output() for e in ends):  # keep graph output names untouched
            continue
        sites.append((members, weights, adds if with_bias else None, ends))
    for index, (members, weights, adds, ends) in enumerate(sites):
        prefix = f"{members[0].name or 'matmul'}/packed_qkv"
        x = members[0].inputs[0]
        sizes = np.array([w.shape[1] for w in weights], np.int64)
        weight = _initializer(model, f"{prefix}/weight_{index}", np.concatenate(weights, axis=1))
        nodes = [ir.node("MatMul", [x, weight], name=f"{prefix}/matmul")]
        if adds is not None:
            bias = np.concatenate([_bias_value(a).const_value.numpy() for a in adds])
            nodes.append(ir.node("Add", [nodes[-1].outputs[0], _initializer(model, f"{prefix}/bias_{index}", bias)]))
            nodes[-1].name = f"{prefix}/bias"
        split_sizes = _initializer(model, f"{prefix}/split_{index}", sizes)
        split = ir.node("Split", [nodes[-1].outputs[0], split_sizes], {"axis": -1}, num_outputs=len(ends))
        split.name = f"{prefix}/split"
        nodes.append(split)
        model.graph.insert_before(min(members, key=_position(model)), nodes)
        for end, out in zip(ends, split.outputs, strict=True):
            if end.outputs[0].type is not None:  # untyped values stay untyped (no Tensor(None) value_info)
                out.shape, out.type = end.outputs[0].shape, end.outputs[0].type
            ir.convenience.replace_all_uses_with(end.outputs[0], out)
    if sites:
        common_passes.RemoveUnusedNodesPass()(model)
    return len(sites)


def _packable(node: ir.Node) -> bool:
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or node.inputs[0] is None:
        return False
    weight = node.inputs[1]
    return weight is not None and weight.const_value is not None and len(weight.const_value.shape) == 2


def _bias_value(add: ir.Node) -> ir.Value:
    return next(v for v in add.inputs if v is not None and v.const_value is not None)


def _bias_add(matmul: ir.Node) -> ir.Node | None:
    """The only reader of the MatMul's output when it is ``Add`` of a constant 1-D bias of width N."""
    uses = list(matmul.outputs[0].uses())
    if len(uses) != 1 or uses[0].node.op_type != "Add" or uses[0].node.domain not in ("", "ai.onnx"):
        return None
    add = uses[0].node
    bias = [v for v in add.inputs if v is not None and v is not matmul.outputs[0] and v.const_value is not None]
    width = matmul.inputs[1].const_value.shape[1]
    if len(bias) != 1 or tuple(bias[0].const_value.shape) != (width,):
        return None
    return add


def _initializer(model: ir.Model, name: str, array: np.ndarray) -> ir.Value:
    tensor = ir.tensor(array, name=name)
    value = ir.Value(name=name, const_value=tensor, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
    model.graph.register_initializer(value)
    return value


def _position(model: ir.Model):
    order = {id(node): i for i, node in enumerate(model.graph)}
    return lambda node: order[id(node)]
