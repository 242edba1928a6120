"""quantize_int4: weight-only int4 ``MatMulNBits`` (ORT ``MatMulNBitsQuantizer``), accuracy-checked per output.

Wraps ``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`` (it never re-implements the
quantizer). Each ``MatMul`` with a constant 2-D weight ``W[K, N]`` becomes::

    x --> MatMul(x, W) --> y          =>          x --> com.microsoft::MatMulNBits(x, W_q4, scales) --> y
                                                       (K, N, bits=4, block_size, accuracy_level)

with ``W`` in blocks of ``block_size`` along K, one scale per block (RTN, ``DefaultWeightOnlyQuantConfig``;
``HQQ`` as an option where torch imports, since ORT's HQQ runs on torch). Activations stay float: the
kernel dequantizes weights on the fly, so decode (a GEMV per token, bound by weight bandwidth) gains most.

What ORT leaves to the user, and this pass decides:

* **accuracy_level by measurement.** 4 (int8 compute of the activations, the fast x86 path) and 0 (fp32
  compute) give the same weights; the pass times both on the samples (ORT's default optimizations, 1
  thread) and keeps the fastest whose outputs meet the accuracy budget (neither: 0, the accurate one).
* **The lm_head is never int4** by default (an int4 head made a model repeat itself, issue 19): it is found
  from the graph, the MatMul whose output reaches a graph output through reshapes and elementwise ops only,
  never by name, and stays float, or becomes 8-bit ``MatMulNBits`` where that measures no slower and the
  budget still holds (``lm_head="auto"``, the default), at the level timed fastest for it: the int4 MatMuls
  keep theirs (``accuracy_level.by_layer`` gives each node's, read off the graph), so the head is judged on
  the mix the search chose, as it is handed back. Asked for (``"int8"``), it is held to the budget too.
* **The greedy token is the budget of a language model.** Besides the per-output cosine, a model with a logits
  output is judged by teacher forcing on the samples' token ids (each fed as a prefill on an empty cache; a job
  sent without samples has random ids, no text, so its sequences are drawn from the original model's own
  next-token distribution, ``_accuracy.sample_texts``: on random ids the trained test decoder flipped 3 of 44
  greedy tokens even all 8-bit and int4 was refused; on 336 positions of its own text, where full int4 flips
  5.1% as on held-out text, the search keeps a mix): at least ``min_top1_agreement`` (0.99) of the positions
  must keep the original's greedy next token; the max logit difference and the perplexity of both models on
  those tokens are in the notes (``passes/precision/_accuracy.py``). Full int4 (block 16) keeps a logits cosine
  of 0.9996 on the trained test decoder and flips 3.1% of its greedy tokens: a cosine budget alone passes that.
* **The job's tolerance is part of the budget** (``tolerance``; unset: the context's, the job's): the engine
  verifies every output of the result against it, a KV cache's ``present.*`` included, and the search judged
  logits and cosines only. On Gemma 3n it kept 16 MatMuls int4 and the engine rolled the result back for
  ``present.1.key`` (12% of its elements outside 0.1 + 0.1 * |ref|, 10% allowed); every trial now counts the
  share of each output's elements outside the tolerance on the samples (``beyond_tolerance`` in the figures).
* **Weights in fused forms are read as MatMuls** (``_weight_matmuls``): GPT-2's Gemms, and ``FusedMatMul``
  with a scale (a soft-capped head's ``1/cap`` folded in as alpha by onnxscript's fusions) become a named
  ``MatMul`` plus its Add or Mul; left fused, Gemma 3n's head was found by no one, so it was neither kept float
  by rule nor judged by its greedy tokens. A tied head's ``FusedMatMul(transB=1)`` on the token table stays
  fused (unfused, it would store a transposed copy beside the table) and is found as the head as it is.
* **Block size by measurement** (``block_size="auto"``): full int4 at 128 (ORT's default), 64, 32 and 16 (no
  longer than the longest K); the largest within the budget, else the one that flips the fewest greedy tokens,
  starts the mix. Larger blocks are also faster in prefill: with int8 compute (accuracy_level 4) every block
  rescales its partial sums: on a Qwen2.5-0.5B-shaped decoder at 1 thread a 128-token prefill ran 0.89x
  the fp32 upload's speed (CPU time) at block 32, 0.97x at 64 and 1.23x at 128 (``bench/README.md``, issue 19).
* **Token tables** (``embeddings``): a Gather of a constant table becomes ``GatherBlockQuantized``, 8-bit by
  default (auto: where the budget still holds). A table the lm_head holds too (tied embeddings; exporters
  write the head's copy transposed) reads the quantized head's weights through a Reshape, at the head's bits:
  one copy instead of two float ones (Qwen2.5-0.5B: 545 MB each).
* **Mixed precision by the greedy tokens.** When full int4 misses a next-token budget, every MatMul is
  measured alone in int4 (the rest 8-bit ``MatMulNBits``, or float with ``sensitive_as``) by the top-1 margin
  it takes from the *fragile* positions (those whose top-2 are closer than full int4's largest logit move),
  and the int4 set grows, least loss per weight first, while the budget holds: 2n + 1 teacher-forced trials
  within ``search_seconds`` (``passes/precision/_sensitivity.py``, ``flip_search``). On the trained test
  decoder one MatMul alone in int4 flips 4 to 25 of 1,024 greedy tokens; the per-MatMul weight error does not
  order them. A budget on tensors only (no top-1 / perplexity criterion) keeps the weight-error ranking of
  ``q.drive``. The notes give every MatMul's precision (``precision``), the int4 share of the MatMul weights
  (``int4_share``), the ranking and every trial (``search``).
* **Not offered: GPTQ.** ORT 1.32 ships it (``neural_compressor.gptq_quantize``, numpy, no torch and no
  neural-compressor package needed), but on the trained test decoder it flipped as many greedy tokens as
  asymmetric RTN (42 and 44 of 1,024 at blocks 32 and 16, calibrated on the held-out bytes themselves) and
  78 / 73 symmetric, against RTN's 40 / 32; and ``MatMulNBitsQuantizer`` ignores ``nodes_to_exclude`` on
  its GPTQ path (only the RTN branch marks them), so no mix could be built through it. Asymmetric RTN (42-44
  flips) and HQQ (57 at block 32, 29 at 16) are options, not searched: neither is reliably better here.

* **Bias Adds folded** (CPU target, ``passes/precision/_nbits_bias.py``): a constant ``[N]`` bias Add after a
  MatMulNBits (Qwen2's q/k/v, packed or not; a GPT-2's unfused Gemms), directly or one per piece after the Split
  of a packed projection, becomes the kernel's ``bias`` input (``bias_adds_folded``). ORT fuses the direct case
  itself when it builds a session at level 2 and above; written into the artifact, the graph is the same at
  every level, and the Split case, which ORT leaves, loses its Adds too.

* **Every weight stored once.** A weight read in two forms is stored twice (float beside its packed copy, or
  int4 beside 8-bit): a merged T5 came out larger than its fp32 upload (197 vs 167 KB) when its no-cache
  branch missed the budget and stayed float while the cache branch went int4. A MatMul whose weight another
  node reads too (a Gather of a tied table, a Transpose) stays float; on a merged decoder each weight then
  takes the most precise form any branch chose and the branches are quantized again with those forms
  (``weight_forms_agreed`` in the notes), each still held to the budget: a branch that misses it stays float
  and so, the round after, do the weights it shares.

Refuses (no change, with a reason) when no MatMul has a constant weight, when ``nodes_to_exclude`` names a
node the graph lacks, when HQQ is asked for without torch, and when the budget (top-1 agreement included) is
missed with every MatMul 8-bit, with no MatMul left in int4, or only with more than ``max_exclusions`` of
them 8-bit; the reason gives the full int4 figures.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
import onnx_ir as ir
from pydantic import Field

from core.config import Tolerance
from core.inputs import InputRole, analyze
from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes._subgraphs import in_branches
from passes.precision import _quantization as q
from passes.precision import _weight_matmuls as weight_matmuls
from passes.precision._accuracy import Texts, TokenAccuracy, TokenProbe, head_outputs, logits_output, round_sig
from passes.precision._nbits_bias import fold_bias_adds

_LEVELS = {"fp32": 0, "int8": 4}


class QuantizeInt4Options(PassOptions):
    algorithm: Literal["rtn", "hqq"] = Field(
        "rtn",
        description="rtn: round-to-nearest per block (ORT's DefaultWeightOnlyQuantConfig). hqq: half-quadratic "
        "quantization (ORT's HQQWeightOnlyQuantConfig, always asymmetric), needs torch in the worker.",
    )
    block_size: int | Literal["auto"] = Field(
        "auto",
        description="Weights per quantization block along K (a power of 2, >= 16). auto: measure full int4 at "
        "128, 64, 32 and 16 and keep the largest (fewest scale bytes) within the budget, else the one that flips "
        "the fewest greedy tokens (ties: the smaller logit move).",
    )
    symmetric: bool = Field(True, description="Symmetric blocks (no zero point). rtn only; hqq is asymmetric.")
    accuracy_level: Literal["auto", 0, 1, 4] = Field(
        "auto",
        description="MatMulNBits compute type: 4 quantizes activations to int8 (fastest on x86), 0/1 compute in "
        "fp32. auto: measure 4 and 0 and keep the fastest within the accuracy budget.",
    )
    lm_head: Literal["float", "auto", "int8", "int4"] = Field(
        "auto",
        description="The LM head (found from the graph): float keeps it; int8 makes it 8-bit MatMulNBits where "
        "the budget still holds (else float, with the misses); auto does so only where that also measures no "
        "slower, at the accuracy_level it measured fastest; int4 quantizes it like the rest.",
    )
    embeddings: Literal["auto", "float", "int8", "int4"] = Field(
        "auto",
        description="Token tables (a Gather of a constant 2-D float table): int8 / int4 make each a "
        "GatherBlockQuantized with that many bits (block size and symmetry as the MatMuls'); a table the lm_head "
        "holds too (tied: the head's constant weight equals the table transposed, as exporters write it) reads "
        "the quantized head's weights instead, at the head's bits, and is stored once. auto: int8 (shared where "
        "tied); whichever bits, kept only where the accuracy budget still holds on the samples, else float. "
        "float: as they are.",
    )
    quantize_embeddings: bool = Field(
        False, description="Older spelling of embeddings='int4' (True overrides embeddings)."
    )
    nodes_to_exclude: list[str] = Field(
        default_factory=list, description="Node NAMES to keep in float. An unknown name refuses the pass."
    )
    min_cosine: float = Field(
        0.98, ge=-1, le=1, description="Accuracy budget: least cosine of every float output to the original's."
    )
    max_rel_error: float | None = Field(None, gt=0, description="Accuracy budget: largest relative L2 error.")
    max_abs_error: float | None = Field(None, gt=0, description="Accuracy budget: largest absolute difference.")
    min_top1_agreement: float | None = Field(
        0.99,
        ge=0,
        le=1,
        description="Accuracy budget for language models: least share of positions whose greedy next token "
        "(teacher-forced on the samples' token ids, a KV-cache decoder fed each sample as a prefill; a job without "
        "samples: on sequences drawn from the original model) is the original's. Models without a logits output "
        "or samples without token ids: not applied (noted).",
    )
    max_perplexity_increase: float | None = Field(
        None,
        ge=0,
        description="Accuracy budget: largest relative perplexity increase on the samples' token sequences "
        "(0.05: +5%); meaningful when the samples are real text (unset: reported only).",
    )
    sensitive_as: Literal["int8", "float"] = Field(
        "int8",
        description="What the exclusion loop makes of the MatMuls it takes out of int4 to meet the budget: "
        "8-bit MatMulNBits (half the bytes of float, close to float accuracy) or float.",
    )
    max_exclusions: int | None = Field(
        None,
        ge=0,
        description="Most MatMuls the search may take out of int4 to meet the budget (0: none; unset: any, the "
        "report gives the int4 share of the MatMul weights).",
    )
    search_seconds: float = Field(
        120.0,
        gt=0,
        description="Time budget of the next-token search for the int4/8-bit mix; once spent, the MatMuls not "
        "yet tried stay 8-bit (or float) and the notes say so.",
    )
    tolerance: Tolerance | None = q.tolerance_field()
    max_samples: int = Field(8, ge=1, description="Samples used to measure accuracy and speed.")


class QuantizeInt4(Pass[QuantizeInt4Options]):
    name = "quantize_int4"
    summary = "Weight-only int4 MatMulNBits (ORT MatMulNBitsQuantizer), lm_head float or 8-bit, accuracy-checked."
    exact = False
    in_place = False

    def for_other_branches(self, notes: dict[str, Any]) -> QuantizeInt4:
        """passes._subgraphs: the block size and lm_head precision measured on a merged decoder's cache branch,
        given to its other branch as options. Picked apart, they differed (merged Whisper: block 16 and 64;
        GPT-2: an 8-bit head in one branch, float in the other, on timing noise), and every weight both
        branches read was packed, and stored, twice. The accuracy level stays each branch's: it is a node
        attribute, no stored bytes, and fixing it fixed the head's too (GPT-2's no-cache branch then refused
        its 8-bit head at level 0). The budget still holds per branch: a MatMul too sensitive in one branch
        alone stays 8-bit there (stored apart)."""
        update: dict[str, Any] = {}
        if isinstance(size := notes.get("block_size"), dict):
            update["block_size"] = size["chosen"]
        head = str(notes.get("lm_head_decision", "")).split(" ")[0].rstrip(":")
        if self.options.lm_head == "auto" and head in ("int8", "float"):
            update["lm_head"] = head
        follower = type(self)(self.options.model_copy(update=update))
        follower._pins = self._pins
        return follower

    _pins: dict[str, tuple[str, int]] | None = None  # weight -> (form, accuracy_level), set by _agree

    def _agree(self, model: ir.Model, ctx: PassContext, first: PassResult) -> PassResult:
        """``first`` (the pass run branch by branch), or the branches run again with one form per weight.

        Each branch chooses alone: the no-cache branch of a merged T5 missed the budget even with every MatMul
        8-bit (one greedy token of 8 flipped) and stayed float while the cache branch went int4, so the outer
        graph kept every float weight beside the cache branch's packed copies: 197 KB against the 167 KB
        upload. A weight read in two forms (float and int4, int4 and 8-bit) is stored twice, so every weight
        takes the most precise form any of its readers chose (no reader loses accuracy, the stored bytes only
        shrink) and the branches are quantized again with those forms, each still held to the budget; a branch
        that then misses it stays float, and the others follow it the round after."""
        result, rounds = first, []
        chosen = _first_block_size(first.notes)
        while True:
            uses = weight_uses(model, result.model)
            split = {name: sorted(kinds, key=_FORMS.index) for name, kinds in uses.items() if len(kinds) > 1}
            if not split:
                break
            if len(rounds) == len(_FORMS):  # forms only rise (a miss makes a branch float): a bound, not a case
                reason = "the branches still read a weight in two forms after agreeing; left float (stored once)"
                return PassResult(q.unchanged(model), False, {}, [*result.non_matches, NonMatch(reason)], first.notes)
            # each form at the accuracy level its reader had: a branch whose forms did not change is rebuilt as
            # it was measured (rebuilt at one level, merged GPT-2's no-cache branch flipped a greedy token)
            pins = {name: max(kinds.items(), key=lambda kind: _FORMS.index(kind[0])) for name, kinds in uses.items()}
            rounds.append({"read_in_two_forms": split, "agreed": {name: pins[name][0] for name in split}})
            update: dict[str, Any] = {} if chosen is None else {"block_size": chosen}
            pinned = type(self)(self.options.model_copy(update=update))
            pinned._pins = pins
            result = in_branches(pinned, model, ctx) or result
            rounds[-1]["branches"] = result.notes.get("branches", {})
        if not rounds:
            return first
        # "branches" stays the first round's: what each branch measured and chose alone (the search, the
        # block size); each round's own notes are under weight_forms_agreed
        notes = {**first.notes, "weight_forms_agreed": rounds}
        seen = {(m.reason, m.node) for m in result.non_matches}
        non_matches = [*result.non_matches, *(m for m in first.non_matches if (m.reason, m.node) not in seen)]
        if not result.modified:
            non_matches.append(
                NonMatch(
                    "the branches share their weights and one of them keeps them float (its budget, above), so "
                    "the other does too: quantizing it alone would store them twice, larger than the upload"
                )
            )
        return PassResult(result.model, result.modified, result.counts, non_matches, notes)

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        if (branches := in_branches(self, model, ctx)) is not None:  # a merged decoder: each branch's MatMuls
            return branches if self._pins is not None else self._agree(model, ctx, branches)
        options = q.with_job_tolerance(self.options, ctx.tolerance)
        if self._pins is not None:
            return _call_pinned(model, ctx, options, self._pins)
        unchanged = q.unchanged(model)
        refusal = q.unknown_node_names(model, options.nodes_to_exclude)
        if options.algorithm == "hqq" and importlib.util.find_spec("torch") is None:
            refusal.append(NonMatch("algorithm 'hqq' runs on torch (ORT's HQQ quantizer), not installed here"))
        size = options.block_size
        if isinstance(size, int) and (size < 16 or size & (size - 1)):
            refusal.append(NonMatch(f"block_size {size} is not a power of 2 >= 16 (MatMulNBits needs one)"))
        if refusal:
            return q.refused(model, refusal)
        unfused: dict[str, int] = {}
        if weight_matmuls.sites(model, transposed=False):
            model = ir.serde.deserialize_model(ir.serde.serialize_model(model))  # functional: input untouched
            unfused = weight_matmuls.unfuse(model, transposed=False)
        heads = lm_heads(model)
        candidates, non_matches, shared = _candidates(model, set(options.nodes_to_exclude))
        kept_float = [] if options.lm_head == "int4" else [h for h in heads if h in candidates]
        candidates = [c for c in candidates if c not in kept_float]
        notes: dict[str, Any] = {
            "algorithm": options.algorithm,
            "symmetric": options.symmetric if options.algorithm == "rtn" else False,
            "lm_head": heads or "none found",
            "candidates": len(candidates),
            "gemms_unfused": unfused.get("Gemm", 0),
            "fused_matmuls_unfused": unfused.get("FusedMatMul", 0),
        }
        if not candidates:
            non_matches.append(NonMatch("no MatMul with a constant 2-D weight to quantize (the lm_head aside)"))
            notes["decision"] = "skipped: nothing to quantize"
            return PassResult(unchanged, False, {"nodes_quantized": 0}, non_matches, notes)
        budget_options = _budget_options(
            options,
            nodes_to_exclude=[*options.nodes_to_exclude, *kept_float, *shared],
            max_exclusions=len(candidates) if options.max_exclusions is None else options.max_exclusions,
            max_samples=options.max_samples,
        )
        judge = Judge.of(model, ctx, options.max_samples)
        notes["next_token_texts"] = judge.why
        options = _choose_block_size(
            model, ctx.samples, options, budget_options, notes, candidates=candidates, judge=judge
        )
        level = _choose_level(model, ctx.samples, options, budget_options, notes, judge=judge)
        candidate_set = set(candidates)

        def quantize(src: Path, dst: Path, exclude: list[str], large: bool) -> None:
            proto = quantize_proto(onnx.load(str(src), load_external_data=True), options, level, exclude)
            sensitive = [n for n in exclude if n in candidate_set]  # the loop's, not the user's or the head
            if sensitive and options.sensitive_as == "int8":
                others = [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.name not in sensitive]
                proto = quantize_proto(proto, options, level, others, bits=8, include=sensitive)
            q.save_proto(proto, dst, large)

        weights = _weight_sizes(model)
        common = {
            "candidates": candidates,
            "quantize": quantize,
            "notes": notes,
            "kept_as": options.sensitive_as,
            "texts": judge.texts,
        }
        out = None
        if options.min_top1_agreement is not None or options.max_perplexity_increase is not None:
            out = q.drive_next_token(
                model, ctx.samples, budget_options, weights=weights, search_seconds=options.search_seconds, **common
            )
        if out is None:  # a tensor budget only, or no token ids to judge the greedy tokens by
            out = q.drive(model, ctx.samples, budget_options, quantized_nodes=replaced_nodes, **common)
        non_matches += out.non_matches
        if "nodes_excluded_by_user" in out.counts:  # drive counts the float head among the user's exclusions
            out.counts["nodes_excluded_by_user"] = len(options.nodes_to_exclude)
            out.counts["lm_head_kept_float"] = len(kept_float)
        if out.model is None:
            return PassResult(unchanged, False, out.counts, non_matches, out.notes)
        result = out.model
        notes["accuracy_mix"] = notes.get("accuracy")  # the MatMul mix as the search judged it, head float
        if options.lm_head in ("auto", "int8") and kept_float:
            result = _head_int8(
                model,
                result,
                kept_float,
                samples=ctx.samples,
                options=options,
                budget_options=budget_options,
                notes=notes,
                judge=judge,
            )
        result = _tables(
            model,
            result,
            heads,
            samples=ctx.samples,
            options=options,
            budget_options=budget_options,
            notes=notes,
            judge=judge,
        )
        if ctx.target == "cpu":
            folded, declined = fold_bias_adds(result)
            non_matches += declined
            out.counts["bias_adds_folded"] = folded
        else:
            notes["bias_adds"] = f"kept: MatMulNBits' bias input on {ctx.target} takes one GEMV shape alone"
        notes["precision"] = precision_by_layer(result, [*candidates, *kept_float, *shared, *options.nodes_to_exclude])
        notes["accuracy_level"]["by_layer"] = levels_by_layer(result)
        notes["int4_share"] = int4_share(notes["precision"], weights)
        notes["weight_bytes"] = {
            "before": q.tensor_bytes(ir.serde.serialize_model(model)),
            "after": q.tensor_bytes(ir.serde.serialize_model(result)),
        }
        notes["matmulnbits"] = sum(1 for n in result.graph if n.op_type == "MatMulNBits")
        return PassResult(result, True, out.counts, non_matches, notes)


def quantize_proto(
    proto: onnx.ModelProto,
    options: QuantizeInt4Options,
    level: int,
    exclude: Sequence[str],
    *,
    bits: int = 4,
    include: Sequence[str] = (),
) -> onnx.ModelProto:
    """ORT's MatMulNBitsQuantizer on ``proto``; every MatMulNBits it writes gets ``accuracy_level=level``.

    MatMulNBits already in ``proto`` keep theirs: the 8-bit head (or the 8-bit MatMuls of a mix) is added to
    a model whose int4 MatMuls were measured and chosen at their own level, which the report gives."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnb

    # By output: a node's name need not be unique or set, the value it writes is (SSA)
    before = {n.output[0] for n in proto.graph.node if n.op_type == "MatMulNBits" and n.output}

    op_types = ("MatMul",)  # token tables: quantize_tables, after the MatMuls (it may share the head's weights)
    config: Any
    if options.algorithm == "hqq" and bits == 4:
        config = mnb.HQQWeightOnlyQuantConfig(block_size=options.block_size, bits=4, op_types_to_quantize=op_types)
    else:
        config = mnb.DefaultWeightOnlyQuantConfig(
            block_size=options.block_size,
            is_symmetric=options.symmetric,
            accuracy_level=level,
            op_types_to_quantize=op_types,
            bits=bits,
        )
    with q.quiet_ort_quantization():
        quantizer = mnb.MatMulNBitsQuantizer(
            proto, nodes_to_exclude=list(exclude), nodes_to_include=list(include) or None, algo_config=config
        )
        quantizer.process()
    out = quantizer.model.model
    set_accuracy_level(out, level, skip=before)
    return out


