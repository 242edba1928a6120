"""unfuse_skip_layernorm: residual Add + LayerNormalization instead of ``com.microsoft::SkipLayerNormalization``
on CPU, written so that ORT cannot fuse it back.

Why: on ORT's CPU execution provider the SkipLayerNormalization kernel is far slower than the two ops it
replaces. Measured with onnxruntime 1.32 on the bench machine (``python -m bench.skip_layernorm``, table in
bench/README.md), one [1, 128, H] residual block: 254 us against 36 us for Sum + LayerNormalization at H=384 on
one thread (7x), 1123 us against 85 us at H=768 on two (13x). That was 11% of MiniLM's latency at batch 1. ORT's
own level-2 optimizer (``SkipLayerNormFusion``) and onnxscript's fusions (``fuse_transformer``) both produce it.

Two rewrites, both exact (the same additions, at most one rounding apart where the bias moves)::

    SkipLayerNormalization(x, skip, gamma, beta, bias)  -->  LayerNormalization(Sum(Add(x, bias), skip), gamma, beta)
    LayerNormalization(Add(a, b), gamma, beta)          -->  LayerNormalization(Sum(a, b), gamma, beta)

The residual addition is written as ``Sum``: ORT's ``SkipLayerNormFusion`` matches only an ``Add`` feeding the
LayerNormalization, so any ORT that loads the artifact at its default level keeps the fast kernels, with no
session option to remember. The bias stays a separate ``Add`` on the input it belongs to (the MatMul's output)
so that ORT folds it into the MatMul's kernel (``MatMulIntegerToFloat`` after quantize_dynamic). The optional
outputs map one to one: mean and inverse std to LayerNormalization's own, the skip+bias sum to the ``Sum``.

The residual + RMS form, ``com.microsoft::SkipSimplifiedLayerNormalization`` (Llama, T5; onnxscript's fusions
make it), is slower on ORT 1.32's CPU EP too: 54 vs 37 us at [1, 64, 384], 244 vs 50 us at [1, 64, 768], 682 vs
346 us at [1, 256, 768] against Add + RMS norm, one thread, interleaved. It becomes ``Add`` and the RMS norm in
standard ops (``_rms_norm``), which ORT's session fuses into ``SimplifiedLayerNormalization`` alone: its CPU EP
never fuses the ``Add`` back, so no ``Sum`` guard is needed.

Only for the ``cpu`` target: CUDA's SkipLayerNormalization kernel is the fast one there, so the pass changes
nothing and says so. Needs opset 17 (the first with ``LayerNormalization``); below that it says so too.
"""

from __future__ import annotations

from typing import ClassVar

import onnx_ir as ir

from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes._match import is_constant, node_label, take_graph_output
from passes._subgraphs import in_branches
from passes.fusion import _rms_norm as rms_norm

_ONNX_DOMAINS = ("", "ai.onnx")
# SkipLayerNormalization's epsilon when the attribute is absent (onnxruntime contrib_defs.h).
_SLN_DEFAULT_EPSILON = 1e-12
_MIN_OPSET = 17
# The fused residual forms this pass takes apart, and the count each adds to.
_UNFUSED = {
    "SkipLayerNormalization": "skip_layernorms_unfused",
    "SkipSimplifiedLayerNormalization": "skip_rms_norms_unfused",
}


class UnfuseSkipLayerNormOptions(PassOptions):
    """The pass has no options; the model exists so unknown keys are refused like for every pass."""


class UnfuseSkipLayerNorm(Pass):
    name = "unfuse_skip_layernorm"
    summary = (
        "CPU: SkipLayerNormalization -> Sum + LayerNormalization (ORT's CPU kernel for it is 6-14x slower), "
        "guarded against ORT's re-fusion; SkipSimplifiedLayerNormalization -> Add + RMS norm (1.2-4.9x slower)."
    )
    exact = True
    in_place = True
    Options: ClassVar[type[PassOptions]] = UnfuseSkipLayerNormOptions

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        counts = {"skip_layernorms_unfused": 0, "skip_rms_norms_unfused": 0, "residual_adds_guarded": 0}
        if ctx.target != "cpu":
            reason = f"target {ctx.target}: its SkipLayerNormalization kernel is the fast one, left fused"
            return PassResult(model, False, counts, [NonMatch(reason)], {"decision": "skipped: not a cpu target"})
        opset = model.graph.opset_imports.get("", model.graph.opset_imports.get("ai.onnx", 1))
        if opset < _MIN_OPSET:
            reason = f"opset {opset} has no LayerNormalization (needs {_MIN_OPSET})"
            return PassResult(model, False, counts, [NonMatch(reason)], {"decision": "skipped: opset"})
        if (branches := in_branches(self, model, ctx)) is not None:  # a merged decoder: what fuse_transformer fused
            return branches
        non_matches: list[NonMatch] = []
        graph = model.graph
        for node in list(graph):
            if node.domain != "com.microsoft" or node.op_type not in _UNFUSED:
                continue
            reason = _unfuse(graph, node) if node.op_type == "SkipLayerNormalization" else _unfuse_rms(graph, node)
            if reason:
                non_matches.append(NonMatch(reason, node=node_label(node), op_type=node.op_type))
            else:
                counts[_UNFUSED[node.op_type]] += 1
        for node in list(graph):
            if node.op_type == "LayerNormalization" and node.domain in _ONNX_DOMAINS and _guard(graph, node):
                counts["residual_adds_guarded"] += 1
        modified = any(counts.values())
        notes = {"decision": "applied" if modified else "skipped: no SkipLayerNormalization or residual Add"}
        return PassResult(model, modified, counts, non_matches, notes)


