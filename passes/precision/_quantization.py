"""Shared machinery of ``quantize_dynamic`` and ``quantize_static``: the ORT round trip, the accuracy
measurement, the per-node sensitivity ranking and the exclusion loop.

Both passes wrap ``onnxruntime.quantization`` (they never re-implement its quantizers) on a file in a
private temporary directory, and add what ORT leaves to the user (field.md §2 items 3, 5, 7):

* **Names are checked.** ``nodes_to_exclude`` must name graph nodes; ORT silently ignores unknown names, so
  users who pass module names (``bert.encoder.layer.0``, optimum #1418) get a model with nothing excluded.
  Here an unknown name refuses the pass with a ``NonMatch`` that lists close node names.
* **Accuracy is measured per output** (max abs, relative L2 error, cosine) on the context's samples, the
  original graph and the quantized one both run under ``ORT_DISABLE_ALL``.
* **Sensitivity ranking that scales.** When the outputs miss the pass's budget, every quantized node is
  scored by the error it *introduces*: one probe model holds the original float graph plus, for every
  quantized node, a copy of the quantized subgraph ORT made for it (``DynamicQuantizeLinear ->
  MatMulInteger -> Cast -> Mul`` in the dynamic case, ``QuantizeLinear -> DequantizeLinear -> MatMul`` in the
  QDQ case) fed from the *float* values of the original graph. One session run per sample gives every
  node's local relative error, so the cost is one extra run, not one quantization per node (what "quantize
  one at a time" costs) and the score is not polluted by errors upstream (what comparing intermediate
  outputs of the quantized model gives).
* **Exclusion loop.** The worst nodes are excluded (kept float) in doubling steps (1, 2, 4, ...) up to
  ``max_exclusions``, then the smallest passing count is found by bisection, each step a fresh ORT
  quantization of the untouched input with ``nodes_to_exclude``. The report names each excluded node and
  its error.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
import math
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from pydantic import Field

from passes._infra import NonMatch, PassOptions

# Weights above this go to external data in the temporary files (protobuf stops at 2 GiB).
EXTERNAL_DATA_BYTES = 1536 << 20
_PROBE_PREFIX = "onnxforge_probe"
_MAX_PROBE_NODES = 64  # a walk longer than this is not one node's quantization: leave the node unranked


class QuantizationOptions(PassOptions):
    """Options shared by both quantization passes."""

    per_channel: bool = Field(
        False,
        description="Quantize weights per output channel (one scale per column of a MatMul weight) instead of "
        "per tensor: more accurate, slightly slower to quantize; per-tensor is ORT's default.",
    )
    reduce_range: bool = Field(
        False,
        description="Quantize weights to 7 bits. Only useful on x86 CPUs without VNNI (AVX2 only), where the "
        "u8 x s8 multiply-add (vpmaddubsw) can saturate; VNNI/AVX-512 and ARM do not need it.",
    )
    nodes_to_exclude: list[str] = Field(
        default_factory=list,
        description="Node NAMES (graph node names, not framework module names) to keep in float. An unknown "
        "name refuses the pass, listing close node names.",
    )
    min_cosine: float = Field(
        0.99,
        ge=-1,
        le=1,
        description="Accuracy budget of the exclusion loop: least cosine similarity of every float output "
        "to the original's, on the samples. Set it to the job tolerance's min_cosine or stricter.",
    )
    max_rel_error: float | None = Field(
        None,
        gt=0,
        description="Accuracy budget of the exclusion loop: largest relative L2 error ||q - f|| / ||f|| of "
        "any float output (unset: not checked).",
    )
    max_abs_error: float | None = Field(
        None,
        gt=0,
        description="Accuracy budget of the exclusion loop: largest absolute difference of any output "
        "element (unset: not checked; int8 outputs of a 768-wide encoder differ by ~0.1).",
    )
    max_exclusions: int = Field(
        8,
        ge=0,
        description="Most nodes the exclusion loop may keep in float to meet the budget; 0 disables the loop "
        "(the budget is then only reported). If the budget is still missed, the pass changes nothing.",
    )
    max_samples: int = Field(
        8,
        ge=1,
        description="Samples (from the context) used to measure accuracy; the per-node ranking uses at most 2.",
    )
    preprocess: bool = Field(
        False,
        description="Run ORT's quant_pre_process (symbolic shape inference + ORT basic optimization) first. "
        "Off by default: it rewrites the graph outside the ledger and its symbolic shape inference fails on "
        "some exported graphs; the pipeline's shape_inference and constant_folding passes do the useful part.",
    )


# ------------------------------------------------------------------------------------------ accuracy


@dataclass
class OutputAccuracy:
    """How one output of the quantized model compares with the original's, worst over the samples."""

    max_abs: float = 0.0
    rel_l2: float = 0.0
    cosine: float = 1.0

    def to_dict(self) -> dict[str, float]:
        return {"max_abs": _round(self.max_abs), "rel_l2": _round(self.rel_l2), "cosine": _round(self.cosine, 8)}