def set_accuracy_level(proto: onnx.ModelProto, level: int, *, skip: Collection[str] = ()) -> None:
    """``accuracy_level=level`` on every MatMulNBits of ``proto`` but those writing a value in ``skip``
    (ORT's HQQ config takes no level: the nodes it writes are stamped here)."""
    for node in proto.graph.node:
        if node.op_type == "MatMulNBits" and not (node.output and node.output[0] in skip):
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("accuracy_level", level)])


def lm_heads(model: ir.Model) -> list[str]:
    """Names of the MatMuls whose output reaches a graph output through shape and elementwise ops only."""
    return list(dict.fromkeys(head_outputs(model).values()))


def _candidates(model: ir.Model, excluded: set[str]) -> tuple[list[str], list[NonMatch], list[str]]:
    """The MatMuls to quantize, why others are not, and the MatMuls kept float because another node reads
    their weight (ORT's quantizer takes every MatMul it is not told to exclude: the caller excludes them)."""
    found, non_matches, shared = [], [], []
    for node in model.graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or node.name in excluded:
            continue
        weight = node.inputs[1] if len(node.inputs) > 1 else None
        if weight is None or weight.const_value is None:
            continue  # attention's Q.K^T and P.V: activations on both sides, nothing to quantize
        shape = weight.const_value.shape
        others = [u.node for u in weight.uses() if u.node.op_type != "MatMul" or u.idx != 1]
        if others or weight.is_graph_output():
            # ORT would pack a copy and keep the float weight for the other reader: stored twice
            what = f"{others[0].op_type} {others[0].name}" if others else "a graph output"
            reason = f"weight {weight.name} is also read by {what}: quantized, it would be stored twice"
            non_matches.append(NonMatch(reason, node.name, node.op_type))
            shared.append(node.name)
        elif len(shape) < 2 or any(d != 1 for d in shape[:-2]):
            non_matches.append(NonMatch(f"weight of shape {list(shape)} is not 2-D", node.name, node.op_type))
        elif not node.name:
            non_matches.append(NonMatch("unnamed MatMul: the accuracy loop tracks nodes by name", None, "MatMul"))
        else:
            found.append(node.name)
    return found, non_matches, shared


