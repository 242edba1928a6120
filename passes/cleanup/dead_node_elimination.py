"""Remove nodes, initializers, functions and opset imports that no graph output depends on.

Wraps onnx-ir's ``RemoveUnusedNodesPass``, ``RemoveUnusedFunctionsPass`` and ``RemoveUnusedOpsetsPass``
(``onnx_ir/passes/common/unused_removal.py``), the job ORT does when ``Graph::Resolve`` drops nodes
and initializers nothing consumes (``onnxruntime/core/graph/graph.cc``,
``CleanUnusedInitializersAndNodeArgs``).
Adds what the onnx-ir passes leave: unused initializers of subgraphs, and counts by kind.

A value is live when it is a graph output or any node reads it, including a node inside an If/Loop/Scan
body that captures it from the enclosing graph (onnx-ir records those reads as uses)::

    x --> Relu --> r --+--> MatMul --> y          x --> Relu --> r --> MatMul --> y
                       +--> Sigmoid --> dead
    (unused initializer W_old)                    (W_old gone)

The model signature never changes: graph inputs stay even when nothing reads them, and so do
initializers that are also listed as graph inputs (a caller may feed them).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedFunctionsPass, RemoveUnusedNodesPass, RemoveUnusedOpsetsPass
from pydantic import Field

from passes._infra import Pass, PassContext, PassOptions, PassResult, op_histogram
from passes._match import all_graphs


class DeadNodeEliminationOptions(PassOptions):
    remove_unused_functions: bool = Field(
        True, description="Also delete model-local functions that no node calls, directly or indirectly."
    )
    remove_unused_opsets: bool = Field(
        True, description="Also drop opset imports of domains no node uses (the default domain always stays)."
    )


def _initializer_count(model: ir.Model) -> int:
    return sum(len(g.initializers) for g in all_graphs(model) if isinstance(g, ir.Graph))


def _remove_unused_subgraph_initializers(model: ir.Model) -> int:
    """onnx-ir cleans only the main graph's initializers; If/Loop bodies can hold their own."""
    removed = 0
    for graph in all_graphs(model):
        if graph is model.graph or not isinstance(graph, ir.Graph):
            continue
        live = set(graph.inputs) | set(graph.outputs)
        for value in list(graph.initializers.values()):
            if value not in live and not value.uses():
                assert value.name is not None
                graph.initializers.pop(value.name)
                removed += 1
    return removed


class DeadNodeElimination(Pass[DeadNodeEliminationOptions]):
    name = "dead_node_elimination"
    summary = "Remove nodes, initializers, functions and opset imports nothing depends on."
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        options = self.options
        ops_before = op_histogram(model)
        initializers_before = _initializer_count(model)

        # onnx-ir returns one number for nodes and initializers together; the before/after diffs split
        # it by kind. It walks nodes (last to first) before initializers, so an initializer read only by
        # a dead node goes in the same call.
        RemoveUnusedNodesPass()(model)
        _remove_unused_subgraph_initializers(model)

        functions_removed = 0
        if options.remove_unused_functions:
            functions_before = len(model.functions)
            RemoveUnusedFunctionsPass()(model)
            functions_removed = functions_before - len(model.functions)
        opsets_removed = 0
        if options.remove_unused_opsets:
            opsets_before = len(model.opset_imports)
            RemoveUnusedOpsetsPass(process_functions=True)(model)
            opsets_removed = opsets_before - len(model.opset_imports)

        removed_ops = ops_before - op_histogram(model)
        initializers_removed = initializers_before - _initializer_count(model)
        counts = {
            "nodes_removed": sum(removed_ops.values()),
            "initializers_removed": initializers_removed,
            "functions_removed": functions_removed,
            "opsets_removed": opsets_removed,
        }
        notes = {"removed_by_op": dict(sorted(removed_ops.items()))} if removed_ops else {}
        return PassResult(model, modified=any(counts.values()), counts=counts, notes=notes)