def _round(x: float, digits: int = 4) -> float:
    if not math.isfinite(x) or x == 0:
        return float(x)
    return float(f"{x:.{digits}g}")


def compare_arrays(ref: np.ndarray, got: np.ndarray) -> OutputAccuracy:
    r = np.asarray(ref, dtype=np.float64).ravel()
    g = np.asarray(got, dtype=np.float64).ravel()
    if r.shape != g.shape:
        return OutputAccuracy(math.inf, math.inf, -1.0)
    if not r.size:
        return OutputAccuracy()
    diff = g - r
    if not np.all(np.isfinite(diff)):
        return OutputAccuracy(math.inf, math.inf, -1.0)
    nr, ng = float(np.linalg.norm(r)), float(np.linalg.norm(g))
    max_abs = float(np.abs(diff).max())
    rel = float(np.linalg.norm(diff)) / nr if nr else (0.0 if not ng else math.inf)
    cosine = float(np.dot(r, g)) / (nr * ng) if nr and ng else (1.0 if nr == ng else 0.0)
    return OutputAccuracy(max_abs, rel, cosine)


def worst(acc: Sequence[OutputAccuracy]) -> OutputAccuracy:
    return OutputAccuracy(
        max((a.max_abs for a in acc), default=0.0),
        max((a.rel_l2 for a in acc), default=0.0),
        min((a.cosine for a in acc), default=1.0),
    )


@dataclass
class Budget:
    min_cosine: float
    max_rel_error: float | None
    max_abs_error: float | None

    @classmethod
    def of(cls, options: QuantizationOptions) -> Budget:
        return cls(options.min_cosine, options.max_rel_error, options.max_abs_error)

    def misses(self, accuracy: dict[str, OutputAccuracy]) -> list[str]:
        """Why ``accuracy`` misses the budget, one line per failed output and criterion; empty when it holds."""
        problems = []
        for name, a in accuracy.items():
            if a.cosine < self.min_cosine:
                problems.append(f"{name}: cosine {a.cosine:.6f} < {self.min_cosine}")
            if self.max_rel_error is not None and a.rel_l2 > self.max_rel_error:
                problems.append(f"{name}: relative L2 error {a.rel_l2:.4g} > {self.max_rel_error}")
            if self.max_abs_error is not None and a.max_abs > self.max_abs_error:
                problems.append(f"{name}: max abs error {a.max_abs:.4g} > {self.max_abs_error}")
        return problems

    def to_dict(self) -> dict[str, Any]:
        return {"min_cosine": self.min_cosine, "max_rel_error": self.max_rel_error, "max_abs_error": self.max_abs_error}


# --------------------------------------------------------------------------------------- ORT helpers