def precision_by_layer(model: ir.Model, names: Sequence[str]) -> dict[str, str]:
    """``{MatMul name: "int4" | "int8" | "float"}`` read off the quantized graph (MatMulNBitsQuantizer names
    the node it writes ``<name>_Q<bits>``)."""
    bits = {}
    for node in model.graph:
        if node.op_type == "MatMulNBits" and "bits" in node.attributes:
            bits[node.name.rsplit("_Q", 1)[0]] = node.attributes["bits"].value
    return {name: f"int{bits[name]}" if name in bits else "float" for name in names}


def levels_by_layer(model: ir.Model) -> dict[str, int]:
    """``{MatMul name: accuracy_level}`` of every MatMulNBits, read off the graph (the head's may differ)."""
    return {
        node.name.rsplit("_Q", 1)[0]: node.attributes["accuracy_level"].value
        for node in model.graph
        if node.op_type == "MatMulNBits" and "accuracy_level" in node.attributes
    }


def replaced_nodes(original: onnx.ModelProto, quantized: onnx.ModelProto, candidates: Sequence[str]) -> list[str]:
    """Candidates ORT replaced (MatMulNBitsQuantizer renames the node it replaces to ``<name>_Q4``/``_Q8``)."""
    remaining = {n.name for n in quantized.graph.node}
    return [name for name in candidates if name not in remaining]


