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

``Shape`` nodes of the main graph also merge when their inputs differ but provably have the same sizes in
the axes they return (``shapes_by_dims``). Exporters read each layer's own activation for its shape
arithmetic (TorchScript: ``Shape(hidden) -> Gather -> Unsqueeze -> Concat -> Reshape``; DeBERTa expands its
relative-position indices from each query's shape), so these chains never shared an input; once their
``Shape`` nodes are one, the chains collapse in the same run::

    q: [batch,seq,32] --> Shape --> Gather(0) --> ...        q: [batch,seq,32] --> Shape --> Gather(0) --> ...
    k: [batch,seq,32] --> Shape --> Gather(0) --> ...        k (its Shape, Gather... gone; readers take q's)

What counts as proof is in ``_provable_dims``. ONNX inference cannot name a size like ``4*batch`` (a
``Reshape`` to -1 of a symbolic input), so a layer past the first may have lost its ``batch`` and merges only
within itself; ``size_algebra`` adds products of names (``passes.cleanup._symbolic_dims``) and merges across
layers too (DeBERTa's relative-position ``Expand``s). It is off by default: on Phi-3 the arithmetic it shares
across layers keeps nodes alive that fuse_rotary and fuse_gqa remove otherwise (87 -> 134 nodes under ``fast``).
The proven sizes are also written onto the values' annotations, replacing the older ones shape_inference left.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterator

import onnx
import onnx_ir as ir
from pydantic import Field

from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes._match import all_graphs, is_input_of, is_output_of, node_label
from passes.cleanup._symbolic_dims import Size, Sizes, mono, refine
from passes.cleanup.shape_inference import without_large_initializers

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
    shapes_by_dims: bool = Field(
        True,
        description="Also merge main-graph Shape nodes over different values whose returned sizes are provably "
        "equal (equal integers, or one symbolic name, by a fresh ONNX shape inference that sees only the "
        "graph inputs' declarations); the shape arithmetic computed from them then merges too, and the proven "
        "sizes (numbers, graph-input names) are written onto the values' annotations.",
    )
    size_algebra: bool = Field(
        False,
        description="With shapes_by_dims: also prove sizes ONNX inference cannot name, as products of names "
        "(Reshape's -1, torch's expand, Range), which merges per-layer shape arithmetic across layers "
        "(DeBERTa's relative-position Expands). Off by default: on Phi-3 the arithmetic it shares across layers "
        "keeps nodes that fuse_rotary and fuse_gqa otherwise remove.",
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


Dims = tuple[int | str | None, ...]


def _shape_key(node: ir.Node, dims: dict[ir.Value, Sizes]) -> Hashable | None:
    """The key of a main-graph ``Shape`` node by the sizes it returns, or None when one of them is unproven.

    ``Shape(x, start, end)`` returns ``dims(x)[start:end]``: the ONNX spec clamps negative and out-of-range
    axes exactly as a Python slice does, so two nodes whose slices hold equal proven sizes return equal
    tensors whatever their inputs and attributes."""
    if node.op_type != "Shape" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
        return None
    known = dims.get(node.inputs[0]) if node.inputs[0] is not None else None
    if known is None:
        return None
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", None)
    sliced = known[start:end]
    if any(d is None for d in sliced):
        return None  # an unknown size equals nothing, not even another unknown one
    return (node.op_identifier(), "dims", sliced)


def _graphs_of_proto(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                yield from _graphs_of_proto(sub)


def _forget_annotations(proto: onnx.ModelProto) -> None:
    """Drop every shape ONNX would otherwise trust but that does not come from the graph inputs' declarations:
    value_info (exporters', users', and this project's earlier inference runs, whose ``unk__N`` names a later
    run reuses for other sizes and which graph edits leave stale), the graph outputs' declarations, and the
    declared inputs and outputs of subgraphs (a Loop body's ``[batch]`` state may grow every iteration)."""
    for index, graph in enumerate(_graphs_of_proto(proto.graph)):
        del graph.value_info[:]
        declared = list(graph.output) if index == 0 else [*graph.input, *graph.output]
        for info in declared:
            if info.type.HasField("tensor_type"):
                info.type.tensor_type.ClearField("shape")
    for function in proto.functions:
        del function.value_info[:]


def _dims_of(info: onnx.ValueInfoProto) -> Dims | None:
    tensor = info.type.tensor_type if info.type.HasField("tensor_type") else None
    if tensor is None or not tensor.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)


def _provable_dims(model: ir.Model, algebra: bool) -> tuple[dict[ir.Value, Sizes], set[str]]:
    """The sizes of main-graph values as far as they are proven to hold at run time: per axis a monomial over
    inference's names (a number or one name; with ``algebra``, ``passes.cleanup._symbolic_dims`` adds what
    inference cannot express, such as ``4*batch``), or None (unknown).

    Why these are proofs. ONNX shape inference runs afresh on a copy stripped by ``_forget_annotations``, so
    every size it reports is either a static int or a name that reached the value through inference rules,
    each of which copies a size only where the op makes it equal at run time (broadcasting keeps a symbol only
    against 1 or the same symbol; Concat, MatMul and the like copy the sizes the op requires equal, and the
    model would fail otherwise; data propagation copies a size from the ``Shape`` it was read from). A name
    has two sources: a graph input's declaration, where one name is one size across all inputs (ONNX IR;
    TensorRT enforces it, ORT does not check it, so a caller feeding ``input_ids`` and ``attention_mask`` of
    different lengths is outside the model's contract), or the run itself, which invents a fresh ``unk__N``
    for each size it cannot name and only copies it on by the same rules. Names from anywhere else were
    stripped; in particular the model's own annotations are never read. Values computed from a Loop, Scan or
    If output (or any op with a graph attribute) are left out: their sizes depend on how inference bounds
    the iterations, which is not needed here. An inference failure proves nothing: no entry at all. Also
    returns the names declared on the graph inputs."""
    try:
        with without_large_initializers(model.graph):
            proto = ir.serde.serialize_model(model)
        _forget_annotations(proto)
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # onnx raises InferenceError, ValidationError or RuntimeError: nothing proven
        return {}, set()
    by_name: dict[str, Dims] = {}
    graph = inferred.graph
    for info in [*graph.input, *graph.value_info, *graph.output]:
        dims = _dims_of(info)
        if dims is not None:
            by_name[info.name] = dims
    tainted: set[ir.Value] = set()
    inference: dict[ir.Value, Dims] = {}
    input_names: set[str] = set()
    for value in model.graph.inputs:
        if value.name in by_name and value.const_value is None:
            inference[value] = by_name[value.name]
            input_names.update(d for d in by_name[value.name] if isinstance(d, str))
    skip: set[ir.Node] = set()
    for node in model.graph:
        if any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()):
            skip.add(node)
        if node in skip or any(v in tainted for v in node.inputs if v is not None):
            tainted.update(node.outputs)
            continue
        for value in node.outputs:
            if value.name is not None and value.name in by_name:
                inference[value] = by_name[value.name]
    # Below a tainted value inference's sizes are not used; the rules still size what does not depend on it.
    if not algebra:
        return {v: tuple(None if d is None else mono(d) for d in dims) for v, dims in inference.items()}, input_names
    return refine(model, inference, input_names, skip), input_names


def _as_dim(size: Size, names: set[str]) -> int | str | None:
    """A proven size as an annotation can hold it: a number, or one graph-input name."""
    if size is None:
        return None
    coef, atoms = size
    if not atoms:
        return coef
    if coef == 1 and len(atoms) == 1 and atoms[0][1] == 1 and atoms[0][0] in names:
        return atoms[0][0]
    return None


def _annotate(model: ir.Model, dims: dict[ir.Value, Sizes], names: set[str]) -> int:
    """Write proven sizes onto the main graph's values; returns how many values changed. Later passes compare
    dims by name (fuse_gqa folds a head Reshape pair when the leading dims are provably its input's), and a
    layer whose batch inference lost (an ``unk__N``, or nothing) is still ``batch`` here; an annotation that
    says otherwise (an exporter's example size, a stale name) is wrong for some input. Only numbers and
    graph-input names (a product has no dim_param); the graph's outputs keep their declarations (the
    signature)."""
    changed = 0
    for node in model.graph:
        for value in node.outputs:
            sizes, shape = dims.get(value), value.shape
            if sizes is None or shape is None or len(shape) != len(sizes) or value.is_graph_output():
                continue
            new: list[int | ir.SymbolicDim] = []
            for old, size in zip(shape, sizes, strict=True):
                proven = _as_dim(size, names)
                if proven is None:
                    new.append(old)
                else:
                    new.append(proven if isinstance(proven, int) else ir.SymbolicDim(proven))
            if [str(d) for d in new] != [str(d) for d in shape]:
                value.shape = ir.Shape(new)
                changed += 1
    return changed


class CommonSubexpressionElimination(Pass[CommonSubexpressionEliminationOptions]):
    name = "common_subexpression_elimination"
    summary = "Merge nodes with the same op, inputs and attributes into one."
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        options = self.options
        merged: Counter[str] = Counter()
        shapes_by_dims = 0
        non_matches: list[NonMatch] = []
        # Inferred once, before any merge: a merge replaces a value by an equal one, so no size changes.
        dims, names = (
            _provable_dims(model, options.size_algebra)
            if options.shapes_by_dims and _has_shapes_of_distinct_values(model)
            else ({}, set())
        )
        # The main graph first: merging there rewires captured values inside subgraphs, which can make
        # their nodes equal too.
        for graph in list(all_graphs(model)):
            seen: dict[Hashable, ir.Node] = {}
            for node in list(graph):
                # Graph order is a topological order, so the kept node (first seen) is computed before every
                # reader of the dropped one.
                key = _shape_key(node, dims) if graph is model.graph and dims else None
                if key is None:
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
                if node.op_type == "Shape" and kept.inputs[0] is not node.inputs[0]:
                    shapes_by_dims += 1
                _merge(graph, drop=node, keep=kept)
                merged[node.op_type] += 1
        # shape_inference's annotations are older than the graph by now (and keep names it invented in another
        # run): the sizes proven here replace them, so later passes that compare dims by name agree with the
        # merges (fuse_gqa folds a layer's head Reshapes only when its shape reads a value of the same names).
        annotated = _annotate(model, dims, names) if dims else 0
        counts = {"nodes_merged": sum(merged.values())}
        notes: dict[str, object] = {"merged_by_op": dict(sorted(merged.items()))} if merged else {}
        if shapes_by_dims:
            notes["shapes_merged_by_dims"] = shapes_by_dims
        if annotated:
            notes["values_annotated"] = annotated
        return PassResult(
            model, modified=bool(merged) or annotated > 0, counts=counts, non_matches=non_matches, notes=notes
        )

    @staticmethod
    def _decline_reason(node: ir.Node, options: CommonSubexpressionEliminationOptions) -> str | None:
        """Why a node equal to an earlier one must still stay (asked only when a duplicate exists)."""
        if node.domain not in _ONNX_DOMAINS:
            if not options.include_custom_domains:
                return f"custom-domain op {node.domain}::{node.op_type} may be stateful; not merged"
        elif node.op_type in _RANDOM_OPS:
            return f"{node.op_type} is random: two identical nodes draw different values"
        return None


def _has_shapes_of_distinct_values(model: ir.Model) -> bool:
    """Whether two main-graph Shape nodes read different values: otherwise inference would buy nothing."""
    read = {id(n.inputs[0]) for n in model.graph if n.op_type == "Shape" and n.inputs and n.inputs[0] is not None}
    return len(read) > 1


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