@contextlib.contextmanager
def quiet_ort_quantization() -> Iterator[None]:
    """Silence ``onnxruntime.quantization``'s advice (``logging.warning`` on every call) and its prints."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)


def session(path: Path, threads: int = 0) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feeds_for(sess: Any, samples: Sequence[dict[str, np.ndarray]], limit: int) -> list[dict[str, np.ndarray]]:
    """The samples that give every input of ``sess``, restricted to its inputs, at most ``limit``."""
    names = [i.name for i in sess.get_inputs()]
    feeds = [{n: s[n] for n in names} for s in samples if all(n in s for n in names)]
    return feeds[:limit]


def float_outputs(sess: Any) -> list[str]:
    return [o.name for o in sess.get_outputs() if o.type in ("tensor(float)", "tensor(float16)", "tensor(double)")]


def run_outputs(path: Path, feeds: Sequence[dict[str, np.ndarray]], names: Sequence[str]) -> list[list[np.ndarray]]:
    sess = session(path)
    return [sess.run(list(names), f) for f in feeds]


def measure(
    path: Path, feeds: Sequence[dict[str, np.ndarray]], names: Sequence[str], reference: list[list[np.ndarray]]
) -> dict[str, OutputAccuracy]:
    """Per-output accuracy of the model at ``path`` against the reference outputs, worst over the feeds."""
    got = run_outputs(path, feeds, names)
    return {
        name: worst([compare_arrays(ref[i], out[i]) for ref, out in zip(reference, got, strict=True)])
        for i, name in enumerate(names)
    }


def tensor_bytes(proto: onnx.ModelProto) -> int:
    total = 0
    for init in proto.graph.initializer:
        n = 1
        for d in init.dims:
            n *= d
        total += n * max(1, onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize)
    return total


def save_proto(proto: onnx.ModelProto, path: Path, large: bool) -> None:
    if large:
        onnx.save_model(proto, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(proto, str(path))


def load_ir(path: Path) -> ir.Model:
    """Load a model with its external data into memory (the temporary directory is about to go)."""
    return ir.serde.deserialize_model(onnx.load(str(path), load_external_data=True))


def unchanged(model: ir.Model) -> ir.Model:
    """For an unmodified functional result: a new Model object over the same graph (the ledger discards it)."""
    return ir.Model(
        model.graph,
        ir_version=model.ir_version,
        producer_name=model.producer_name,
        producer_version=model.producer_version,
        domain=model.domain,
        model_version=model.model_version,
        doc_string=model.doc_string,
        functions=list(model.functions.values()),
        metadata_props=dict(model.metadata_props),
    )


def maybe_preprocess(src: Path, dst: Path, notes: dict[str, Any]) -> Path:
    """ORT's ``quant_pre_process`` on ``src``; on failure the original is used and the note says why."""
    from onnxruntime.quantization import quant_pre_process

    try:
        with quiet_ort_quantization():
            quant_pre_process(str(src), str(dst), skip_symbolic_shape=False)
    except Exception as exc:  # symbolic shape inference fails on some graphs (field.md §2 item 8)
        notes["preprocess"] = f"quant_pre_process failed, quantized without it: {type(exc).__name__}: {exc}"[:500]
        return src
    notes["preprocess"] = "applied (symbolic shape inference + ORT basic optimization)"
    return dst


# ------------------------------------------------------------------------------------ node checking


def node_names(model: ir.Model) -> list[str]:
    return [n.name for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.name]


def unknown_node_names(model: ir.Model, names: Sequence[str]) -> list[NonMatch]:
    """A NonMatch per name in ``names`` that is no node's name, with close node names as hints."""
    known = node_names(model)
    known_set = set(known)
    refusals = []
    for name in names:
        if name in known_set:
            continue
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.4)
        hint = f"; close node names: {', '.join(close)}" if close else ""
        refusals.append(
            NonMatch(
                reason=f"nodes_to_exclude names no node: {name!r}. It takes graph node names (see the model's "
                f"nodes), not framework module or parameter names{hint}",
                node=name,
            )
        )
    return refusals


# ------------------------------------------------------------------------------- sensitivity ranking


@dataclass
class NodeError:
    node: str
    op_type: str
    rel_l2: float
    cosine: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "op_type": self.op_type,
            "rel_l2": _round(self.rel_l2),
            "cosine": _round(self.cosine, 8),
        }


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output if out}