def _latency_ms(path: Path, feeds: Sequence[dict[str, np.ndarray]], repeats: int = 5) -> list[float]:
    """Median latency of each feed at ORT's default optimizations and 1 thread (how it will run)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    # From the file: a model over 2 GB (a 0.5B-parameter decoder in fp32) cannot pass through one proto's bytes.
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    for feed in feeds:
        sess.run(None, feed)
    times: list[list[float]] = [[] for _ in feeds]
    for _ in range(repeats):
        for i, feed in enumerate(feeds):
            t0 = time.perf_counter()
            sess.run(None, feed)
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def speed_ratio(latency: Sequence[float], reference: Sequence[float]) -> float:
    """Geometric mean over the samples of ``latency / reference`` (< 1: faster). Each sample counts once,
    whatever its cost: summed, a 128-token prefill outweighs a decode step 20 to 1 on a decoder, and a
    choice that makes every decode step 1.3x faster would be decided by the prefill's noise."""
    return float(np.exp(np.mean(np.log(np.asarray(latency) / np.asarray(reference)))))


def _ms(latency: Sequence[float]) -> list[float]:
    return [round(v, 3) for v in latency]


@dataclasses.dataclass(frozen=True)
class Judge:
    """What the pass's accuracy measurements read besides the samples: the logits output, the graph's input
    roles, and the token sequences the next-token figures are taken on when the samples' are not text."""

    logits: str | None
    roles: Mapping[str, InputRole]
    texts: Texts | None = None
    why: str | None = None  # which sequences judge the greedy tokens, and why (the notes)

    @classmethod
    def of(cls, model: ir.Model, ctx: PassContext, limit: int) -> Judge:
        """The engine's generated inputs carry uniform random token ids (``ctx.samples_are_data`` False): the
        greedy tokens are then judged on sequences drawn from the model itself (``_accuracy.sample_texts``)."""
        logits, roles = logits_output(model), analyze(model).roles
        if ctx.samples_are_data or logits is None:
            return cls(logits, roles)
        texts = q.drawn_texts(model, ctx.samples, limit, logits=logits, roles=roles)
        if not texts.feeds:
            return cls(logits, roles, why=f"the samples' token ids (generated; none drawn: {texts.how})")
        return cls(logits, roles, texts, texts.how)