def _unfuse(graph: ir.Graph, node: ir.Node) -> str | None:
    """Replace one SkipLayerNormalization; the reason it stays, or None once replaced."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    x, skip, gamma, beta, bias = inputs[:5]
    if x is None or skip is None or gamma is None:
        return "input, skip and gamma must all be given"
    if len(node.inputs) > 5:
        return f"{len(node.inputs)} inputs: a SkipLayerNormalization form this pass does not know"
    epsilon_attr = node.attributes.get("epsilon")
    epsilon = float(epsilon_attr.value) if epsilon_attr is not None else _SLN_DEFAULT_EPSILON
    new_nodes, residual = _bias_and_residual(node, x, bias, skip, "Sum")
    outputs = list(node.outputs) + [None] * (4 - len(node.outputs))
    wanted_stats = sum(1 for v in outputs[1:3] if v is not None and (v.uses() or v.is_graph_output()))
    norm = ir.node(
        "LayerNormalization",
        [residual.outputs[0], gamma, beta] if beta is not None else [residual.outputs[0], gamma],
        attributes={"axis": -1, "epsilon": epsilon},
        num_outputs=3 if wanted_stats else 1,
        name=f"{node.name}_norm",
    )
    new_nodes.append(norm)
    replacements = [(outputs[0], norm.outputs[0]), (outputs[3], residual.outputs[0])]
    if wanted_stats:
        replacements += [(outputs[1], norm.outputs[1]), (outputs[2], norm.outputs[2])]
    graph.insert_before(node, new_nodes)
    for old, new in replacements:
        if old is None:
            continue
        _copy_type(old, new)
        take_graph_output(graph, old, new, "_unfused")
        ir.convenience.replace_all_uses_with(old, new)
    graph.remove(node, safe=True)
    return None


def _unfuse_rms(graph: ir.Graph, node: ir.Node) -> str | None:
    """Replace one SkipSimplifiedLayerNormalization by ``Add`` and the RMS decomposition ORT's session fuses
    back into ``SimplifiedLayerNormalization`` alone (ORT 1.32's CPU EP never re-fuses the ``Add``)."""
    inputs = list(node.inputs) + [None] * (4 - len(node.inputs))
    x, skip, gamma, bias = inputs[:4]
    if x is None or skip is None or gamma is None:
        return "input, skip and gamma must all be given"
    if len(node.inputs) > 4:
        return f"{len(node.inputs)} inputs: a SkipSimplifiedLayerNormalization form this pass does not know"
    outputs = list(node.outputs) + [None] * (4 - len(node.outputs))
    if any(v is not None and (v.uses() or v.is_graph_output()) for v in outputs[1:3]):
        return "its mean or inverse-RMS output is read: the decomposition does not compute them"
    epsilon_attr = node.attributes.get("epsilon")
    epsilon = float(epsilon_attr.value) if epsilon_attr is not None else _SLN_DEFAULT_EPSILON
    new_nodes, residual = _bias_and_residual(node, x, bias, skip, "Add")
    new_nodes += rms_norm.rms_nodes(residual.outputs[0], gamma, epsilon, rms_norm.opset_of_graph(graph), node.name)
    graph.insert_before(node, new_nodes)
    for old, new in ((outputs[0], new_nodes[-1].outputs[0]), (outputs[3], residual.outputs[0])):
        if old is None:
            continue
        _copy_type(old, new)
        take_graph_output(graph, old, new, "_unfused")
        ir.convenience.replace_all_uses_with(old, new)
    graph.remove(node, safe=True)
    return None


def _guard(graph: ir.Graph, norm: ir.Node) -> bool:
    """Rewrite the residual ``Add`` feeding ``norm`` as ``Sum`` where ORT's SkipLayerNormFusion would take it:
    two computed (non-constant) operands and the LayerNormalization as its only reader."""
    add = norm.inputs[0].producer() if norm.inputs and norm.inputs[0] is not None else None
    if add is None or add.op_type != "Add" or add.domain not in _ONNX_DOMAINS or add.graph is not graph:
        return False
    total = add.outputs[0]
    if total.is_graph_output() or len(total.uses()) != 1:
        return False  # ORT fuses only an Add read by the LayerNormalization alone
    if any(v is None or is_constant(v) for v in add.inputs):
        return False  # a bias Add, not the residual one
    residual = ir.node("Sum", list(add.inputs), name=f"{add.name or 'add'}_residual")
    _copy_type(total, residual.outputs[0])
    graph.insert_before(add, residual)
    ir.convenience.replace_all_uses_with(total, residual.outputs[0])
    graph.remove(add, safe=True)
    return True


def _copy_type(source: ir.Value, target: ir.Value) -> None:
    target.type, target.shape = source.type, source.shape


def _bias_and_residual(
    node: ir.Node, x: ir.Value, bias: ir.Value | None, skip: ir.Value, op: str
) -> tuple[list[ir.Node], ir.Node]:
    """``op(x + bias, skip)``, the nodes both unfusings start with; the residual node comes last."""
    new_nodes: list[ir.Node] = []
    if bias is not None:
        # The bias belongs to the projection that produced x; added there, ORT folds it into that MatMul.
        biased = ir.node("Add", [x, bias], name=f"{node.name}_bias")
        _copy_type(x, biased.outputs[0])
        new_nodes.append(biased)
        x = biased.outputs[0]
    residual = ir.node(op, [x, skip], name=f"{node.name}_residual")
    _copy_type(node.outputs[0], residual.outputs[0])
    new_nodes.append(residual)
    return new_nodes, residual
