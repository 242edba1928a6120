"""A structural proof that two models are the same program under ORT's own graph optimizations.

::

    upload ───> ORT session (ORT_ENABLE_ALL, the job's target) ─> the graph ORT runs ─> canonical digest ─┐
                                                                                                          equal?
    artifact ─> ORT session (the same options)                 ─> the graph ORT runs ─> canonical digest ─┘

Many a ``fast`` job on a CNN applies only what ORT's session optimizer does at load anyway (shape inference,
constant folding, CSE, dead nodes): the two sessions then run the same graph, and timing them against each
other for 17-19 s (workers/gate.py) can only find noise. When the graphs ORT would run are equal, the artifact
is not slower by construction and the gate hands it back untimed.

Canonical form (``program_digest``): every node gets a Merkle digest of (domain, op_type, which output slots it
fills, attributes, its inputs) where an input is a graph input (by name), an initializer (by content: type, shape,
bytes), or a producer's digest and output slot; the program is the IR version and the opsets its nodes use, the
sorted multiset of node digests, the graph inputs (name, type), and each graph output (name, type) with the digest
of what produces it; a type's symbolic dimensions count without their names. Node names, value names inside the
graph, value_info, metadata, doc strings and the order of nodes in the file are ignored (a reordering that keeps
the dataflow is the same program: ORT orders the nodes it runs itself); any attribute or initializer byte that
differs makes them unequal. Graphs this form does not cover are "not proven" and timed as before: subgraphs (If,
Loop, Scan attributes), sparse initializers, external data or files over 1 GB (far from ORT's 2 GB limit for the
single file it writes), session options on the artifact (a ``tune_session`` recipe: another session), and sessions
that could not save their graph (compiled EPs such as TensorRT).

Cost: one extra ORT_ENABLE_ALL session build, save and hash per model (0.2-0.3 s on the corpus CNNs, 0.6 s on
wav2vec2, 2.9 s on BART at bench size, load 3-4), paid on every gate; the benchmark's pooled sessions are not
built with ``optimized_model_filepath``, so what they time is unchanged. The artifact's half is skipped when
the artifact, as written, holds a contrib op that no ORT graph transformer consumes or creates from other ops
(``TERMINAL_OPS``: the attention kernels and RotaryEmbedding our fusions build; target cpu) and the reference's
optimized graph holds none of it: ORT keeps such a node (unless dead), so the two graphs differ and the proof
could only say so after a session build, a save and a hash of the artifact. Were that reading of ORT wrong,
the cost is a timing where a proof would have spared one, never a wrong hand-back: "not proven" is timed.
"""

from __future__ import annotations

import functools
import hashlib
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx
from onnx import numpy_helper

from workers.sessions import make_session

# ORT writes the optimized graph as one protobuf file: models near the 2 GB protobuf limit are not proven.
MAX_PROVABLE_BYTES = 1 << 30
# com.microsoft kernels that ORT 1.32's CPU graph transformers neither take as a pattern's input nor build from
# other ops (its C++ AttentionFusion builds ``Attention``, so that one is not here; GroupQueryAttentionFusion,
# which folds RotaryEmbedding into GroupQueryAttention, is registered for CUDA only): in the artifact and absent
# from the reference's optimized graph, they stay in the artifact's on target cpu (module docstring). Checked on
# the corpus artifacts of DeiT and BART (MultiHeadAttention) and Phi-3 (GroupQueryAttention, RotaryEmbedding):
# every one of them is in ORT's optimized graph, as many as written.
TERMINAL_OPS = frozenset({"MultiHeadAttention", "GroupQueryAttention", "RotaryEmbedding"})
TERMINAL_TARGETS = frozenset({"cpu"})


class NotProvable(Exception):
    """The canonical form does not cover this graph: the gate times it instead."""