def _measure(
    original: onnx.ModelProto,
    candidates: dict[str, onnx.ModelProto | Callable[[], onnx.ModelProto]],
    samples: Sequence[dict[str, np.ndarray]],
    limit: int,
    judge: Judge,
    *,
    elements: Tolerance | None,
    timed: bool = True,
) -> tuple[dict[str, dict[str, q.OutputAccuracy]], dict[str, list[float]]] | None:
    """Accuracy (against ``original``, graph optimizations off) and latency of each candidate proto. A
    candidate given as a function is built when its turn comes and dropped after: a 0.5B decoder's candidates
    are over 1 GB each, and four of them at once with their quantizer's copies ran a 23 GiB host out of memory."""
    with q.workdir() as tmp:
        src = Path(tmp) / "original.onnx"
        large = q.tensor_bytes(original) > q.EXTERNAL_DATA_BYTES
        q.save_proto(original, src, large)
        ref_sess = q.session(src)
        feeds = q.feeds_for(ref_sess, samples, limit)
        outputs = q.float_outputs(ref_sess)
        del ref_sess
        if not feeds or not outputs:
            return None
        reference = q.run_outputs(src, feeds, outputs)
        probe = TokenProbe.build(src, judge.logits, samples, limit, judge.roles, texts=judge.texts)
        accuracy, latency = {}, {}
        for key, given in candidates.items():
            path = Path(tmp) / f"{key}.onnx"
            built = callable(given)
            proto = given() if callable(given) else given
            # Saving with external data empties the proto's tensors in place: the caller may hand it back.
            q.save_proto(_copy(proto) if large and not built else proto, path, large)
            del proto
            accuracy[key] = q.measure(path, feeds, outputs, reference, probe, elements=elements)
            if timed:
                latency[key] = _latency_ms(path, feeds)
        return accuracy, latency


def _measure_heads(
    original: ir.Model,
    candidates: dict[str, onnx.ModelProto | Callable[[], onnx.ModelProto]],
    samples: Sequence[dict[str, np.ndarray]],
    options: QuantizeInt4Options,
    budget: q.Budget,
    *,
    judge: Judge,
    timed: bool = True,
) -> tuple[dict[str, dict[str, q.OutputAccuracy]], dict[str, list[float]]] | None:
    """``_measure`` of the head candidates against the model before quantization, held to ``budget``'s tolerance."""
    proto = ir.serde.serialize_model(original)
    limit = options.max_samples
    return _measure(proto, candidates, samples, limit, judge, elements=budget.elements, timed=timed)


def _copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    return out


def _choose_block_size(
    model: ir.Model,
    samples: Sequence[dict[str, np.ndarray]],
    options: QuantizeInt4Options,
    budget_options: q.QuantizationOptions,
    notes: dict[str, Any],
    *,
    candidates: Sequence[str],
    judge: Judge,
) -> QuantizeInt4Options:
    """``options`` with an int ``block_size``: the option's, or (auto) the measured choice, in the notes."""
    if options.block_size != "auto":
        notes["block_size"] = {"chosen": options.block_size, "by": "option"}
        return options
    original = ir.serde.serialize_model(model)
    # Each candidate quantizes its own proto, serialized from the IR again: a bytes round trip of one copy
    # would fail over protobuf's 2 GB.
    # A block longer than every weight's K only pads: it stores as many scales as the next smaller one.
    longest = max((n.inputs[1].const_value.shape[0] for n in model.graph if n.name in candidates), default=16)
    sizes = tuple(size for size in (128, 64, 32, 16) if size <= max(longest, 16))

    def full_int4(size: int) -> Callable[[], onnx.ModelProto]:
        sized = options.model_copy(update={"block_size": size})
        return lambda: quantize_proto(ir.serde.serialize_model(model), sized, 0, budget_options.nodes_to_exclude)

    protos = {str(size): full_int4(size) for size in sizes}
    measured = _measure(
        original,
        protos,
        samples,
        options.max_samples,
        judge,
        elements=budget_options.tolerance,
        timed=False,
    )
    if measured is None:
        notes["block_size"] = {"chosen": 32, "by": "no samples give every input: ORT's usual 32"}
        return options.model_copy(update={"block_size": 32})
    accuracy, _ = measured
    budget = q.budget_of(budget_options)
    holding = [size for size in sizes if not budget.misses(accuracy[str(size)])]

    def damage(size: int) -> tuple[int, float]:
        token = [a for a in accuracy[str(size)].values() if isinstance(a, TokenAccuracy)]
        flipped = sum(a.flipped for a in token)
        return flipped, max((a.max_abs for a in accuracy[str(size)].values()), default=0.0)

    chosen = holding[0] if holding else min(sizes, key=damage)
    notes["block_size"] = {
        "chosen": chosen,
        "by": "measured: the largest within the budget"
        if holding
        else "measured: none holds in full int4, the one that flips the fewest greedy tokens",
        "full_int4": {
            str(size): {"within_budget": size in holding, "flipped": d[0], "max_diff": round_sig(d[1])}
            for size in sizes
            for d in [damage(size)]
        },
    }
    return options.model_copy(update={"block_size": chosen})


def _weight_sizes(model: ir.Model) -> dict[str, int]:
    """Elements of the constant weight of every named MatMul (the head and excluded ones included)."""
    sizes = {}
    for node in model.graph:
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and node.name and len(node.inputs) > 1:
            weight = node.inputs[1]
            if weight is not None and weight.const_value is not None and len(weight.const_value.shape) >= 2:
                sizes[node.name] = int(np.prod(weight.const_value.shape))
    return sizes


def int4_share(precision: dict[str, str], weights: dict[str, int]) -> dict[str, Any]:
    """The share of the MatMul weights (elements, the float head included) stored in int4, and per precision."""
    total = sum(weights.get(name, 0) for name in precision)
    by: dict[str, int] = {}
    for name, kind in precision.items():
        by[kind] = by.get(kind, 0) + weights.get(name, 0)
    return {"of_matmul_weights": round_sig(by.get("int4", 0) / total) if total else 0.0, "weights": by}


def _choose_level(
    model: ir.Model,
    samples: Sequence[dict[str, np.ndarray]],
    options: QuantizeInt4Options,
    budget_options: q.QuantizationOptions,
    notes: dict[str, Any],
    *,
    judge: Judge,
) -> int:
    if options.accuracy_level != "auto":
        notes["accuracy_level"] = {"chosen": options.accuracy_level, "by": "option"}
        return int(options.accuracy_level)
    original = ir.serde.serialize_model(model)

    def full_int4(level: int) -> Callable[[], onnx.ModelProto]:
        return lambda: quantize_proto(ir.serde.serialize_model(model), options, level, budget_options.nodes_to_exclude)

    protos = {"int8": full_int4(4), "fp32": full_int4(0)}
    measured = _measure(original, protos, samples, options.max_samples, judge, elements=budget_options.tolerance)
    if measured is None:
        notes["accuracy_level"] = {"chosen": 0, "by": "no samples give every input: fp32 compute, the accurate one"}
        return 0
    accuracy, latency = measured
    budget = q.budget_of(budget_options)
    holding = [k for k in ("int8", "fp32") if not budget.misses(accuracy[k])]
    if len(holding) == 2:
        chosen = "int8" if speed_ratio(latency["int8"], latency["fp32"]) <= 1 else "fp32"
    else:  # neither holds: the exclusion loop starts from the more accurate fp32 compute
        chosen = holding[0] if holding else "fp32"
    notes["accuracy_level"] = {
        "chosen": _LEVELS[chosen],
        "by": "measured: fastest within the budget" if holding else "measured: neither holds, fp32 compute",
        "latency_ms": {f"level {_LEVELS[k]}": _ms(v) for k, v in latency.items()},
        "level_4_vs_0": round_sig(speed_ratio(latency["int8"], latency["fp32"])),
        "within_budget": {f"level {_LEVELS[k]}": k in holding for k in latency},
    }
    return _LEVELS[chosen]


