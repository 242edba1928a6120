"""Remove ``Identity`` nodes, rewiring their consumers to the Identity's input.

Re-implements ORT's ``EliminateIdentity`` (``onnxruntime/core/optimizer/identity_elimination.cc``) and
onnx-ir's ``IdentityEliminationPass`` (``onnx_ir/passes/common/identity_elimination.py``), whose three
rules it follows. It does not wrap the onnx-ir pass because that pass renames ``x`` to ``y`` even when
``x`` is itself a graph output, so two graph outputs end up with the same name and the first output's
name is lost (onnx-ir 1.1.0); here that case keeps its Identity. Every kept Identity gets a reason.

Rule 1, ``y`` is not a graph output: consumers of ``y`` read ``x``::

    x --> Identity --> y --> Relu          x --> Relu

Rule 2, ``y`` is an output of the node's own graph and ``x`` a node output of that graph: ``x`` takes the
name ``y`` so the graph signature is unchanged::

    a --> MatMul --> x --> Identity --> y (graph output)      a --> MatMul --> y (graph output)

Rule 3, kept: ``y`` is a graph output and ``x`` is a graph input, an initializer, another graph output,
or a value of an enclosing graph. ONNX has no way to name one value twice, so the copy must stay::

    x (graph input) --> Identity --> y (graph output)        unchanged
"""

from __future__ import annotations

import onnx_ir as ir

from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes._match import all_graphs, is_output_of, node_label

_ONNX_DOMAINS = ("", "ai.onnx")


class IdentityEliminationOptions(PassOptions):
    """The pass has no options; the model exists so unknown keys are refused like for every pass."""


def _decline_reason(node: ir.Node, graph: ir.Graph | ir.Function) -> str | None:
    """Why this Identity must stay, or None when it can go. Reads the graph, never edits it."""
    if len(node.inputs) != 1 or len(node.outputs) != 1 or node.inputs[0] is None:
        return f"Identity has {len(node.inputs)} inputs and {len(node.outputs)} outputs, expected 1 and 1"
    x, y = node.inputs[0], node.outputs[0]
    if not is_output_of(y, graph):
        return None  # rule 1
    if x.is_graph_input():
        return f"output {y.name!r} is a graph output and input {x.name!r} is a graph input"
    if x.is_initializer():
        return f"output {y.name!r} is a graph output and input {x.name!r} is an initializer"
    if x.is_graph_output():
        return f"output {y.name!r} and input {x.name!r} are both graph outputs; both names must survive"
    producer = x.producer()
    if producer is None or producer.graph is not graph:
        return f"output {y.name!r} is a graph output and input {x.name!r} comes from an enclosing graph"
    return None  # rule 2


class IdentityElimination(Pass[IdentityEliminationOptions]):
    name = "identity_elimination"
    summary = "Remove Identity nodes, keeping graph input and output names intact."
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        removed = renamed = 0
        non_matches: list[NonMatch] = []
        for graph in list(all_graphs(model)):
            # Decide each Identity on the graph as the earlier removals left it: in a chain
            # input -> Identity -> a -> Identity -> output, removing the first turns the second's input
            # into a graph input, which must flip the second's decision to "keep".
            for node in [n for n in graph if n.op_type == "Identity" and n.domain in _ONNX_DOMAINS]:
                reason = _decline_reason(node, graph)
                if reason is not None:
                    non_matches.append(NonMatch(reason, node=node_label(node), op_type="Identity"))
                    continue
                renamed += _remove(node, graph)
                removed += 1
        counts = {"identities_removed": removed, "identities_kept": len(non_matches)}
        if renamed:
            counts["values_renamed"] = renamed
        return PassResult(model, modified=removed > 0, counts=counts, non_matches=non_matches)


def _remove(node: ir.Node, graph: ir.Graph | ir.Function) -> int:
    """Bypass and delete an Identity that ``_decline_reason`` accepted; 1 if ``x`` was renamed."""
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    # y may carry the more precise type (exporters annotate outputs); keep what is known.
    x.shape = _merge_shapes(x.shape, y.shape)
    if x.type is None:
        x.type = y.type
    y_is_output = is_output_of(y, graph)
    ir.convenience.replace_all_uses_with(y, x, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    if y_is_output:
        x.name = y.name
        return 1
    return 0


def _merge_shapes(a: ir.Shape | None, b: ir.Shape | None) -> ir.Shape | None:
    """Per dimension, a concrete size beats a named symbol, which beats an anonymous one."""
    if a is None or b is None or len(a) != len(b):
        # Different ranks means the model was wrong already; keep the input's own annotation.
        return a if a is not None else b

    def pick(d1: int | ir.SymbolicDim, d2: int | ir.SymbolicDim) -> int | ir.SymbolicDim:
        if isinstance(d1, int):
            return d1
        if isinstance(d2, int) or d1.value is None:
            return d2
        return d1

    return ir.Shape([pick(d1, d2) for d1, d2 in zip(a, b, strict=True)])
