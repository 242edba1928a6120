"""The driver ``quantize_dynamic`` and ``quantize_static`` share: the ORT round trip, node-name checking and
the accuracy loop.

Both passes wrap ``onnxruntime.quantization`` (they never re-implement its quantizers) on a file in a
private temporary directory, and add what ORT leaves to the user: checked names, measured accuracy and the
exclusion of sensitive nodes.

* **Names are checked.** ``nodes_to_exclude`` must name graph nodes; ORT silently ignores unknown names, so
  users who pass module names (``bert.encoder.layer.0``, optimum #1418) get a model with nothing excluded.
  Here an unknown name refuses the pass with a ``NonMatch`` that lists close node names.
* **Accuracy is measured per output** (max abs, relative L2 error, cosine) on the context's samples, the
  original graph and the quantized one both run under ``ORT_DISABLE_ALL`` (``_accuracy.py``), and held to
  the job's tolerance as the engine's verification will (the share of elements outside atol + rtol * |ref|):
  a budget that ignored it handed back results the engine then rolled back.
* **Language models are also judged by their next token**: where the graph has a logits output and the
  samples carry token ids, the budget can require a least share of teacher-forced greedy tokens unchanged
  (``min_top1_agreement``) and a most perplexity increase (``max_perplexity_increase``); see ``_accuracy.py``
  for the sequences used.
* **When the budget is missed**, quantized nodes are ranked by the error each introduces and the worst are
  kept in float, as few as the budget allows (``_sensitivity.py``). The report names each excluded node
  and its error.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from pydantic import Field

from core.config import Tolerance
from core.inputs import InputRole, analyze
from passes._infra import NonMatch, OptionsT, PassOptions, PassResult
from passes.precision._accuracy import (
    Budget,
    OutputAccuracy,
    Texts,
    TokenProbe,
    feeds_for,
    float_outputs,
    load_ir,
    logits_output,
    measure,
    round_sig,
    run_outputs,
    sample_texts,
    save_proto,
    session,
)
from passes.precision._sensitivity import (
    MarginLoss,
    SearchOutcome,
    Trial,
    exclusion_loop,
    flip_search,
    rank_nodes,
)

# Weights above this go to external data in the temporary files (protobuf stops at 2 GiB).
EXTERNAL_DATA_BYTES = 1536 << 20


def tolerance_field() -> Any:
    """The ``tolerance`` option of the quantization passes (one description for all)."""
    return Field(
        None,
        description="Accuracy budget: the element tolerance every float output must meet on the samples (at most "
        "max_mismatch_ratio of its elements outside atol + rtol * |ref|, and min_cosine), as the job's "
        "verification reads it. Unset: the job's tolerance, which the engine holds the result to (outside the "
        "engine: not checked).",
    )


def with_job_tolerance(options: OptionsT, tolerance: Tolerance | None) -> OptionsT:
    """``options`` with ``tolerance`` (the context's: the job's) where the user set none."""
    if getattr(options, "tolerance", None) is not None or tolerance is None:
        return options
    return options.model_copy(update={"tolerance": tolerance})


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
    min_top1_agreement: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Accuracy budget for language models: least share of positions whose greedy next token "
        "(argmax of the logits output, teacher-forced on the samples' token ids, a KV-cache decoder fed each "
        "sample as a prefill) is the original's (unset: not checked; no logits output or token ids: noted).",
    )
    max_perplexity_increase: float | None = Field(
        None,
        ge=0,
        description="Accuracy budget for language models: largest relative increase of the perplexity of the "
        "samples' own token sequences (0.05: +5%). Meaningful when the samples are real text (unset: reported).",
    )
    tolerance: Tolerance | None = tolerance_field()
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


def tensor_bytes(proto: onnx.ModelProto) -> int:
    total = 0
    for init in proto.graph.initializer:
        n = 1
        for d in init.dims:
            n *= d
        total += n * max(1, onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize)
    return total


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
    except Exception as exc:  # ORT's symbolic shape inference fails on some exported graphs
        notes["preprocess"] = f"quant_pre_process failed, quantized without it: {type(exc).__name__}: {exc}"[:500]
        return src
    notes["preprocess"] = "applied (symbolic shape inference + ORT basic optimization)"
    return dst


# ------------------------------------------------------------------------------------ node checking


def node_names(model: ir.Model) -> list[str]:
    return [n.name for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.name]


def refused(model: ir.Model, reasons: list[NonMatch]) -> PassResult:
    """A quantization pass's answer when it will not run on this model (an unknown node name, no samples)."""
    return PassResult(unchanged(model), False, {"nodes_quantized": 0}, reasons, {"decision": "refused"})


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