def _head_int8(
    original: ir.Model,
    quantized: ir.Model,
    heads: list[str],
    *,
    samples: Sequence[dict[str, np.ndarray]],
    options: QuantizeInt4Options,
    budget_options: q.QuantizationOptions,
    notes: dict[str, Any],
    judge: Judge,
) -> ir.Model:
    """The quantized model with its head(s) as 8-bit MatMulNBits, when ``lm_head`` asks and (auto) it pays.

    auto times the float head against the 8-bit one at both accuracy levels: the level the int4 MatMuls
    measured fastest need not suit an 8-bit head (at fp32 compute an 8-bit MatMulNBits has no fast prefill
    kernel: a 128-token prefill through a 151936-wide head took 2.7 s against 0.43 s at level 4)."""
    proto = ir.serde.serialize_model(quantized)
    others = [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.name not in heads]

    def head8(at: int) -> onnx.ModelProto:
        return quantize_proto(ir.serde.serialize_model(quantized), options, at, others, bits=8, include=heads)

    budget = q.budget_of(budget_options)
    if options.lm_head == "int8":
        return _head_int8_asked(
            original,
            quantized,
            head8,
            samples=samples,
            options=options,
            budget=budget,
            notes=notes,
            judge=judge,
        )
    levels = {f"int8 level {at}": at for at in (4, 0)}
    candidates: dict[str, onnx.ModelProto | Callable[[], onnx.ModelProto]] = {"float": proto}
    candidates |= {key: functools.partial(head8, at) for key, at in levels.items()}
    measured = _measure_heads(original, candidates, samples, options, budget, judge=judge)
    if measured is None:
        notes["lm_head_decision"] = "float: no samples to measure an 8-bit head"
        return quantized
    accuracy, latency = measured
    notes["lm_head_latency_ms"] = {k: _ms(v) for k, v in latency.items()}
    ratios = {key: speed_ratio(latency[key], latency["float"]) for key in levels}
    notes["lm_head_vs_float"] = {key: round_sig(r) for key, r in ratios.items()}
    holding = [key for key in levels if not budget.misses(accuracy[key])]
    best = min(holding, key=lambda key: ratios[key]) if holding else None
    if best is not None and ratios[best] <= 1:
        notes["lm_head_decision"] = f"int8 (accuracy_level {levels[best]}): measured no slower and within the budget"
        notes["accuracy"] = {k: v.to_dict() for k, v in accuracy[best].items()}  # the model handed back
        return ir.serde.deserialize_model(head8(levels[best]))
    misses = budget.misses(accuracy["int8 level 4"])
    notes["lm_head_decision"] = "float: " + ("; ".join(misses) if misses else "the 8-bit head measured slower")
    return quantized


def _head_int8_asked(
    original: ir.Model,
    quantized: ir.Model,
    head8: Callable[[int], onnx.ModelProto],
    *,
    samples: Sequence[dict[str, np.ndarray]],
    options: QuantizeInt4Options,
    budget: q.Budget,
    notes: dict[str, Any],
    judge: Judge,
) -> ir.Model:
    """The 8-bit head a user asked for, still held to the budget. With ``accuracy_level`` auto its level is
    measured apart from the int4 MatMuls' (the level they measured fastest need not suit the head: see
    ``_head_int8``): the faster of the two within the budget; without samples, the int4 MatMuls' level."""
    given = options.accuracy_level != "auto"
    level = notes.get("accuracy_level", {}).get("chosen", 0)
    levels = {f"int8 level {at}": at for at in ((level,) if given else (4, 0))}
    candidates: dict[str, onnx.ModelProto | Callable[[], onnx.ModelProto]]
    candidates = {key: functools.partial(head8, at) for key, at in levels.items()}
    timed = len(levels) > 1
    measured = _measure_heads(original, candidates, samples, options, budget, judge=judge, timed=timed)
    if measured is None:
        notes["lm_head_decision"] = f"int8 (option, accuracy_level {level}); not measured: no samples"
        return ir.serde.deserialize_model(head8(level))
    accuracy, latency = measured
    holding = [key for key in levels if not budget.misses(accuracy[key])]
    if timed:
        notes["lm_head_latency_ms"] = {k: _ms(v) for k, v in latency.items()}
        notes["lm_head_level_4_vs_0"] = round_sig(speed_ratio(latency["int8 level 4"], latency["int8 level 0"]))
    if not holding:
        notes["lm_head_decision"] = "float: int8 asked for, outside the budget at " + "; ".join(
            f"accuracy_level {at}: " + "; ".join(budget.misses(accuracy[key])) for key, at in levels.items()
        )
        notes["lm_head_accuracy_int8"] = {
            f"level {at}": {k: v.to_dict() for k, v in accuracy[key].items()} for key, at in levels.items()
        }
        return quantized
    fastest = len(holding) > 1  # only when timed: one level given is never timed
    best = min(holding, key=lambda key: speed_ratio(latency[key], latency[holding[0]])) if fastest else holding[0]
    how = " as given" if given else (", measured fastest" if fastest else ", the only level within the budget")
    notes["lm_head_decision"] = f"int8 (option, accuracy_level {levels[best]}{how}): within the budget"
    notes["accuracy"] = {k: v.to_dict() for k, v in accuracy[best].items()}  # the model handed back
    return ir.serde.deserialize_model(head8(levels[best]))


def _tables(
    original: ir.Model,
    quantized: ir.Model,
    heads: list[str],
    *,
    samples: Sequence[dict[str, np.ndarray]],
    options: QuantizeInt4Options,
    budget_options: q.QuantizationOptions,
    notes: dict[str, Any],
    judge: Judge,
) -> ir.Model:
    """The quantized model with its token tables quantized as ``embeddings`` asks (auto: where it measures
    within the budget); the choice and every table's bytes in ``notes["embeddings"]``."""
    choice = "int4" if options.quantize_embeddings else options.embeddings
    if choice == "float":
        notes["embeddings"] = {"decision": "float (option)"}
        return quantized
    head_weights = _head_weights(original, heads)
    proto = ir.serde.serialize_model(quantized)
    assert isinstance(options.block_size, int)  # chosen before the MatMuls were quantized
    tables = quantize_tables(
        proto,
        head_weights,
        bits=4 if choice == "int4" else 8,
        block_size=options.block_size,
        symmetric=options.symmetric,
    )
    entry: dict[str, Any] = {"tables": tables}
    notes["embeddings"] = entry
    if not tables:
        entry["decision"] = "none: no Gather of a constant 2-D float32 table read by nothing else"
        return quantized
    original_proto = ir.serde.serialize_model(original)
    limit = options.max_samples
    measured = _measure(
        original_proto,
        {"tables": proto},
        samples,
        limit,
        judge,
        elements=budget_options.tolerance,
        timed=False,
    )
    if measured is None:
        if choice != "auto":
            entry["decision"] = f"{choice} (option); not measured: no samples give every input"
            return ir.serde.deserialize_model(proto)
        entry["decision"] = "float: no samples to measure quantized tables on"
        return quantized
    accuracy = measured[0]["tables"]
    misses = q.budget_of(budget_options).misses(accuracy)
    if misses:  # asked for or not: the budget is the gate, as for every MatMul
        entry["decision"] = "float: " + "; ".join(misses)
        entry["accuracy_quantized"] = {k: v.to_dict() for k, v in accuracy.items()}
        return quantized
    entry["decision"] = f"{choice} (option)" if choice != "auto" else "quantized: within the budget"
    entry["accuracy_before"] = notes.get("accuracy")  # the MatMuls', the head's choice included
    notes["accuracy"] = {k: v.to_dict() for k, v in accuracy.items()}  # the model handed back
    return ir.serde.deserialize_model(proto)


