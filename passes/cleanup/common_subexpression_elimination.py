"""Merge nodes that compute the same thing: same op, same inputs, same attributes.

Re-implements ORT's ``CommonSubexpressionElimination`` (``onnxruntime/core/optimizer/
common_subexpression_elimination.cc``) after onnx-ir's ``CommonSubexpressionEliminationPass``
(``onnx_ir/passes/common/common_subexpression_elimination.py``), whose graph-output handling it copies.
It is not a wrapper because the onnx-ir pass visits only the main graph, compares float attributes
with ``==`` (so ``alpha=0.0`` and ``alpha=-0.0`` merge), reports nothing, and merges custom-domain ops
whose semantics it cannot know (a custom op may be stateful or random).

Nodes are visited in graph order, so merging one pair makes its consumers identical in turn and a whole
duplicated chain collapses in one run::

    h --> Relu (relu_a) --> r_a --+--> Add --> s       h --> Relu (relu_a) --> r_a --+--> Add --> s
      \\-> Relu (relu_b) --> r_b --/                                                  \\--/

When the dropped node produced a graph output, the kept value takes that output's name; if the kept value
is itself a graph input or output, an Identity carries the second name instead (ONNX names a value once).

Never merged: If/Loop/Scan (subgraph attributes are not compared), random ops (two draws differ),
custom-domain ops unless allowed, and Constant nodes over ``max_constant_elements``
(``initializer`` deduplication is the tool for large weights).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

import onnx_ir as ir
from pydantic import Field

from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes._match import all_graphs, is_input_of, is_output_of, node_label

_ONNX_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml"})
_RANDOM_OPS = frozenset({"RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike", "Multinomial"})


class CommonSubexpressionEliminationOptions(PassOptions):
    max_constant_elements: int = Field(
        1024, ge=0, description="Constant nodes (and tensor attributes) with more elements are never merged."
    )
    include_custom_domains: bool = Field(
        False,
        description="Also merge ops outside the ONNX domains. Only safe when every custom op is "
        "deterministic and side-effect free.",
    )


class _Skip(Exception):
    """Raised by ``_attribute_key`` when an attribute makes the node ineligible."""


def _attribute_key(attr: ir.Attr, max_elements: int) -> Hashable:
    if attr.is_ref():
        return ("ref", attr.ref_attr_name)
    kind, value = attr.type, attr.value
    # float.hex keeps -0.0 apart from 0.0 and makes NaN equal to itself: bit-exact comparison.
    if kind == ir.AttributeType.FLOAT:
        return (kind, float(value).hex())
    if kind == ir.AttributeType.FLOATS:
        return (kind, tuple(float(v).hex() for v in value))
    if kind in (ir.AttributeType.INT, ir.AttributeType.STRING):
        return (kind, value)
    if kind in (ir.AttributeType.INTS, ir.AttributeType.STRINGS):
        return (kind, tuple(value))
    if kind == ir.AttributeType.TENSOR:
        if value.size > max_elements:
            raise _Skip(f"tensor attribute {attr.name!r} has {value.size} elements > {max_elements}")
        array = value.numpy()
        return (kind, str(value.dtype), array.shape, array.tobytes())
    raise _Skip(f"attribute {attr.name!r} of type {kind.name} is not compared")


def _node_key(node: ir.Node, max_elements: int) -> Hashable:
    attributes = tuple(sorted((name, _attribute_key(attr, max_elements)) for name, attr in node.attributes.items()))
    inputs = tuple(id(v) if v is not None else None for v in node.inputs)
    return (node.op_identifier(), len(node.outputs), inputs, attributes)


class CommonSubexpressionElimination(Pass[CommonSubexpressionEliminationOptions]):
    name = "common_subexpression_elimination"
    summary = "Merge nodes with the same op, inputs and attributes into one."
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        options = self.options
        merged: Counter[str] = Counter()
        non_matches: list[NonMatch] = []
        # The main graph first: merging there rewires captured values inside subgraphs, which can make
        # their nodes equal too.
        for graph in list(all_graphs(model)):
            seen: dict[Hashable, ir.Node] = {}
            for node in list(graph):
                try:
                    key = _node_key(node, options.max_constant_elements)
                except _Skip:
                    continue  # graph attributes, huge constants: nothing to compare, nothing to say
                kept = seen.get(key)
                if kept is None:
                    seen[key] = node
                    continue
                reason = self._decline_reason(node, options)
                if reason is not None:
                    non_matches.append(NonMatch(reason, node=node_label(node), op_type=node.op_type))
                    continue
                _merge(graph, drop=node, keep=kept)
                merged[node.op_type] += 1
        counts = {"nodes_merged": sum(merged.values())}
        notes = {"merged_by_op": dict(sorted(merged.items()))} if merged else {}
        return PassResult(model, modified=bool(merged), counts=counts, non_matches=non_matches, notes=notes)

    @staticmethod
    def _decline_reason(node: ir.Node, options: CommonSubexpressionEliminationOptions) -> str | None:
        """Why a node equal to an earlier one must still stay (asked only when a duplicate exists)."""
        if node.domain not in _ONNX_DOMAINS:
            if not options.include_custom_domains:
                return f"custom-domain op {node.domain}::{node.op_type} may be stateful; not merged"
        elif node.op_type in _RANDOM_OPS:
            return f"{node.op_type} is random: two identical nodes draw different values"
        return None


def _merge(graph: ir.Graph | ir.Function, *, drop: ir.Node, keep: ir.Node) -> None:
    for index, output in enumerate(list(graph.outputs)):
        if output.producer() is not drop:
            continue
        new = keep.outputs[output.index()]
        if is_output_of(new, graph) or is_input_of(new, graph):
            # The kept value already carries a signature name; the dropped name lives on through a copy.
            copy = ir.node(
                "Identity",
                inputs=[new],
                name=f"{drop.name}_output_{output.index()}" if drop.name else None,
                outputs=[ir.Value(name=output.name, type=output.type, shape=output.shape)],
            )
            graph.insert_before(drop, copy)
            graph.outputs[index] = copy.outputs[0]
        else:
            # A graph output must be typed; the kept value may never have been annotated.
            if new.type is None:
                new.type = output.type
            if new.shape is None:
                new.shape = output.shape
            new.name = output.name
            graph.outputs[index] = new
    ir.convenience.replace_all_uses_with(list(drop.outputs), list(keep.outputs))
    graph.remove(drop, safe=True)