def unique_name(taken: Mapping[str, Any], name: str) -> str:
    """``name``, or ``name_1``, ``name_2``... the first one ``taken`` (initializers by name) does not hold."""
    out, i = name, 0
    while out in taken:
        i += 1
        out = f"{name}_{i}"
    return out


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
    kept_as: str = "float",
    texts: Texts | None = None,
) -> Quantized:
    """Quantize ``model`` with ``quantize(src, dst, nodes_to_exclude, large)`` and run the accuracy loop.

    ``candidates``: names of the nodes the quantizer may touch (for the ranking); ``quantized_nodes`` tells
    which of them the quantized proto actually quantized; ``prepare(src, workdir, large)`` runs once before
    the first quantization (static calibration); ``kept_as`` names what the pass's ``quantize`` makes of the
    nodes the loop excludes (float, or int8 for quantize_int4), for the notes."""
    budget = budget_of(options)
    logits = logits_output(model)
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
        probe = TokenProbe.build(src, logits, samples, options.max_samples, analyze(model).roles, texts=texts)
        note_probe(notes, budget, logits, probe)
        if (not feeds or not outputs) and probe is None:
            notes["accuracy"] = "not measured: no samples give every input" if not feeds else "no float output"
            notes["decision"] = f"quantized {len(done)} node(s); accuracy left to the ledger's verification"
        else:
            notes["samples_used"] = len(feeds)
            if not feeds or not outputs:  # only the next-token figures are measured
                feeds, outputs = [], []
            reference = run_outputs(src, feeds, outputs)

            def evaluate(path: Path) -> dict[str, OutputAccuracy]:
                return measure(path, feeds, outputs, reference, probe, elements=budget.elements)

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
                rank_feeds = feeds[:2] or (probe.feeds[:2] if probe is not None else [])
                ranking, unranked = rank_nodes(original, q_full, done, rank_feeds, workdir=work, large=large)
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
                        f"{kept_as} (max_exclusions={options.max_exclusions}): "
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
                    f"quantized {len(done)} node(s); kept {len(outcome.excluded)} in {kept_as} to meet the budget: "
                    + ", ".join(f"{e.node} (rel err {e.rel_l2:.3g})" for e in outcome.excluded)
                )
        result = load_ir(chosen)
    notes["op_types_after"] = dict(sorted(_op_counts(result).items()))
    return Quantized(result, counts, non_matches, notes)


def drawn_texts(
    model: ir.Model,
    samples: Sequence[dict[str, np.ndarray]],
    limit: int,
    *,
    logits: str | None,
    roles: Mapping[str, InputRole],
) -> Texts:
    """``sample_texts`` of ``model`` (written to a temporary file for ORT) at the samples' shapes; ``logits`` and
    ``roles`` are the model's (``logits_output``, ``core.inputs.analyze``), as the caller read them."""
    proto = ir.serde.serialize_model(model)
    with workdir() as tmp:
        src = Path(tmp) / "model.onnx"
        save_proto(proto, src, tensor_bytes(proto) > EXTERNAL_DATA_BYTES)
        del proto
        return sample_texts(src, logits, samples, limit, roles)


def budget_of(options: QuantizationOptions) -> Budget:
    return Budget(
        options.min_cosine,
        options.max_rel_error,
        options.max_abs_error,
        options.min_top1_agreement,
        options.max_perplexity_increase,
        options.tolerance,
    )


def note_probe(notes: dict[str, Any], budget: Budget, logits: str | None, probe: TokenProbe | None) -> None:
    """Say in the notes which token sequences the next-token figures use, or why there are none."""
    if probe is not None and probe.drawn is not None:
        notes["next_token"] = {
            "logits": probe.logits,
            "sequences": f"{probe.drawn}, each fed as a prefill under teacher forcing"
            + (
                f" (the encoder's context whole: {len(probe.encoder)} input(s) over its sequence)"
                if probe.encoder
                else ""
            )
            + "; the samples' token ids are generated, not text",
        }
        return
    if probe is not None:
        positions = sum(int(np.asarray(f[probe.token]).size) for f in probe.feeds)
        notes["next_token"] = {
            "logits": probe.logits,
            "sequences": f"{len(probe.feeds)} sample(s) of the context, {positions} token(s), "
            + (
                "the samples as they are (their cache cannot be emptied)"
                if not probe.as_prefill
                else "each fed as a prefill (empty self-attention cache, the encoder's context whole: "
                f"{len(probe.encoder)} input(s) over its sequence) under teacher forcing"
                if probe.encoder
                else "each fed as a prefill (empty cache) under teacher forcing"
            ),
        }
        return
    why = "no logits output (no float output an LM head reaches)" if logits is None else "no sample carries token ids"
    notes["next_token"] = f"not measured: {why}"
    if budget.min_top1_agreement is not None or budget.max_perplexity_increase is not None:
        notes["next_token"] += "; the top-1 and perplexity budget is not applied"


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