def quantize_tables(
    proto: onnx.ModelProto,
    head_weights: dict[str, np.ndarray],
    *,
    bits: int,
    block_size: int,
    symmetric: bool,
    only: Collection[str] | None = None,
) -> list[dict[str, Any]]:
    """Make each token table of ``proto`` (of those named in ``only``, when given) a
    ``com.microsoft::GatherBlockQuantized``, in place; one entry per table done.

    A token table: a ``Gather`` (axis 0) of a constant 2-D float32 initializer ``E[V, H]`` that nothing else
    reads. Tied: where a quantized lm_head (MatMulNBits ``<head>_Q<b>``) was quantized from a weight equal to
    ``E`` transposed (``head_weights``, the heads' float weights before quantization), the Gather reads the
    head's packed weights through a Reshape, with its scales and zero points, at the head's bits and block:
    the model keeps one copy of the table. Otherwise ``E`` is quantized by ORT's block quantizer (the
    MatMulNBits layout, ``E`` seen as the weight of ``x @ E^T``) at ``bits``. Both dequantize exactly as the
    MatMulNBits kernel does; rows padded to whole blocks are sliced back to ``H``."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mnb

    graph = proto.graph
    inits = {init.name: init for init in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in q.inputs_of(node):
            readers[name] = readers.get(name, 0) + 1
    for output in graph.output:
        readers[output.name] = readers.get(output.name, 0) + 1
    quantized_heads = {}
    for node in graph.node:
        if node.op_type == "MatMulNBits" and node.name.rsplit("_Q", 1)[0] in head_weights:
            quantized_heads[node.name.rsplit("_Q", 1)[0]] = node
    done: list[dict[str, Any]] = []
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        table = inits.get(node.input[0]) if node.op_type == "Gather" and node.domain in ("", "ai.onnx") else None
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if (
            table is None
            or len(table.dims) != 2
            or table.data_type != onnx.TensorProto.FLOAT
            or axis not in (0, -2)
            or readers.get(table.name, 0) != 1
            or node.input[1] in inits  # a constant lookup: folded by constant folding, not a token table
            or (only is not None and table.name not in only)
        ):
            nodes.append(node)
            continue
        rows, cols = (int(d) for d in table.dims)
        values = onnx.numpy_helper.to_array(table)
        shared = _tied_head(values, head_weights, quantized_heads, inits)
        new: list[onnx.NodeProto] = []
        if shared is not None:
            head = quantized_heads[shared]
            attrs = {a.name: a.i for a in head.attribute}
            table_bits, table_block = attrs["bits"], attrs["block_size"]
            packed = inits[head.input[1]]
            shape = q.unique_name(inits, f"{node.name}_table_shape")
            inits[shape] = onnx.numpy_helper.from_array(np.array([rows, -1], dtype=np.int64), shape)
            graph.initializer.append(inits[shape])
            data = f"{packed.name}_as_table"
            new.append(onnx.helper.make_node("Reshape", [packed.name, shape], [data], name=f"{node.name}_table"))
            scales_zeros = [name for name in head.input[2:4] if name]
            added = 0
        else:
            table_bits, table_block = bits, block_size
            config = mnb.DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric, bits=bits)
            packed_values, scales, zeros = mnb.DefaultWeightOnlyQuantizer(config).qbits_block_quant(
                np.ascontiguousarray(values.T)
            )
            arrays = {f"{table.name}_Q{bits}": packed_values.reshape(rows, -1), f"{table.name}_scales": scales}
            if not symmetric:
                arrays[f"{table.name}_zero_points"] = zeros.reshape(rows, -1)
            if sum(a.nbytes for a in arrays.values()) >= values.nbytes:
                # rows shorter than a block are padded to one: T5's [32, 4] relative-position table took 640
                # bytes at 8 bits (512 in float)
                nodes.append(node)
                continue
            names = []
            for wanted, array in arrays.items():
                name = q.unique_name(inits, wanted)
                inits[name] = onnx.numpy_helper.from_array(array, name)
                graph.initializer.append(inits[name])
                names.append(name)
            data, scales_zeros = names[0], names[1:]
            added = sum(a.nbytes for a in arrays.values())
        padded = -(-cols // table_block) * table_block
        out = node.output[0] if padded == cols else f"{node.output[0]}_padded"
        new.append(
            onnx.helper.make_node(
                "GatherBlockQuantized",
                [data, node.input[1], *scales_zeros],
                [out],
                name=f"{node.name}_Q{table_bits}",
                domain="com.microsoft",
                bits=table_bits,
                block_size=table_block,
                gather_axis=0,
                quantize_axis=1,
            )
        )
        if padded != cols:  # the quantized rows are whole blocks long
            bounds = []
            for suffix, value in (("starts", 0), ("ends", cols), ("axes", -1)):
                name = q.unique_name(inits, f"{node.name}_unpad_{suffix}")
                inits[name] = onnx.numpy_helper.from_array(np.array([value], dtype=np.int64), name)
                graph.initializer.append(inits[name])
                bounds.append(name)
            new.append(onnx.helper.make_node("Slice", [out, *bounds], [node.output[0]], name=f"{node.name}_unpad"))
        nodes.extend(new)
        graph.initializer.remove(inits.pop(table.name))
        done.append(
            {
                "gather": node.name,
                "table": [rows, cols],
                "bits": table_bits,
                "block_size": table_block,
                "shared_with": shared,
                "bytes_before": int(values.nbytes),
                "bytes_after": int(added),
            }
        )
    del graph.node[:]
    graph.node.extend(nodes)
    if done and not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return done


def _tied_head(
    table: np.ndarray,
    head_weights: dict[str, np.ndarray],
    quantized_heads: dict[str, onnx.NodeProto],
    inits: dict[str, onnx.TensorProto],
) -> str | None:
    """The quantized head whose float weight was ``table`` transposed and whose weights a
    GatherBlockQuantized can read (integer zero points: HQQ's float ones it cannot)."""
    for name, weight in head_weights.items():
        node = quantized_heads.get(name)
        if node is None or weight.shape != table.T.shape or not np.array_equal(weight, table.T):
            continue
        zeros = inits.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        if zeros is None or zeros.data_type == onnx.TensorProto.UINT8:
            return name
    return None


# ------------------------------------------------------------------ one form per weight (merged decoders)

_FORMS = ("int4", "int8", "float")  # least precise first
_QUANTIZED = {"MatMulNBits": ("MatMul", "Gemm"), "GatherBlockQuantized": ("Gather",)}


def weight_forms(original: ir.Model | onnx.ModelProto, result: ir.Model | onnx.ModelProto) -> dict[str, set[str]]:
    """``{weight: forms}``: how ``result`` (``original`` quantized) reads each 2-D+ float initializer of
    ``original`` that a MatMul, Gemm or Gather of it read, in every graph (an If's branches included):
    ``int4`` / ``int8`` where the reader became a MatMulNBits / GatherBlockQuantized of those bits (ORT and
    ``quantize_tables`` name it ``<reader>_Q<bits>``), ``float`` where a node still reads the weight itself.
    More than one form: the weight is stored once per form."""
    return {name: set(kinds) for name, kinds in weight_uses(original, result).items()}


def weight_uses(original: ir.Model | onnx.ModelProto, result: ir.Model | onnx.ModelProto) -> dict[str, dict[str, int]]:
    """``weight_forms`` with the accuracy level of each form's reader (0 for float and tables). Read off the
    IR, names and attributes only: a serialized copy of a large decoder's weights per round would double its
    peak memory."""
    before_model, after_model = _as_ir(original), _as_ir(result)
    forms: dict[str, dict[str, int]] = {}
    readers: set[str] = set()

    def walk(before: ir.Graph, after: ir.Graph, outer: set[str]) -> None:
        known = outer | _float_weights(before)
        by_name = {n.name: n for n in after if n.name}
        for node in before:
            slot = 0 if node.op_type == "Gather" else 1
            if node.op_type not in ("MatMul", "Gemm", "Gather") or len(node.inputs) <= slot:
                continue
            weight = node.inputs[slot]
            if weight is None or weight.name not in known:
                continue
            readers.add(weight.name)
            for bits in (4, 8):
                done = by_name.get(f"{node.name}_Q{bits}") if node.name else None
                if done is not None and node.op_type in _QUANTIZED.get(done.op_type, ()):
                    level = done.attributes.get("accuracy_level")
                    forms.setdefault(weight.name, {}).setdefault(f"int{bits}", level.value if level else 0)
        for node in after:
            for value in node.inputs:
                if value is not None and value.name in known:
                    forms.setdefault(value.name, {}).setdefault("float", 0)
        by_output = {n.outputs[0].name: n for n in after if n.outputs}
        for node in before:
            twin = by_output.get(node.outputs[0].name) if node.outputs else None
            if twin is None:
                continue
            for key, attr in node.attributes.items():
                other = twin.attributes.get(key)
                if attr.type == ir.AttributeType.GRAPH and other is not None and other.type == attr.type:
                    walk(attr.value, other.value, known)

    walk(before_model.graph, after_model.graph, set())
    # only weights a quantizable op reads: the rest are never quantized
    return {name: kinds for name, kinds in forms.items() if name in readers}


def _as_ir(model: ir.Model | onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(model) if isinstance(model, onnx.ModelProto) else model


def _float_weights(graph: ir.Graph) -> set[str]:
    return {
        name
        for name, value in graph.initializers.items()
        if value.const_value is not None
        and value.const_value.dtype == ir.DataType.FLOAT
        and len(value.const_value.shape) >= 2
    }


def _first_block_size(notes: dict[str, Any]) -> int | None:
    """The block size the first branch chose (the others were given it), from ``in_branches``' notes."""
    for branch in notes.get("branches", {}).values():
        size = branch.get("block_size") if isinstance(branch, dict) else None
        if isinstance(size, dict) and isinstance(size.get("chosen"), int):
            return size["chosen"]
    return None


def _call_pinned(
    model: ir.Model, ctx: PassContext, options: QuantizeInt4Options, pins: dict[str, tuple[str, int]]
) -> PassResult:
    """The branch quantized with the forms (and levels) agreed across the branches (``QuantizeInt4._agree``):
    no search, one build, held to the budget; a miss leaves the branch float, as a refusal does."""
    unchanged = q.unchanged(model)
    weight_of = {
        n.name: n.inputs[1].name
        for n in model.graph
        if n.op_type in ("MatMul", "Gemm") and n.name and len(n.inputs) > 1 and n.inputs[1] is not None
    }  # before unfusing: a transposed weight is a new initializer, pinned under its node's name
    if weight_matmuls.sites(model, transposed=False):
        model = ir.serde.deserialize_model(ir.serde.serialize_model(model))
        weight_matmuls.unfuse(model, transposed=False)
    candidates, non_matches, _ = _candidates(model, set(options.nodes_to_exclude))
    form = {c: pins.get(weight_of.get(c, ""), ("float", 0)) for c in candidates}
    int4 = [c for c in candidates if form[c][0] == "int4"]
    int8 = [c for c in candidates if form[c][0] == "int8"]
    tables = {t: pins[t][0] for t in _tables_read(model) if pins.get(t, ("float", 0))[0] != "float"}
    notes: dict[str, Any] = {"weight_forms": "agreed across the branches (pinned)", "candidates": len(candidates)}
    if not (int4 or int8 or tables):
        notes["decision"] = "float: every weight this branch reads stays float in the agreed forms"
        return PassResult(unchanged, False, {"nodes_quantized": 0}, non_matches, notes)
    size = options.block_size if isinstance(options.block_size, int) else 32
    sized = options.model_copy(update={"block_size": size})
    notes["block_size"] = {"chosen": size, "by": "agreed across the branches"}
    head_weights = _head_weights(model, lm_heads(model))  # a tied table reads its quantized head's weights

    def build() -> onnx.ModelProto:
        proto = ir.serde.serialize_model(model)
        groups: dict[tuple[int, int], list[str]] = {}
        for c in [*int4, *int8]:
            groups.setdefault((int(form[c][0][3:]), form[c][1]), []).append(c)
        for (bits, level), names in sorted(groups.items()):
            others = [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.name not in names]
            proto = quantize_proto(proto, sized, level, others, bits=bits, include=names)
        for bits in (4, 8):
            only = {t for t, kind in tables.items() if kind == f"int{bits}"}
            if only:
                quantize_tables(proto, head_weights, bits=bits, block_size=size, symmetric=sized.symmetric, only=only)
        return proto

    original = ir.serde.serialize_model(model)
    built = build()
    judge = Judge.of(model, ctx, options.max_samples)
    budget = q.budget_of(_budget_options(options))
    measured = _measure(
        original,
        {"agreed": built},
        ctx.samples,
        options.max_samples,
        judge,
        elements=budget.elements,
        timed=False,
    )
    if measured is None:
        notes["accuracy"] = "not measured: no samples give every input"
    else:
        accuracy = measured[0]["agreed"]
        if misses := budget.misses(accuracy):
            notes["decision"] = "refused: the agreed forms miss the budget here"
            reason = "the weight forms agreed with the other branch miss the budget here: " + "; ".join(misses)
            return PassResult(unchanged, False, {"nodes_quantized": 0}, [*non_matches, NonMatch(reason)], notes)
        notes["accuracy"] = {k: v.to_dict() for k, v in accuracy.items()}
    notes["decision"] = f"quantized with the agreed forms: {len(int4)} int4, {len(int8)} 8-bit, {len(tables)} table(s)"
    result = ir.serde.deserialize_model(built)
    counts = {"nodes_quantized": len(int4), "nodes_8bit": len(int8), "tables_quantized": len(tables)}
    if ctx.target == "cpu":
        folded, declined = fold_bias_adds(result)
        non_matches += declined
        counts["bias_adds_folded"] = folded
    notes["precision"] = precision_by_layer(result, candidates)
    after = q.tensor_bytes(ir.serde.serialize_model(result))
    notes["weight_bytes"] = {"before": q.tensor_bytes(original), "after": after}
    return PassResult(result, True, counts, non_matches, notes)


def _budget_options(options: QuantizeInt4Options, **given: Any) -> q.QuantizationOptions:
    """The quantization driver's options with this pass's accuracy budget (``given``: the rest)."""
    return q.QuantizationOptions(
        min_cosine=options.min_cosine,
        max_rel_error=options.max_rel_error,
        max_abs_error=options.max_abs_error,
        min_top1_agreement=options.min_top1_agreement,
        max_perplexity_increase=options.max_perplexity_increase,
        tolerance=options.tolerance,
        **given,
    )


def _head_weights(model: ir.Model, heads: Collection[str]) -> dict[str, np.ndarray]:
    """The float weights of the lm_head MatMuls ``heads``, before quantization: a token table equal to one of
    them transposed is tied to it (``quantize_tables``)."""
    return {
        node.name: node.inputs[1].const_value.numpy()
        for node in model.graph
        if node.name in heads and node.op_type == "MatMul" and node.inputs[1] is not None
        if node.inputs[1].const_value is not None
    }


def _tables_read(model: ir.Model) -> list[str]:
    """The constant 2-D tables the graph's Gathers read (``quantize_tables`` decides which it can take)."""
    return [
        n.inputs[0].name
        for n in model.graph
        if n.op_type == "Gather" and n.inputs and n.inputs[0] is not None and n.inputs[0].const_value is not None
        if n.inputs[0].name
    ]
