"""RMS normalization written in standard ONNX ops, the form ORT's session fuses into its own kernel.

onnxscript's ``rms_normalization`` rule emits ``SimplifiedLayerNormalization`` in the default ONNX domain: ORT
registers a kernel for it there, but ONNX has no such schema, so the ONNX checker (and the pipeline after
it) refuses the model. ORT's session builds that op itself when it loads the decomposition below
(``LayerNormFusion``, the simplified form), so writing it back costs nothing at run time::

    SimplifiedLayerNormalization(h, gamma, axis=-1, epsilon=e)
    ==>  Mul(Div(h, Sqrt(Add(ReduceMean(Pow(h, 2), axes=[-1]), e))), gamma)

``SkipSimplifiedLayerNormalization`` (com.microsoft), the residual form, is the one that would pay in the
artifact, but ORT 1.32's CPU kernel is slower than ``Add`` + the session's ``SimplifiedLayerNormalization``
(1.2-4.9x at hidden 384/768, sequence 64/256, one thread; see ``unfuse_skip_layernorm``), so on CPU it is
unfused into ``Add`` and this decomposition too.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes._match import take_graph_output

_ONNX_DOMAINS = ("", "ai.onnx")


def rms_nodes(h: ir.Value, gamma: ir.Value, epsilon: float, opset: int, name: str) -> list[ir.Node]:
    """The nodes computing ``h / sqrt(mean(h^2, -1) + epsilon) * gamma``; the last node's output is the result."""
    dtype = h.dtype.numpy() if h.dtype is not None else np.float32

    def const(suffix: str, array: np.ndarray) -> ir.Node:
        return ir.node("Constant", [], {"value": ir.tensor(array, name=f"{name}/{suffix}")}, name=f"{name}/{suffix}")

    two, eps = const("two", np.array(2, dtype)), const("epsilon", np.array(epsilon, dtype))
    square = ir.node("Pow", [h, two.outputs[0]], name=f"{name}/square")
    nodes = [two, eps, square]
    if opset >= 18:  # ReduceMean's axes became an input in opset 18
        axes = const("axes", np.array([-1], np.int64))
        mean = ir.node("ReduceMean", [square.outputs[0], axes.outputs[0]], {"keepdims": 1}, name=f"{name}/mean")
        nodes += [axes, mean]
    else:
        mean = ir.node("ReduceMean", [square.outputs[0]], {"axes": [-1], "keepdims": 1}, name=f"{name}/mean")
        nodes.append(mean)
    shifted = ir.node("Add", [mean.outputs[0], eps.outputs[0]], name=f"{name}/add_epsilon")
    root = ir.node("Sqrt", [shifted.outputs[0]], name=f"{name}/rms")
    normed = ir.node("Div", [h, root.outputs[0]], name=f"{name}/normalize")
    scaled = ir.node("Mul", [normed.outputs[0], gamma], name=f"{name}/scale")
    if h.dtype is not None:  # an untyped input (an If branch) leaves them untyped: Tensor(None) cannot serialize
        for node in (shifted, root, normed, scaled):
            node.outputs[0].dtype = h.dtype
    scaled.outputs[0].shape = h.shape
    return [*nodes, shifted, root, normed, scaled]


def opset_of_graph(graph: ir.Graph) -> int:
    return graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 1))


def expand_simplified_layer_norms(model: ir.Model) -> int:
    """Rewrite every default-domain ``SimplifiedLayerNormalization`` over the last axis, whose statistics
    output nothing reads, as standard ops; the number rewritten. Others are left for the checker to name."""
    graph, opset, done = model.graph, opset_of_graph(model.graph), 0
    for node in list(graph):
        if node.op_type != "SimplifiedLayerNormalization" or node.domain not in _ONNX_DOMAINS:
            continue
        h, gamma = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
        if h is None or gamma is None or len(node.inputs) > 2:
            continue
        axis = node.attributes.get_int("axis", -1)
        rank = h.shape.rank() if h.shape is not None else None
        if axis != -1 and (rank is None or axis != rank - 1):
            continue
        if any(v.uses() or v.is_graph_output() for v in node.outputs[1:]):
            continue
        epsilon = node.attributes.get_float("epsilon", 1e-5)
        nodes = rms_nodes(h, gamma, epsilon, opset, node.name or f"rms_{done}")
        out = nodes[-1].outputs[0]
        out.type, out.shape = node.outputs[0].type or out.type, node.outputs[0].shape or out.shape
        graph.insert_before(node, nodes)
        take_graph_output(graph, node.outputs[0], out, "_fused")
        ir.convenience.replace_all_uses_with(node.outputs[0], out)
        graph.remove(node, safe=True)
        done += 1
    return done
