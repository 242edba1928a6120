"""Graph helpers shared by the passes: naming a node in a report, walking every graph of a model, telling a
constant and reading its ints, and dropping the initializers nothing reads any more."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import onnx_ir as ir


def node_label(node: ir.Node) -> str:
    """A name a person can find in Netron: the node name, else its first output's name, else the op."""
    if node.name:
        return node.name
    for output in node.outputs:
        if output.name:
            return f"<{node.op_type} -> {output.name}>"
    return f"<{node.op_type}>"


def subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    """The graphs held in the node's attributes (If branches, Loop and Scan bodies), in attribute order."""
    for attr in node.attributes.values():
        if attr.is_ref():
            continue
        if attr.type == ir.AttributeType.GRAPH:
            yield attr.as_graph()
        elif attr.type == ir.AttributeType.GRAPHS:
            yield from attr.as_graphs()


def graphs_of(graph: ir.Graph | ir.Function) -> Iterator[ir.Graph | ir.Function]:
    """The graph and, depth first, every subgraph nested in its nodes."""
    yield graph
    for node in graph:
        for sub in subgraphs(node):
            yield from graphs_of(sub)


def all_graphs(model: ir.Model) -> Iterator[ir.Graph | ir.Function]:
    """The main graph, its subgraphs, then each model-local function and its subgraphs."""
    yield from graphs_of(model.graph)
    for function in model.functions.values():
        yield from graphs_of(function)


def is_output_of(value: ir.Value, graph: ir.Graph | ir.Function) -> bool:
    """Whether ``value`` is an output of ``graph`` itself (``Value.is_graph_output`` says: of any graph)."""
    return any(out is value for out in graph.outputs)


def take_graph_output(graph: ir.Graph | ir.Function, old: ir.Value, new: ir.Value, suffix: str) -> bool:
    """Where ``old`` is an output of ``graph``, ``new`` takes its place and its name, so the signature is
    unchanged; ``old`` keeps a name with ``suffix`` (names stay unique). Whether ``old`` was an output."""
    taken = False
    for index, output in enumerate(graph.outputs):
        if output is old:
            name = old.name
            old.name = f"{name}{suffix}"
            new.name = name
            graph.outputs[index] = new
            taken = True
    return taken


def is_input_of(value: ir.Value, graph: ir.Graph | ir.Function) -> bool:
    return any(inp is value for inp in graph.inputs)


def is_constant(value: ir.Value) -> bool:
    """An initializer, a value with a known constant, or the output of an ONNX ``Constant`` node."""
    producer = value.producer()
    return (
        value.const_value is not None
        or value.is_initializer()
        or (producer is not None and producer.op_type == "Constant" and producer.domain in ("", "ai.onnx"))
    )


def const_ints(value: ir.Value | None) -> list[int] | None:
    """The ints of a constant ``value`` (an initializer or a Constant's output), flattened; None otherwise."""
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None else [int(x) for x in tensor.numpy().reshape(-1)]


def drop_orphans(graph: ir.Graph, values: Sequence[ir.Value | None]) -> None:
    """Unregister the initializers among ``values`` that nothing reads any more (a removed slice's axes)."""
    for value in values:
        if value is None or not value.is_initializer() or value.is_graph_input() or value.is_graph_output():
            continue
        if not list(value.uses()) and graph.initializers.get(value.name) is value:
            graph.initializers.pop(value.name)
