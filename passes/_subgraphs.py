"""A graph pass run inside the ``If`` branches that hold a model's bulk (Optimum's merged decoders).

Optimum's ``decoder_model_merged.onnx`` is one ``If`` on ``use_cache_branch``: every node of the model sits
in its two branches (then: decoder_with_past, else: the decoder), which read the inputs and the weights from
the outer graph by name. Our passes read the top-level graph, so they found nothing to fuse. A pass that can
run on a branch calls ``in_branches`` first (a two-line hook in its ``call``); on such a model it does::

    outer graph: inputs, weights --> If(use_cache_branch) --> outputs
                                     |-- then: N nodes reading inputs/weights by name
                                     `-- else: M nodes reading inputs/weights by name

    each branch, alone:  graph inputs = the outer inputs it reads; initializers = the outer weights it reads
                         + its own; outputs = its outputs (dims renamed: Optimum declares the no-cache
                         branch's shapes on both, and the cache branch's presents are longer)
        --> pass.call(branch model, samples of the sets that ran this branch)
        --> back in place: the branch's nodes, own initializers and inferred shapes replaced; weights
            the two branches now hold equal (packed or quantized from the same outer weight) hoisted into
            the outer graph once; outer weights no branch reads any more dropped; the pass's opsets and
            functions added

The branches are what the pass sees: its counts add up, its non-matches and notes are per branch. A branch
that cannot stand alone (it reads a value an outer node computes) or whose result cannot go back (other
outputs, a new input) is left as it was, with the reason as a non-match. Only ``If`` nodes whose branches
together hold most of the model's nodes qualify: a small ``If`` elsewhere is no merged decoder.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np
import onnx
import onnx_ir as ir

from passes._infra import NonMatch, PassContext, PassResult

BULK_SHARE = 0.5  # the branches of a qualifying If hold more than this share of the model's nodes
_BRANCHES = ("then_branch", "else_branch")


class _GraphPass(Protocol):
    name: str
    in_place: bool

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult: ...


def _follower(pass_: _GraphPass, notes: dict[str, Any]) -> _GraphPass:
    """The pass to run on the other branches of an If: ``pass_.for_other_branches(notes)`` where the pass has
    one (it fixes what it measured on the first branch, e.g. quantize_int4's block size, so that weights the
    branches share come out equal and stay stored once), else ``pass_``."""
    follow = getattr(pass_, "for_other_branches", None)
    return pass_ if follow is None else follow(notes)


def _count(graph: onnx.GraphProto) -> int:
    return sum(1 + sum(_count(a.g) for a in n.attribute if a.HasField("g")) for n in graph.node)


def _free_reads(graph: onnx.GraphProto) -> list[str]:
    """Names ``graph``'s nodes (nested subgraphs included) read without the graph defining them, in order."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    reads: list[str] = []
    for node in graph.node:
        for name in node.input:
            if name and name not in defined and name not in reads:
                reads.append(name)
        for attr in node.attribute:
            if attr.HasField("g"):
                reads += [n for n in _free_reads(attr.g) if n not in defined and n not in reads]
        defined.update(node.output)
    return reads + [o.name for o in graph.output if o.name not in defined and o.name not in reads]


