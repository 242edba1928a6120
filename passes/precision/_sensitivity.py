"""Which quantized nodes hurt accuracy most, and how few of them to keep in float.

* **Sensitivity ranking that scales.** Every quantized node is scored by the error it *introduces*: one probe
  model holds the original float graph plus, for every quantized node, a copy of the quantized subgraph ORT
  made for it (``DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul`` in the dynamic case,
  ``QuantizeLinear -> DequantizeLinear -> MatMul`` in the QDQ case) fed from the *float* values of the
  original graph. One session run per sample gives every node's local relative error, so the cost is one
  extra run, not one quantization per node (what "quantize one at a time" costs) and the score is not
  polluted by errors upstream (what comparing intermediate outputs of the quantized model gives).
* **Exclusion loop.** The worst nodes are excluded (kept float) in doubling steps (1, 2, 4, ...) up to
  ``max_exclusions``, then the smallest passing count is found by bisection, each step a fresh ORT
  quantization of the untouched input with ``nodes_to_exclude``.
* **Next-token search** (``flip_search``, quantize_int4): for a budget on the greedy tokens the weight error
  is the wrong ranking (see ``MarginLoss``); each node is measured alone in low precision by the top-1
  margin it takes from the positions that can flip, and the low-precision set grows greedily while the
  budget holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from passes.precision._accuracy import Budget, OutputAccuracy, TokenAccuracy, round_sig, save_proto, session, worst

_PROBE_PREFIX = "onnxforge_probe"
_MAX_PROBE_NODES = 64  # a walk longer than this is not one node's quantization: leave the node unranked


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
            "rel_l2": round_sig(self.rel_l2),
            "cosine": round_sig(self.cosine, 8),
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
        record: dict[str, Any] = {"excluded": k, "holds": not misses, "worst": worst(list(accuracy.values())).to_dict()}
        for a in accuracy.values():
            if isinstance(a, TokenAccuracy):
                record["top1_agreement"] = round_sig(a.top1_agreement, 6)
                record["flipped"] = a.flipped
        tried.append(record)
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


# ------------------------------------------------------------------ next-token (flip-driven) search


class MarginLoss:
    """How much a model's logits move the original's greedy tokens: per position, the top-1 margin lost
    (original margin minus the quantized model's margin of the original's token over the best other token),
    summed over the *fragile* positions, those whose original margin is below ``threshold``.

    A weight-error ranking (``rank_nodes``) misses what decides the budget of a language model: a small
    error on a layer that feeds a position with a near-tied top-2 flips the token, a large one elsewhere
    flips nothing. On the trained test decoder, one MatMul alone in int4 flips 3 to 22 of 1,024 greedy tokens
    and the per-MatMul weight error does not order them."""

    def __init__(self, reference: np.ndarray, threshold: float) -> None:
        self.top1 = reference.argmax(-1)
        self.margin = _margin_of(reference, self.top1)
        self.fragile = self.margin < threshold
        self.threshold = threshold

    def __call__(self, got: np.ndarray) -> float:
        lost = self.margin - _margin_of(got, self.top1)
        return float(np.maximum(lost, 0.0)[self.fragile].sum())


def _margin_of(logits: np.ndarray, token: np.ndarray) -> np.ndarray:
    rows = np.arange(len(logits))
    chosen = logits[rows, token].astype(np.float64)
    others = logits.astype(np.float64, copy=True)
    others[rows, token] = -np.inf
    return chosen - others.max(-1)


@dataclass
class Trial:
    """One model of the search: its int4 set's accuracy, margin loss and whether the budget holds."""

    int4: list[str]
    accuracy: dict[str, OutputAccuracy]
    loss: float
    misses: list[str]
    path: Path | None = None

    def record(self, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {**extra, "int4": len(self.int4), "holds": not self.misses}
        out["margin_loss"] = round_sig(self.loss)
        for a in self.accuracy.values():
            if isinstance(a, TokenAccuracy):
                out["top1_agreement"] = round_sig(a.top1_agreement, 6)
                out["flipped"] = a.flipped
        return out


@dataclass
class SearchOutcome:
    chosen: Trial | None  # the accepted mix (its int4 set), None when even no int4 misses the budget
    base: Trial | None  # the model with no int4
    ranking: list[dict[str, Any]]  # every candidate alone in int4: flips, margin loss, loss per weight
    trials: list[dict[str, Any]]
    stopped: str  # why the greedy walk ended


def flip_search(
    candidates: Sequence[str],
    weights: dict[str, int],
    trial: Callable[[list[str]], Trial],
    *,
    deadline: float,
    clock: Callable[[], float],
) -> SearchOutcome:
    """The largest int4 set (by weight) the budget allows, found greedily from the greedy tokens.

    ``trial(int4)`` quantizes exactly the nodes in ``int4`` to 4 bits (every other candidate 8-bit or
    float) and measures it. First the base (no int4) must hold, else nothing can. Then every candidate is
    measured alone in int4 (one teacher-forced pass each) and ranked by margin loss per weight element, the
    cheapest bytes first; walking that order, a candidate joins the int4 set when the set with it still
    holds the budget, else it stays 8-bit. 2n + 1 trials; past ``deadline`` the walk stops and what was
    accepted so far is kept (the notes say so)."""
    base = trial([])
    trials = [base.record(step="no int4")]
    if base.misses:
        return SearchOutcome(None, base, [], trials, "even with no MatMul in int4 the budget is missed")
    alone: list[tuple[float, str, Trial]] = []
    stopped = "every candidate tried"
    for name in candidates:
        if clock() > deadline:
            stopped = "time budget spent while ranking: unranked candidates stay 8-bit"
            break
        t = trial([name])
        alone.append((t.loss / max(weights[name], 1), name, t))
    alone.sort(key=lambda x: (bool(x[2].misses), x[0], x[1]))
    ranking = [
        {"node": name, **t.record(), "margin_loss_per_weight": round_sig(per_weight)} for per_weight, name, t in alone
    ]
    chosen = base
    for _, name, t in alone:
        if t.misses:
            continue  # alone it already misses: with others in int4 it cannot hold
        if clock() > deadline and stopped == "every candidate tried":
            stopped = "time budget spent during the greedy walk: the rest stay 8-bit"
            break
        # the first one's set (it alone) was measured while ranking
        step = trial([*chosen.int4, name]) if chosen.int4 else t
        trials.append(step.record(step=f"+ {name}"))
        if not step.misses:
            chosen = step
    return SearchOutcome(chosen, base, ranking, trials, stopped)
