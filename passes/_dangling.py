"""Values a graph reads that nothing defines: the check every pass's result goes through (``Pass.__call__``).

A value is defined when a node of the graph (or of a graph enclosing it) produces it, or it is an input or an
initializer of one of them. An ``ir.Value`` keeps its name when the initializer it was is unregistered or its
producer removed, so the serialized model still names it: ORT then refuses the whole model ("not output of
any previous nodes"), far from the step that lost it; or, when another value carries the same name, the
model silently reads that one instead.
"""

from __future__ import annotations

import onnx_ir as ir


def _defined(value: ir.Value, scopes: list[ir.Graph]) -> bool:
    producer = value.producer()
    if producer is not None:
        return producer.graph is not None and any(producer.graph is g for g in scopes)
    owner = value.graph
    if owner is None or not any(owner is g for g in scopes):
        return False
    return value.is_graph_input() or value.is_initializer()


def dangling_values(graph: ir.Graph, _outer: tuple[ir.Graph, ...] = ()) -> list[str]:
    """``"<node> reads <value>"`` (or ``"output <value>"``) for each read of an undefined value, subgraphs included."""
    scopes = [graph, *_outer]
    found: list[str] = []
    for node in graph:
        for value in node.inputs:
            if value is not None and not _defined(value, scopes):
                found.append(f"{node.name or node.op_type} reads {value.name!r}")
        for attr in node.attributes.values():
            subgraphs = (
                [attr.value]
                if attr.type == ir.AttributeType.GRAPH
                else list(attr.value)
                if attr.type == ir.AttributeType.GRAPHS
                else []
            )
            for sub in subgraphs:
                found.extend(dangling_values(sub, (graph, *_outer)))
    found.extend(f"output {v.name!r}" for v in graph.outputs if not _defined(v, scopes))
    return found