def bulk_ifs(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The top-level ``If`` nodes whose branches hold the model's bulk (module docstring)."""
    total = _count(proto.graph)
    return [
        node
        for node in proto.graph.node
        if node.op_type == "If"
        and node.domain in ("", "ai.onnx")
        and sum(_count(a.g) for a in node.attribute if a.name in _BRANCHES) > BULK_SHARE * total
    ]


def _fresh_dims(value: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(value)
    for axis, dim in enumerate(out.type.tensor_type.shape.dim):
        if not dim.HasField("dim_value"):
            dim.dim_param = f"{value.name}_dim{axis}"
    return out


def standalone(proto: onnx.ModelProto, branch: onnx.GraphProto) -> onnx.ModelProto | str:
    """``branch`` as a model of its own (module docstring), or why it cannot be one."""
    inputs = {i.name: i for i in proto.graph.input}
    weights = {t.name: t for t in proto.graph.initializer}
    reads = _free_reads(branch)
    computed = [n for n in reads if n not in inputs and n not in weights]
    if computed:
        return f"reads {computed[:3]}, computed in the outer graph: it cannot stand alone"
    graph = onnx.helper.make_graph(
        list(branch.node),
        branch.name or "branch",
        [inputs[n] for n in inputs if n in reads and n not in weights],
        [_fresh_dims(o) for o in branch.output],
        [*branch.initializer, *(weights[n] for n in reads if n in weights)],
    )  # no value_info: shapes inferred inside the If (under the outer outputs Optimum declared) can be wrong
    model = onnx.helper.make_model(graph, opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
    model.functions.extend(proto.functions)
    model.metadata_props.extend(proto.metadata_props)  # what a pass reads there (max_position_embeddings)
    return model


def _digest(tensor: onnx.TensorProto) -> tuple[int, tuple[int, ...], str]:
    data = onnx.numpy_helper.to_array(tensor)
    return tensor.data_type, tuple(tensor.dims), hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()


def _rename_reads(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename what ``graph``'s nodes read (nested subgraphs too, where they do not define the name)."""
    if not mapping:
        return
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = mapping.get(name, name)
        for attr in node.attribute:
            if attr.HasField("g"):
                inner = {k: v for k, v in mapping.items() if k not in {t.name for t in attr.g.initializer}}
                _rename_reads(attr.g, inner)
    for out in graph.output:
        out.name = mapping.get(out.name, out.name)


def _all_names(proto: onnx.ModelProto) -> set[str]:
    names: set[str] = set()

    def walk(graph: onnx.GraphProto) -> None:
        names.update(i.name for i in graph.input)
        names.update(t.name for t in graph.initializer)
        for node in graph.node:
            names.update(node.input)
            names.update(node.output)
            for attr in node.attribute:
                if attr.HasField("g"):
                    walk(attr.g)

    walk(proto.graph)
    return names


def _unique(base: str, taken: set[str]) -> str:
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def put_back(proto: onnx.ModelProto, branch: onnx.GraphProto, result: onnx.ModelProto) -> str | None:
    """Replace ``branch`` (inside ``proto``) with ``result``'s graph; None, or why it cannot go back."""
    outer = {i.name for i in proto.graph.input} | {t.name for t in proto.graph.initializer}
    if [o.name for o in result.graph.output] != [o.name for o in branch.output]:
        return "the pass changed the branch's outputs"
    added = [i.name for i in result.graph.input if i.name not in outer]
    if added:
        return f"the pass added inputs {added[:3]}"
    weights = {t.name: t for t in proto.graph.initializer}
    taken = _all_names(proto) | _all_names(result)
    own, rename = [], {}
    for tensor in result.graph.initializer:
        if tensor.name in weights and _digest(tensor) == _digest(weights[tensor.name]):
            continue  # still the outer weight
        if tensor.name in outer:  # changed under an outer name: a name of its own, never shadowing
            rename[tensor.name] = _unique(f"{tensor.name}_{branch.name}", taken)
            tensor.name = rename[tensor.name]
        own.append(tensor)
    kept_outputs = [onnx.ValueInfoProto.FromString(o.SerializeToString()) for o in branch.output]
    outputs = {o.name for o in kept_outputs}
    del branch.node[:], branch.initializer[:], branch.value_info[:], branch.output[:]
    branch.node.extend(result.graph.node)
    branch.initializer.extend(own)
    # The shapes the pass inferred on the branch alone hold inside the If (the outputs keep their declared ones)
    branch.value_info.extend(v for v in result.graph.value_info if v.name not in outputs and v.name not in outer)
    branch.output.extend(kept_outputs)
    _rename_reads(branch, rename)
    domains = {o.domain: o for o in proto.opset_import}
    for opset in result.opset_import:
        if opset.domain not in domains:
            proto.opset_import.append(opset)
    have = {(f.domain, f.name) for f in proto.functions}
    proto.functions.extend(f for f in result.functions if (f.domain, f.name) not in have)
    return None


def share_weights(proto: onnx.ModelProto, node: onnx.NodeProto) -> int:
    """Weights the branches of ``node`` hold equal (or equal to an outer one) read from the outer graph once;
    outer weights nothing reads any more dropped. The number of branch weights moved."""
    branches = [a.g for a in node.attribute if a.name in _BRANCHES]
    outer = {_digest(t): t.name for t in proto.graph.initializer}
    found: dict[tuple[int, tuple[int, ...], str], list[tuple[onnx.GraphProto, onnx.TensorProto]]] = {}
    for graph in branches:
        for tensor in graph.initializer:
            if len(tensor.dims) > 1 or (len(tensor.dims) == 1 and tensor.data_type not in (6, 7)):
                found.setdefault(_digest(tensor), []).append((graph, tensor))
    taken = _all_names(proto)
    moved = 0
    for key, holders in found.items():
        if key not in outer and len({id(g) for g, _ in holders}) < 2:
            continue
        if key not in outer:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(holders[0][1])
            tensor.name = _unique(f"{holders[0][1].name}_shared", taken)
            proto.graph.initializer.append(tensor)
            outer[key] = tensor.name
        for graph, tensor in holders:
            _rename_reads(graph, {tensor.name: outer[key]})
            graph.initializer.remove(tensor)
            moved += 1
    used: set[str] = set()
    for graph_node in proto.graph.node:
        used.update(graph_node.input)
        for attr in graph_node.attribute:
            if attr.HasField("g"):
                used.update(_free_reads(attr.g))
    used.update(o.name for o in proto.graph.output)
    unused = [t for t in proto.graph.initializer if t.name not in used]
    for tensor in unused:
        proto.graph.initializer.remove(tensor)
    return moved


def _branch_samples(ctx: PassContext, node: onnx.NodeProto, attr: str, names: Iterable[str]) -> list[dict[str, Any]]:
    """The samples that ran this branch (the condition's value), restricted to the branch's inputs."""
    names = list(names)
    out = []
    for feed in ctx.samples:
        cond = feed.get(node.input[0])
        if cond is None or not all(n in feed for n in names):
            continue
        if bool(np.asarray(cond).reshape(-1)[0]) is (attr == "then_branch"):
            out.append({n: feed[n] for n in names})
    return out


def in_branches(pass_: _GraphPass, model: ir.Model, ctx: PassContext) -> PassResult | None:
    """``pass_`` applied inside each branch of the model's bulk ``If`` nodes, or None when the model has
    none (then the pass runs on the graph as usual). The result honours ``pass_.in_place``."""
    if not any(n.op_type == "If" and n.domain in ("", "ai.onnx") for n in model.graph):
        return None  # the common case, decided without serializing the weights
    proto = ir.serde.serialize_model(model)
    targets = bulk_ifs(proto)
    if not targets:
        return None
    counts: Counter[str] = Counter()
    non_matches: list[NonMatch] = []
    notes: dict[str, Any] = {}
    modified = False
    for node in targets:
        branches = [(a, standalone(proto, a.g)) for a in node.attribute if a.name in _BRANCHES]
        # The branch reading the most outer inputs first: the cache branch (it reads the caches beside the
        # decoder's inputs), the one a decode step runs, where a pass that measures should measure.
        branches.sort(key=lambda b: -len(b[1].graph.input) if not isinstance(b[1], str) else 0)
        runner, first = pass_, None
        for attr, alone in branches:
            where = f"If {node.name or node.output[0]} {attr.name} ({attr.g.name})"
            if isinstance(alone, str):
                non_matches.append(NonMatch(f"inside {where}: not optimized: {alone}", node.name, "If"))
                continue
            names = [i.name for i in alone.graph.input]
            sub_ctx = PassContext(
                target=ctx.target,
                samples=_branch_samples(ctx, node, attr.name, names),
                constant_fold_max_bytes=ctx.constant_fold_max_bytes,
                side_files=ctx.side_files,
                measure=ctx.measure,
                tolerance=ctx.tolerance,
                samples_are_data=ctx.samples_are_data,
            )
            result = runner.call(ir.serde.deserialize_model(alone), sub_ctx)
            for m in result.non_matches:
                non_matches.append(NonMatch(f"inside {where}: {m.reason}", m.node, m.op_type))
            notes[where] = result.notes if first is None else {**result.notes, "choices_from": first}
            if first is None:
                first, runner = where, _follower(pass_, result.notes)
            if not result.modified:
                continue
            why = put_back(proto, attr.g, ir.serde.serialize_model(result.model))
            if why is not None:
                non_matches.append(NonMatch(f"inside {where}: not optimized: {why}", node.name, "If"))
                continue
            modified = True
            counts.update(result.counts)
        if modified:
            counts["branch_weights_shared"] += share_weights(proto, node)
    notes = {"branches": notes}
    if not modified:
        return (
            PassResult(model, False, dict(counts), non_matches, notes)
            if pass_.in_place
            else PassResult(ir.serde.deserialize_model(proto), False, dict(counts), non_matches, notes)
        )
    # No onnx.checker here: it serializes the whole model (a copy of every weight, refused past 2 GB); the
    # engine loads and verifies the result as it does every pass's.
    new = ir.serde.deserialize_model(proto)
    if pass_.in_place:
        model.graph = new.graph
        model.opset_imports.update(new.opset_imports)
        model.functions.update(new.functions)
        new = model
    return PassResult(new, True, dict(counts), non_matches, notes)