def build_probe(
    original: onnx.ModelProto, quantized: onnx.ModelProto, nodes: Sequence[str]
) -> tuple[onnx.ModelProto, dict[str, tuple[str, str]], list[str]]:
    """The original graph plus, for every node in ``nodes``, a copy of its quantized form fed from the
    original graph's float values.

    Returns the probe model, ``{node: (reference output, probe output)}`` and the nodes left unranked."""
    orig_graph, q_graph = original.graph, quantized.graph
    orig_values = {v for n in orig_graph.node for v in n.output} | {i.name for i in orig_graph.input}
    orig_values |= {i.name for i in orig_graph.initializer}
    orig_nodes = {n.name: n for n in orig_graph.node if n.name}
    q_producers = _producers(q_graph)
    q_inits = {i.name: i for i in q_graph.initializer}
    probe = onnx.ModelProto()
    probe.CopyFrom(original)
    del probe.graph.output[:]
    have_inits = {i.name for i in probe.graph.initializer}
    pairs: dict[str, tuple[str, str]] = {}
    unranked: list[str] = []
    for index, name in enumerate(nodes):
        node = orig_nodes.get(name)
        if node is None or not node.output or not node.output[0]:
            unranked.append(name)
            continue
        target = node.output[0]
        start = q_producers.get(target)
        if start is None:
            unranked.append(name)
            continue
        # Walk back from the quantized producer of the node's output to values the original graph has.
        walked: list[onnx.NodeProto] = []
        seen: set[int] = set()
        stack = [start]
        ok = True
        while stack:
            current = stack.pop()
            if id(current) in seen:
                continue
            seen.add(id(current))
            walked.append(current)
            if len(walked) > _MAX_PROBE_NODES:
                ok = False
                break
            for value in current.input:
                if not value or value in orig_values or value in q_inits:
                    continue
                producer = q_producers.get(value)
                if producer is None:
                    ok = False  # a value neither original nor produced: cannot rebuild
                    break
                stack.append(producer)
            if not ok:
                break
        if not ok:
            unranked.append(name)
            continue
        prefix = f"{_PROBE_PREFIX}/{index}/"
        local = {out for n in walked for out in n.output if out}

        def rename(value: str, local: set[str] = local, prefix: str = prefix) -> str:
            return prefix + value if value in local else value

        position = {id(n): i for i, n in enumerate(q_graph.node)}
        for q_node in sorted(walked, key=lambda n: position[id(n)]):
            copy = onnx.NodeProto()
            copy.CopyFrom(q_node)
            copy.name = prefix + (q_node.name or q_node.op_type)
            copy.input[:] = [rename(v) for v in q_node.input]
            copy.output[:] = [rename(v) for v in q_node.output]
            probe.graph.node.append(copy)
            for value in q_node.input:
                if value in q_inits and value not in have_inits:
                    probe.graph.initializer.append(q_inits[value])
                    have_inits.add(value)
        pairs[name] = (target, prefix + target)
    seen_outputs: set[str] = set()
    for ref, got in pairs.values():
        for value in (ref, got):
            if value not in seen_outputs:
                probe.graph.output.append(onnx.helper.make_empty_tensor_value_info(value))
                seen_outputs.add(value)
    domains = {o.domain: o.version for o in probe.opset_import}
    for opset in quantized.opset_import:
        if opset.domain not in domains or domains[opset.domain] < opset.version:
            domains[opset.domain] = opset.version
    del probe.opset_import[:]
    probe.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in sorted(domains.items()))
    return probe, pairs, unranked


def rank_nodes(
    original: onnx.ModelProto,
    quantized: onnx.ModelProto,
    nodes: Sequence[str],
    feeds: Sequence[dict[str, np.ndarray]],
    *,
    workdir: Path,
    large: bool,
) -> tuple[list[NodeError], list[str]]:
    """Every node in ``nodes`` scored by the relative L2 error its quantization introduces, worst first."""
    probe, pairs, unranked = build_probe(original, quantized, nodes)
    if not pairs:
        return [], unranked
    path = workdir / "probe.onnx"
    save_proto(probe, path, large)
    del probe
    sess = session(path)
    op_types = {n.name: n.op_type for n in original.graph.node}
    names = sorted({v for pair in pairs.values() for v in pair})
    diff_sq = dict.fromkeys(pairs, 0.0)
    ref_sq = dict.fromkeys(pairs, 0.0)
    got_sq = dict.fromkeys(pairs, 0.0)
    dot = dict.fromkeys(pairs, 0.0)
    for feed in feeds:
        values = dict(zip(names, sess.run(names, feed), strict=True))
        for node, (ref_name, got_name) in pairs.items():
            r = values[ref_name].astype(np.float64).ravel()
            g = values[got_name].astype(np.float64).ravel()
            diff_sq[node] += float(np.dot(g - r, g - r))
            ref_sq[node] += float(np.dot(r, r))
            got_sq[node] += float(np.dot(g, g))
            dot[node] += float(np.dot(r, g))
    del sess
    errors = []
    for node in pairs:
        rel = math.sqrt(diff_sq[node] / ref_sq[node]) if ref_sq[node] else (0.0 if not diff_sq[node] else math.inf)
        denom = math.sqrt(ref_sq[node] * got_sq[node])
        cosine = dot[node] / denom if denom else 1.0
        if not math.isfinite(rel):
            rel = math.inf
        errors.append(NodeError(node, op_types.get(node, "?"), rel, cosine))
    errors.sort(key=lambda e: (-e.rel_l2, e.node))
    return errors, unranked