def _h(*parts: bytes | str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def _tensor_digest(tensor: onnx.TensorProto) -> str:
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        raise NotProvable(f"initializer {tensor.name!r} has external data")
    array = numpy_helper.to_array(tensor)
    return _h(str(tensor.data_type), repr(tuple(tensor.dims)), array.tobytes())


def _attribute_digest(attr: onnx.AttributeProto) -> str:
    if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        raise NotProvable(f"attribute {attr.name!r} holds a subgraph")
    if attr.type in (onnx.AttributeProto.SPARSE_TENSOR, onnx.AttributeProto.SPARSE_TENSORS):
        raise NotProvable(f"attribute {attr.name!r} holds a sparse tensor")
    if attr.type == onnx.AttributeProto.TENSOR:
        return _h(attr.name, "t", _tensor_digest(attr.t))
    if attr.type == onnx.AttributeProto.TENSORS:
        return _h(attr.name, "ts", *(_tensor_digest(t) for t in attr.tensors))
    plain = onnx.AttributeProto()
    plain.CopyFrom(attr)
    plain.doc_string = ""
    return _h(plain.SerializeToString(deterministic=True))


def _type_digest(value: onnx.ValueInfoProto) -> str:
    kind = onnx.TypeProto()
    kind.CopyFrom(value.type)
    _unname_dims(kind)
    return _h(kind.SerializeToString(deterministic=True))


def _unname_dims(kind: onnx.TypeProto) -> None:
    """Drops the names of symbolic dimensions: ORT's shape inference names the unnamed ones (``unk__0``), and the
    name of an input's free axis picks no kernel (what ORT builds from it shows in the optimized graph)."""
    for dim in kind.tensor_type.shape.dim:
        if dim.HasField("dim_param"):
            dim.ClearField("dim_param")
    for inner in (kind.sequence_type.elem_type, kind.optional_type.elem_type, kind.map_type.value_type):
        if inner.ByteSize():
            _unname_dims(inner)


def _domain(name: str) -> str:
    """ONNX's own domain under its one name: a node and the opset import may spell it "" or "ai.onnx"."""
    return name or "ai.onnx"


def _domains(graph: onnx.GraphProto | onnx.FunctionProto) -> set[str]:
    """The operator domains the nodes of ``graph`` use (a subgraph is NotProvable before this is asked)."""
    return {_domain(node.domain) for node in graph.node}


def program_digest(model: onnx.ModelProto) -> str:
    """The canonical digest of ``model``'s main graph (module docstring); raises NotProvable."""
    graph = model.graph
    if graph.sparse_initializer:
        raise NotProvable("the graph has sparse initializers")
    inputs = [i.name for i in graph.input]
    names: dict[str, str] = {name: _h("input", name) for name in inputs}
    for init in graph.initializer:
        if init.name not in names:  # an initializer also listed as an input is an input a caller may feed
            names[init.name] = _h("initializer", _tensor_digest(init))
    names[""] = _h("absent")  # an omitted optional input
    pending = list(graph.node)
    node_digests: list[str] = []
    while pending:  # Kahn-style: a node is hashed once all its inputs are; the file's order does not matter
        waiting = []
        for node in pending:
            if any(name not in names for name in node.input):
                waiting.append(node)
                continue
            attrs = sorted(_attribute_digest(a) for a in node.attribute)
            # Which output slots are wanted is part of the program: a kernel may compute an optional one or not.
            slots = "".join("1" if out else "0" for out in node.output)
            digest = _h(node.domain or "ai.onnx", node.op_type, slots, *attrs, "|", *(names[n] for n in node.input))
            node_digests.append(digest)
            for slot, out in enumerate(node.output):
                if out:
                    names[out] = _h(digest, str(slot))
        if len(waiting) == len(pending):
            raise NotProvable(f"node {waiting[0].op_type} reads a value no node or input produces")
        pending = waiting
    # An opset no node uses (one a clean-up pass dropped) changes no kernel ORT picks.
    used = _domains(graph) | {d for f in model.functions for d in _domains(f)}
    opsets = sorted(f"{_domain(o.domain)}:{o.version}" for o in model.opset_import if _domain(o.domain) in used)
    outputs = [_h(o.name, _type_digest(o), names.get(o.name, _h("missing", o.name))) for o in graph.output]
    ins = [_h(i.name, _type_digest(i)) for i in graph.input]
    return _h(str(model.ir_version), *opsets, "|in", *ins, "|out", *outputs, "|nodes", *sorted(node_digests))


def _check_size(path: Path) -> onnx.ModelProto:
    """The model at ``path`` (weights inline), or NotProvable when it is too large or keeps external data."""
    if path.stat().st_size > MAX_PROVABLE_BYTES:
        raise NotProvable("the model is over 1 GB")
    model = onnx.load(str(path), load_external_data=False)
    if any(init.data_location == onnx.TensorProto.EXTERNAL for init in model.graph.initializer):
        raise NotProvable("the model keeps its weights in external data")
    return model


def optimized_digest(path: Path, *, target: str, intra_op_threads: int) -> str:
    """Build ``path`` as ORT would run it on the target and return the canonical digest of that graph. Cached
    per file version: the gate may decide twice on the same reference (gate.decide_or_retry)."""
    st = path.stat()
    return _optimized(str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, target, intra_op_threads)[0]


def optimized_ops(path: Path, *, target: str, intra_op_threads: int) -> frozenset[tuple[str, str]]:
    """The (domain, op_type) pairs of the graph ORT runs for ``path`` (built, saved and cached with its digest)."""
    st = path.stat()
    return _optimized(str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, target, intra_op_threads)[1]


@functools.lru_cache(maxsize=8)
def _optimized(
    path_s: str, _ino: int, _size: int, _mtime_ns: int, target: str, intra_op_threads: int
) -> tuple[str, frozenset[tuple[str, str]]]:
    path = Path(path_s)
    _check_size(path)
    with tempfile.TemporaryDirectory(prefix="same-program-") as tmp:
        return _saved_digest(path, target=target, intra_op_threads=intra_op_threads, work=Path(tmp))


def _ops(graph: onnx.GraphProto) -> frozenset[tuple[str, str]]:
    return frozenset((node.domain or "ai.onnx", node.op_type) for node in graph.node)


def kept_only_by_artifact(reference_ops: frozenset[tuple[str, str]], artifact: onnx.ModelProto) -> list[str]:
    """The ``TERMINAL_OPS`` the artifact holds (main graph, as written) and the reference's optimized graph does
    not: ORT keeps them, so the optimized graphs cannot be equal."""
    return sorted(
        f"{domain}::{op}"
        for domain, op in _ops(artifact.graph) - reference_ops
        if domain == "com.microsoft" and op in TERMINAL_OPS
    )


def _saved_digest(
    path: Path, *, target: str, intra_op_threads: int, work: Path
) -> tuple[str, frozenset[tuple[str, str]]]:
    saved = work / f"{path.stem}.ort-optimized.onnx"
    try:
        session = make_session(
            path, target=target, intra_op_threads=intra_op_threads, optimize=True, save_optimized=saved
        )
    except Exception as exc:  # a compiled EP cannot save its graph; the timing decides then
        raise NotProvable(f"ORT could not save the optimized graph: {exc}") from exc
    del session
    if not saved.exists():
        raise NotProvable("ORT did not write the optimized graph")
    optimized = onnx.load(str(saved), load_external_data=False)
    return program_digest(optimized), _ops(optimized.graph)


def same_program(
    reference: Path,
    artifact: Path,
    *,
    target: str,
    intra_op_threads: int,
    recipe_b: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Whether ORT would run the same graph for both models: ``{"same": bool, "reason": str, "seconds": float}``.
    ``same`` is False for anything unproven (a session recipe on the artifact changes what ORT runs)."""
    start = time.perf_counter()
    if recipe_b:
        return {"same": False, "reason": "the artifact carries session options", "seconds": 0.0}
    try:
        a = optimized_digest(reference, target=target, intra_op_threads=intra_op_threads)
        kept = []
        if target in TERMINAL_TARGETS:
            reference_ops = optimized_ops(reference, target=target, intra_op_threads=intra_op_threads)
            kept = kept_only_by_artifact(reference_ops, _check_size(artifact))
        if kept:
            reason = f"the artifact holds {', '.join(kept)}, which ORT keeps and did not build for the reference"
            return {"same": False, "reason": reason, "seconds": time.perf_counter() - start}
        b = optimized_digest(artifact, target=target, intra_op_threads=intra_op_threads)
    except NotProvable as exc:
        return {"same": False, "reason": f"not provable: {exc}", "seconds": time.perf_counter() - start}
    reason = "equal optimized graphs" if a == b else "the optimized graphs differ"
    return {"same": a == b, "reason": reason, "seconds": time.perf_counter() - start}