def drive_next_token(
    model: ir.Model,
    samples: Sequence[dict[str, np.ndarray]],
    options: QuantizationOptions,
    *,
    candidates: Sequence[str],
    weights: dict[str, int],
    quantize: Callable[[Path, Path, list[str], bool], None],
    notes: dict[str, Any],
    kept_as: str,
    search_seconds: float,
    texts: Texts | None = None,
) -> Quantized | None:
    """``drive`` for a budget on the greedy tokens: the mix is searched by what each node does to them
    (``_sensitivity.flip_search``), not by its weight error. None when no probe can be built (no logits
    output, no sample with token ids): the caller falls back to ``drive``.

    ``quantize(src, dst, kept, large)`` quantizes every candidate to 4 bits but those in ``kept``."""
    budget = budget_of(options)
    original = ir.serde.serialize_model(model)
    large = tensor_bytes(original) > EXTERNAL_DATA_BYTES
    user_excluded = list(options.nodes_to_exclude)
    with workdir() as tmp:
        work = Path(tmp)
        src = work / "input.onnx"
        save_proto(original, src, large)
        roles = analyze(model).roles
        probe = TokenProbe.build(src, logits_output(model), samples, options.max_samples, roles, texts=texts)
        if probe is None:
            return None
        ref_sess = session(src)
        feeds = feeds_for(ref_sess, samples, options.max_samples)
        outputs = float_outputs(ref_sess)
        del ref_sess
        reference = run_outputs(src, feeds, outputs)
        notes["external_data"] = large
        notes["budget"] = budget.to_dict()
        notes["samples_used"] = len(feeds)
        note_probe(notes, budget, probe.logits, probe)
        reference_positions = probe.positions(probe.reference)
        loss: list[MarginLoss] = []
        count = [0]

        # Two quantizations, then every trial is assembled from them: ORT's quantizer on a large model takes
        # longer than the teacher-forced run that judges it, and the search makes 2n + 1 trials.
        low_path, kept_path = work / "all_low.onnx", work / "all_kept.onnx"
        with quiet_ort_quantization():
            quantize(src, low_path, user_excluded, large)
            quantize(src, kept_path, [*user_excluded, *candidates], large)
        low = onnx.load(str(low_path), load_external_data=True)
        all_kept = onnx.load(str(kept_path), load_external_data=True)
        produces = {n.name: n.output[0] for n in original.graph.node if n.name in set(candidates) and n.output}

        def trial(int4: list[str]) -> Trial:
            count[0] += 1
            path = work / f"trial{count[0]}.onnx"
            keep = {produces[c] for c in candidates if c not in int4 and c in produces}
            save_proto(assemble(low, all_kept, keep), path, large)
            accuracy = measure(path, feeds, outputs, reference, elements=budget.elements)
            got = probe.run(path)
            accuracy[probe.key] = probe.figures(got)
            score = loss[0](probe.positions(got)) if loss else 0.0
            return Trial(list(int4), accuracy, score, budget.misses(accuracy), path)

        full = trial(list(candidates))
        notes["accuracy_all_quantized"] = {k: v.to_dict() for k, v in full.accuracy.items()}
        counts = {"nodes_quantized": len(candidates), "nodes_excluded_by_user": len(user_excluded)}
        chosen = full
        if full.misses and options.max_exclusions == 0:
            reason = "accuracy budget missed and max_exclusions is 0: " + "; ".join(full.misses)
            notes["decision"] = "refused: accuracy budget missed"
            return Quantized(None, counts, [NonMatch(reason)], notes)
        if full.misses:
            # A position whose top-2 are closer than full int4's largest logit move can flip: those are scored.
            loss.append(MarginLoss(reference_positions, float(full.accuracy[probe.key].max_abs)))
            clock = time.monotonic
            outcome = flip_search(candidates, weights, trial, deadline=clock() + search_seconds, clock=clock)
            notes["search"] = {
                "by": "next-token margin loss of each MatMul alone in int4, least per weight first, added while "
                "the budget holds",
                "fragile_positions": int(loss[0].fragile.sum()),
                "fragile_margin_below": round_sig(loss[0].threshold),
                "stopped": outcome.stopped,
                "ranking": outcome.ranking,
                "trials": outcome.trials,
            }
            picked = outcome.chosen
            kept = [c for c in candidates if picked is None or c not in picked.int4]
            notes["excluded_for_accuracy"] = [{"node": c} for c in kept]
            failure = None
            if picked is None:
                failure = f"accuracy budget missed even with all {len(candidates)} MatMul(s) in {kept_as}: "
                failure += "; ".join(budget.misses(_first_trial(outcome, full)))
            elif not picked.int4:
                failure = f"no MatMul could stay int4 within the budget (the rest {kept_as}; {outcome.stopped}); "
                failure += "full int4: " + "; ".join(full.misses)
            elif options.max_exclusions is not None and len(kept) > options.max_exclusions:
                failure = (
                    f"accuracy budget missed even with the {options.max_exclusions} most sensitive MatMul(s) in "
                    f"{kept_as} (max_exclusions={options.max_exclusions}); it holds with {len(kept)}: "
                    + "; ".join(full.misses)
                )
            if failure is not None:
                notes["accuracy"] = {k: v.to_dict() for k, v in full.accuracy.items()}
                notes["decision"] = "refused: accuracy budget missed"
                return Quantized(None, counts, [NonMatch(failure)], notes)
            assert picked is not None
            chosen = picked
            counts["nodes_quantized"] = notes["nodes_quantized"] = len(picked.int4)
            counts["nodes_excluded_for_accuracy"] = len(kept)
            notes["decision"] = (
                f"quantized {len(picked.int4)} MatMul(s) to int4; kept {len(kept)} in {kept_as} to meet the budget"
            )
        else:
            notes["nodes_quantized"] = len(candidates)
            notes["decision"] = f"quantized {len(candidates)} node(s) within the accuracy budget"
        notes["accuracy"] = {k: v.to_dict() for k, v in chosen.accuracy.items()}
        assert chosen.path is not None
        result = load_ir(chosen.path)
    notes["op_types_after"] = dict(sorted(_op_counts(result).items()))
    return Quantized(result, counts, [], notes)