# ------------------------------------------------------------------------------------ exclusion loop


@dataclass
class LoopOutcome:
    path: Path | None  # the accepted quantized model, None when the budget was never met
    accuracy: dict[str, OutputAccuracy]
    excluded: list[NodeError] = field(default_factory=list)
    tried: list[dict[str, Any]] = field(default_factory=list)


def exclusion_loop(
    ranking: Sequence[NodeError],
    quantize: Callable[[list[str], str], Path],
    evaluate: Callable[[Path], dict[str, OutputAccuracy]],
    budget: Budget,
    max_exclusions: int,
) -> LoopOutcome:
    """Exclude the worst ``k`` nodes of ``ranking`` for k = 1, 2, 4, ... <= max_exclusions until the budget
    holds, then bisect down to the smallest k that holds. Each trial is a fresh quantization."""
    limit = min(max_exclusions, len(ranking))
    tried: list[dict[str, Any]] = []
    results: dict[int, tuple[Path, dict[str, OutputAccuracy]]] = {}

    def trial(k: int) -> bool:
        path = quantize([e.node for e in ranking[:k]], f"exclude{k}")
        accuracy = evaluate(path)
        misses = budget.misses(accuracy)
        tried.append({"excluded": k, "holds": not misses, "worst": worst(list(accuracy.values())).to_dict()})
        results[k] = (path, accuracy)
        return not misses

    passing, failing = None, 0
    k = 1
    while k <= limit:
        if trial(k):
            passing = k
            break
        failing = k
        k = limit if k < limit < 2 * k else 2 * k
    if passing is None:
        last = max(results) if results else 0
        return LoopOutcome(None, results[last][1] if results else {}, list(ranking[:last]), tried)
    lo, hi = failing, passing  # lo fails (0 = the full quantization, known to fail), hi holds
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if trial(mid):
            hi = mid
        else:
            lo = mid
    path, accuracy = results[hi]
    return LoopOutcome(path, accuracy, list(ranking[:hi]), tried)


def workdir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="onnxforge-quant-")


# ------------------------------------------------------------------------------------------- driver


@dataclass
class Quantized:
    """What a driver run produced, for the pass to turn into a PassResult."""

    model: ir.Model | None  # None: nothing to hand back (the reason is in non_matches)
    counts: dict[str, int]
    non_matches: list[NonMatch]
    notes: dict[str, Any]


