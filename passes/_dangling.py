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


def reattach_constants(graph: ir.Graph) -> int:
    """Register again each constant the graph's nodes read that is no longer an initializer; the count.

    onnxscript 0.7.2's rewriter registers a rule's new initializer under its name even when that name is taken
    (its ``ReshapeReshape`` names the shape ``<output>/shape``, so two collapses onto one output collide): the
    first initializer is unregistered while other nodes still read it. The value keeps its tensor, so
    registering it again (under a fresh name when the new one holds the old) restores exactly what they read."""
    count = 0
    for node in graph:
        for value in node.inputs:
            if value is None or value.producer() is not None or value.is_graph_input() or value.is_initializer():
                continue
            if value.const_value is None or value.graph is not None:
                continue
            base, k = value.name or "constant", 0
            while value.name is None or value.name in graph.initializers:
                k += 1
                value.name = f"{base}_{k}"
            graph.register_initializer(value)
            count += 1
    return count