def assemble(low: onnx.ModelProto, kept: onnx.ModelProto, swap: set[str]) -> onnx.ModelProto:
    """``low`` with the node producing each value in ``swap`` taken from ``kept`` (both quantized from one
    model: the same nodes in the same order, each quantized node keeping its MatMul's output name), and the
    initializers the nodes then use."""
    from_kept = {n.output[0]: n for n in kept.graph.node if n.output and n.output[0] in swap}
    nodes = [from_kept.get(n.output[0], n) if n.output else n for n in low.graph.node]
    swapped = {id(n) for n in from_kept.values()}
    # ORT names a quantized weight's scales after the weight, not the bits: each node reads its own model's
    from_low = {value for n in nodes if id(n) not in swapped for value in inputs_of(n)}
    from_low |= {o.name for o in low.graph.output}
    from_kept_values = {value for n in from_kept.values() for value in inputs_of(n)}
    out = onnx.ModelProto()
    out.CopyFrom(low)  # the graph's inputs, outputs, value_info and metadata
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    inits: dict[str, onnx.TensorProto] = {}
    for init in kept.graph.initializer:
        if init.name in from_kept_values:
            inits[init.name] = init
    for init in low.graph.initializer:
        if init.name in from_low and init.name not in inits:
            inits[init.name] = init
    del out.graph.initializer[:]
    out.graph.initializer.extend(inits.values())
    have = {o.domain for o in out.opset_import}
    out.opset_import.extend(o for o in kept.opset_import if o.domain not in have)
    return out


def inputs_of(node: onnx.NodeProto) -> list[str]:
    """The values ``node`` reads, its subgraphs' reads of outer values included."""
    names = list(node.input)
    for attr in node.attribute:
        for graph in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            names += [value for inner in graph.node for value in inputs_of(inner)]
    return names


def _first_trial(outcome: SearchOutcome, full: Trial) -> dict[str, OutputAccuracy]:
    """The accuracy of the search's first trial (no int4), for the refusal's figures."""
    return outcome.base.accuracy if outcome.base is not None else full.accuracy