def drive(
    model: ir.Model,
    samples: Sequence[dict[str, np.ndarray]],
    options: QuantizationOptions,
    *,
    candidates: Sequence[str],
    quantize: Callable[[Path, Path, list[str], bool], None],
    quantized_nodes: Callable[[onnx.ModelProto, onnx.ModelProto, Sequence[str]], list[str]],
    notes: dict[str, Any],
    prepare: Callable[[Path, Path, bool], None] | None = None,
) -> Quantized:
    """Quantize ``model`` with ``quantize(src, dst, nodes_to_exclude, large)`` and run the accuracy loop.

    ``candidates``: names of the nodes the quantizer may touch (for the ranking); ``quantized_nodes`` tells
    which of them the quantized proto actually quantized; ``prepare(src, workdir, large)`` runs once before
    the first quantization (static calibration)."""
    budget = Budget.of(options)
    non_matches: list[NonMatch] = []
    user_excluded = list(options.nodes_to_exclude)
    original = ir.serde.serialize_model(model)
    large = tensor_bytes(original) > EXTERNAL_DATA_BYTES
    notes["external_data"] = large
    with workdir() as tmp:
        work = Path(tmp)
        src = work / "input.onnx"
        save_proto(original, src, large)
        if options.preprocess:
            src = maybe_preprocess(src, work / "preprocessed.onnx", notes)
            if src.name == "preprocessed.onnx":
                original = onnx.load(str(src), load_external_data=True)
        if prepare is not None:
            prepare(src, work, large)

        def quantize_to(excluded: list[str], tag: str) -> Path:
            dst = work / f"{tag}.onnx"
            with quiet_ort_quantization():
                quantize(src, dst, [*user_excluded, *excluded], large)
            return dst

        first = quantize_to([], "quantized")
        q_proto = onnx.load(str(first), load_external_data=False)
        done = quantized_nodes(original, q_proto, candidates)
        if not done:
            non_matches.append(NonMatch(f"ORT quantized none of the {len(candidates)} candidate node(s)"))
            return Quantized(None, {"nodes_quantized": 0}, non_matches, notes)
        counts = {"nodes_quantized": len(done), "nodes_excluded_by_user": len(user_excluded)}
        notes["nodes_quantized"] = len(done)
        notes["budget"] = budget.to_dict()
        chosen = first
        ref_sess = session(src)
        feeds = feeds_for(ref_sess, samples, options.max_samples)
        outputs = float_outputs(ref_sess)
        del ref_sess
        if not feeds or not outputs:
            notes["accuracy"] = "not measured: no samples give every input" if not feeds else "no float output"
            notes["decision"] = f"quantized {len(done)} node(s); accuracy left to the ledger's verification"
        else:
            notes["samples_used"] = len(feeds)
            reference = run_outputs(src, feeds, outputs)

            def evaluate(path: Path) -> dict[str, OutputAccuracy]:
                return measure(path, feeds, outputs, reference)

            accuracy = evaluate(first)
            notes["accuracy_all_quantized"] = {k: v.to_dict() for k, v in accuracy.items()}
            misses = budget.misses(accuracy)
            if not misses:
                notes["accuracy"] = notes["accuracy_all_quantized"]
                notes["decision"] = f"quantized {len(done)} node(s) within the accuracy budget"
            elif options.max_exclusions == 0:
                non_matches.append(NonMatch("accuracy budget missed and max_exclusions is 0: " + "; ".join(misses)))
                notes["decision"] = "refused: accuracy budget missed"
                return Quantized(None, counts, non_matches, notes)
            else:
                q_full = onnx.load(str(first), load_external_data=True)
                ranking, unranked = rank_nodes(original, q_full, done, feeds[:2], workdir=work, large=large)
                del q_full
                notes["node_errors_top"] = [e.to_dict() for e in ranking[:10]]
                if unranked:
                    notes["unranked_nodes"] = unranked[:20]
                outcome = exclusion_loop(ranking, quantize_to, evaluate, budget, options.max_exclusions)
                notes["exclusion_trials"] = outcome.tried
                notes["accuracy"] = {k: v.to_dict() for k, v in outcome.accuracy.items()}
                notes["excluded_for_accuracy"] = [e.to_dict() for e in outcome.excluded]
                if outcome.path is None:
                    reason = (
                        f"accuracy budget missed even with the {len(outcome.excluded)} most sensitive node(s) in "
                        f"float (max_exclusions={options.max_exclusions}): "
                        + "; ".join(budget.misses(outcome.accuracy) or misses)
                    )
                    non_matches.append(NonMatch(reason))
                    notes["decision"] = "refused: accuracy budget missed"
                    return Quantized(None, counts, non_matches, notes)
                chosen = outcome.path
                q_proto = onnx.load(str(chosen), load_external_data=False)
                kept = {e.node for e in outcome.excluded}
                done = [n for n in quantized_nodes(original, q_proto, candidates) if n not in kept]
                counts["nodes_quantized"] = notes["nodes_quantized"] = len(done)
                counts["nodes_excluded_for_accuracy"] = len(outcome.excluded)
                notes["decision"] = (
                    f"quantized {len(done)} node(s); kept {len(outcome.excluded)} in float to meet the budget: "
                    + ", ".join(f"{e.node} (rel err {e.rel_l2:.3g})" for e in outcome.excluded)
                )
        result = load_ir(chosen)
    notes["op_types_after"] = dict(sorted(_op_counts(result).items()))
    return Quantized(result, counts, non_matches, notes)


def _op_counts(model: ir.Model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        if key in _QUANT_OPS:
            counts[key] = counts.get(key, 0) + 1
    return counts


_QUANT_OPS = {
    "DynamicQuantizeLinear",
    "MatMulInteger",
    "ConvInteger",
    "QuantizeLinear",
    "DequantizeLinear",
    "com.microsoft::QAttention",
    "com.microsoft::DynamicQuantizeMatMul",
    "com.microsoft::DynamicQuantizeLSTM",
    "com.microsoft::QEmbedLayerNormalization",
    "com.microsoft::QGemm",
    "com.microsoft::MatMulIntegerToFloat",
    "com.microsoft::QuantizeLinear",
    "com.microsoft::DequantizeLinear",
}
