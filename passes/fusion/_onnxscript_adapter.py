"""The one place onnxforge reaches into onnxscript below its exported API.

onnxscript exports ``optimize_for_ort`` (every ORT fusion, in its own order, with no way to stop before
packing Q/K/V into ``Attention``), the pattern API (``onnxscript.rewriter.pattern``: ``RewriteRule``,
``RewriteRuleSet``, ``MatchingTracer``...) and the common rules (``onnxscript.rewriter.rules.common``). The
per-fusion rule sets (``ort_fusions.sdpa.sdpa_rules``, ``ort_fusions.mha.mha_rules_no_past``...) live in
modules that ``ort_fusions/__init__.py`` does not export: the next release may rename them. So they are
looked up here, by name, in one table (``_RULE_SETS``), and ``check_api()`` resolves every one of them: its
test fails with the missing dotted name and the installed version instead of a fusion silently vanishing
from the ``fast`` preset. The range this table was read from is pinned in pyproject.toml.

``fuse_for_ort`` replays ``ort_fusions._core.optimize_for_ort`` of onnxscript 0.7.2 step by step (its test
checks the replay builds the same graph as the exported function where that graph is right), with
``stop_before`` cutting the attention steps for ``fuse_transformer``'s ``attention`` option, and steps of
ours where onnxscript's rules miss an exporter's form: ``_rms_norm_opset17`` (the RMS norms in every form the
torch exporters write, whatever the opset), ``_merge_heads`` (keeps onnxscript's MHA rule from absorbing a
flattening Reshape), ``_attention_bias`` (T5's relative position bias and mask as one ``attention_bias``),
``_concat_shape`` (a length read off a grown cache, ``Shape(Concat(past, new))``, read off its parts, so the
with-past MHA rule can take the Concat without a cycle), ``_heads_3d`` (``torch.nn.MultiheadAttention``'s
sequence-first folded heads, which no SDPA rule reads, straight to ``MultiHeadAttention``), ``_shared_scale``
(a scaled query another product reads too, DeBERTa's, copied for the scores), ``_tanh_gelu``
(GPT-2's GELU with its bias) and ``_erf_gelu`` (ESM's erf GELU, the half applied first), each before the step
it feeds. Two steps' rules are onnxscript's with a check of ours (``_RULE_CLASSES``): ``mha_bias``
(only 1-D projection biases join MultiHeadAttention's ``bias``) and ``partial_rotary_embedding`` (the merged
rotation gets the ``num_heads`` ORT requires, ``_rotary_heads``); ``sdpa`` refuses what no ORT kernel takes or
was measured slower fused (``_kernel_fit``: heads along an input's axis; with ``latent_attention=False``,
multi-head latent attention).
After every onnxscript step, a constant its rewriter unregistered while nodes still read it is registered
again (``passes/_dangling.py``; counted as ``constants_reattached``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from typing import Literal, TypeVar

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxscript
from onnxscript import optimizer
from onnxscript.rewriter import pattern, rewrite
from onnxscript.rewriter.ort_fusions import ORT_PATTERN_REWRITE_RULES
from onnxscript.rewriter.rules.common import gemm_to_matmul_add_rule

from passes import _dangling as dangling
from passes.fusion import _attention_bias as attention_bias
from passes.fusion import _concat_shape as concat_shape
from passes.fusion import _erf_gelu as erf_gelu
from passes.fusion import _heads_3d as heads_3d
from passes.fusion import _kernel_fit as kernel_fit
from passes.fusion import _key_transpose as key_transpose
from passes.fusion import _layer_norm_forms as layer_norm_forms
from passes.fusion import _merge_heads as merge_heads
from passes.fusion import _mha_bias_order as mha_bias_order
from passes.fusion import _mha_kv_layout as mha_kv_layout
from passes.fusion import _rms_norm_opset17 as rms_norm_opset17
from passes.fusion import _rotary_heads as rotary_heads
from passes.fusion import _shared_scale as shared_scale
from passes.fusion import _tanh_gelu as tanh_gelu

# The onnxscript releases whose unexported names below were checked; pyproject.toml pins the same range.
SUPPORTED_VERSIONS = ">=0.7.2,<0.8"
VERSION = onnxscript.__version__

_FUSIONS = "onnxscript.rewriter.ort_fusions"
# step -> (module, attribute): the rule sets optimize_for_ort applies, in its order.
_RULE_SETS: dict[str, tuple[str, str]] = {
    "shape_optimization": (f"{_FUSIONS}.shape_optimization", "rules"),
    "erf_gelu": (f"{_FUSIONS}.erfgelu", "rules"),
    "rms_normalization": (f"{_FUSIONS}.rms_normalization", "rms_normalization_ruleset"),
    "skip_layer_normalization": (f"{_FUSIONS}.skip_normalization", "skip_layer_normalization_ruleset"),
    "skip_rms_normalization": (f"{_FUSIONS}.skip_normalization", "skip_rms_normalization_ruleset"),
    "rotary_embedding": (f"{_FUSIONS}.rotary_embedding", "rotary_embedding_rules"),
    "cos_sin_cache": (f"{_FUSIONS}.cos_sin_cache", "cos_sin_cache_rules"),
    "partial_rotary_embedding": (f"{_FUSIONS}.rotary_embedding", "partial_embedding_rules"),
    "sdpa": (f"{_FUSIONS}.sdpa", "sdpa_rules"),
    "gqa": (f"{_FUSIONS}.gqa", "gqa_rules"),
    "packed_qkv_for_gqa": (f"{_FUSIONS}.gqa_packed_qkv", "fuse_qkv_gqa_rules"),
    "mha1": (f"{_FUSIONS}.mha", "mha_rules_with_past"),
    "mha2": (f"{_FUSIONS}.mha", "mha_rules_no_past"),
    "mha_scale": (f"{_FUSIONS}.mha_scale", "_mha_scale_rules"),
    "mha_bias": (f"{_FUSIONS}.mha_bias", "mha_bias_rules"),
    "attention": (f"{_FUSIONS}.attention", "attention_rules"),
    "gelu": (f"{_FUSIONS}.gelu", "gelu_rules"),
    "bias_gelu": (f"{_FUSIONS}.bias_gelu", "bias_gelu_rules"),
    "sdpa_via_mha": (f"{_FUSIONS}.sdpa_via_mha", "_rules"),
}
# step -> (module, class): the rule a step's rule set is rebuilt from, with a check of ours added (_checked_rules).
_RULE_CLASSES: dict[str, tuple[str, str]] = {
    "mha_bias": (f"{_FUSIONS}.mha_bias", "FuseBiasMHA"),
    "partial_rotary_embedding": (f"{_FUSIONS}.rotary_embedding", "PartialRotaryEmbeddingFusion"),
}
_SDPA_CLASS = (f"{_FUSIONS}.sdpa", "SDPA")  # the SDPA rule, with the kernels' fit checked (_sdpa_rules)
# The steps a stop point leaves out: "mha" keeps MultiHeadAttention unpacked, "none" leaves no SDPA to fuse.
_CUT = {"attention": (), "mha": ("attention",), "none": ("sdpa", "attention")}


_T = TypeVar("_T")
_LAYER_NORM_OPSET = 17  # ONNX's LayerNormalization


class OnnxscriptAPIChangedError(ImportError):
    """An onnxscript name this adapter relies on is gone: the installed release is outside the pinned range."""


def rule_set(step: str) -> pattern.RewriteRuleSet:
    """onnxscript's rule set for one fusion step, by the step's name in ``_RULE_SETS`` (rebuilt with a check of
    ours for the steps in ``_RULE_CLASSES``)."""
    if step in _RULE_CLASSES:
        return _checked_rules(step)
    rules = _resolve(*_RULE_SETS[step], pattern.RewriteRuleSet)  # resolved each time: check_api's test renames it
    return _sdpa_rules(latent_attention=True) if step == "sdpa" else rules


@functools.cache  # one rule set per step, as onnxscript's own are module-level: fuse_for_ort asks for it per run
def _checked_rules(step: str) -> pattern.RewriteRuleSet:
    """onnxscript's rule for ``step`` with a check of ours, under the rule's own name (the one onnxscript records).

    ``mha_bias``: FuseBiasMHA reads any Add in front of a MultiHeadAttention's query, key or value as a projection
    bias and concatenates the three into MHA's 1-D ``bias``; conditional DETR adds a position term of rank 3 there
    (``k = k_content + k_pos``), and the Concat of ranks 3 and 1 made the candidate invalid. Here only 1-D biases
    join (``mha_bias_order.not_projection_biases``).

    ``partial_rotary_embedding``: the merged rotation gets ``num_heads``, which ORT requires beside
    ``rotary_embedding_dim`` (``_rotary_heads``); where the graph does not say it, the rotation stays partial."""
    _resolve(*_RULE_SETS[step], pattern.RewriteRuleSet)  # the set it stands for is still there (check_api)
    base = _resolve(*_RULE_CLASSES[step], type)
    if step == "mha_bias":

        class ProjectionBiasesOnly(base):  # type: ignore[misc, valid-type]
            def check(self, context, **bindings):  # type: ignore[no-untyped-def]
                why = mha_bias_order.not_projection_biases(bindings)
                if why is not None:
                    return pattern.MatchResult().fail(why)
                return super().check(context, **bindings)

        return pattern.RewriteRuleSet([ProjectionBiasesOnly.rule(name=base.__name__)])

    class WithHeads(base):  # type: ignore[misc, valid-type]
        def check(self, context, x, x_part_1_rope, **bindings):  # type: ignore[no-untyped-def]
            self.heads = x_part_1_rope.producer().attributes.get_int("num_heads", 0) or None
            if self.heads is None:
                concat = next((node for node, _ in x_part_1_rope.uses() if node.op_type == "Concat"), None)
                self.heads = rotary_heads.heads(x, concat.outputs[0]) if concat is not None else None
            if self.heads is None:
                return pattern.MatchResult().fail("the rotated tensor's head count is unknown (ORT needs num_heads)")
            return super().check(context, x=x, x_part_1_rope=x_part_1_rope, **bindings)

        def rewrite(self, op, **bindings):  # type: ignore[no-untyped-def]
            merged = super().rewrite(op, **bindings)
            merged.producer().attributes["num_heads"] = ir.AttrInt64("num_heads", self.heads)
            return merged

    return pattern.RewriteRuleSet([WithHeads.rule(name=base.__name__)])


@functools.cache
def _sdpa_rules(latent_attention: bool) -> pattern.RewriteRuleSet:
    """onnxscript's SDPA rule refusing attention no ORT kernel takes (heads along an input's axis), and with
    ``latent_attention`` False multi-head latent attention, measured slower fused (``_kernel_fit``)."""
    base = _resolve(*_SDPA_CLASS, type)

    class KernelFit(base):  # type: ignore[misc, valid-type]
        def check(self, context, query, value, **bindings):  # type: ignore[no-untyped-def]
            why = kernel_fit.heads_along_input(query)
            if why is None and not latent_attention and kernel_fit.latent(query, value):
                why = f"multi-head latent attention (values narrower than the keys): {kernel_fit.LATENT_SLOWER}"
            if why is None:
                return super().check(context, query=query, value=value, **bindings)
            # The report reads the reason off the Softmax: shapes known here may be gone by then (TorchScript's).
            for node in context.nodes:
                if node.op_type == "Softmax":
                    kernel_fit.mark(node, why)
            return pattern.MatchResult().fail(why, query)

    return pattern.RewriteRuleSet([KernelFit.rule(name=base.__name__)])


def _resolve(module_name: str, attribute: str, kind: type) -> object:
    where = f"{module_name}.{attribute}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise _changed(where, f"module {module_name} is gone ({exc})") from exc
    if not hasattr(module, attribute):
        raise _changed(where, f"{module_name} has no {attribute!r}")
    found = getattr(module, attribute)
    if kind is type and not isinstance(found, type):
        raise _changed(where, f"it is a {type(found).__name__}, not a class")
    if kind is not type and not isinstance(found, kind):
        raise _changed(where, f"it is a {type(found).__name__}, not a {kind.__name__}")
    return found


def check_api() -> list[str]:
    """Resolve every unexported name used here; the dotted names, or OnnxscriptAPIChangedError on the first gone."""
    for step in _RULE_SETS:
        rule_set(step)
    _sdpa_rules(latent_attention=False)
    return [".".join(location) for location in (*_RULE_SETS.values(), *_RULE_CLASSES.values(), _SDPA_CLASS)]


def _changed(where: str, what: str) -> OnnxscriptAPIChangedError:
    return OnnxscriptAPIChangedError(
        f"onnxscript {VERSION} changed {where}: {what}. passes/fusion/_onnxscript_adapter.py was "
        f"written against onnxscript{SUPPORTED_VERSIONS}; re-read its ort_fusions/_core.py and update the table."
    )


def fuse_for_ort(
    model: ir.Model, stop_before: Literal["attention", "mha", "none"] = "attention", latent_attention: bool = True
) -> dict[str, int]:
    """onnxscript's ORT fusions in place, in ``optimize_for_ort``'s order; the count applied per step.

    ``stop_before`` names the deepest attention fusion wanted: "attention" (packed Q/K/V), "mha"
    (MultiHeadAttention, projections left separate) or "none" (the attention core left to ORT).
    ``latent_attention``: whether attention with values narrower than its keys fuses (False in a decoder:
    multi-head latent attention, ``_kernel_fit``).
    """
    cut = _CUT[stop_before]
    counts: dict[str, int] = {"constants_reattached": 0}

    def settled(result: _T) -> _T:
        # onnxscript's rewriter can evict an initializer other nodes still read (passes/_dangling.py): put each
        # back right after the step, before a later one serializes the graph without it.
        counts["constants_reattached"] += dangling.reattach_constants(model.graph)
        # It also inserts a replacement where the last matched node stood: a residual sum's other reader (PEGASUS-X's
        # Shape of it) between the Add and the norm then reads SkipLayerNormalization's sum output before the node
        # is listed. ORT sorts on load, onnx's checker and onnx-ir's clone refuse it (the candidate was refused,
        # and the per-layer reasons raised): the stable sort keeps every other node where it was. A cycle cannot be
        # sorted: left as it is, the candidate's check refuses it and the report says which layers it had fused.
        with contextlib.suppress(ValueError):
            model.graph.sort()
        return result

    def fuse(step: str, shape_inference: bool = False, count_as: str | None = None) -> None:
        rules = _sdpa_rules(latent_attention) if step == "sdpa" else rule_set(step)
        counts[count_as or step] = 0 if step in cut else settled(rules.apply_to_model(model))
        if shape_inference and step not in cut:  # the SDPA rules add nodes whose shapes later steps read
            common_passes.ShapeInferencePass()(model)

    settled(rewrite(model, [gemm_to_matmul_add_rule]))
    common_passes.ShapeInferencePass()(model)
    settled(optimizer.optimize(model))
    settled(rule_set("shape_optimization").apply_to_model(model))
    settled(optimizer.optimize(model))
    # Ours: RMS norms in the forms the exporters write that onnxscript's rule does not read (_rms_norm_opset17).
    counts["layer_norms_written_out"] = 0
    if model.opset_imports.get("", 0) >= _LAYER_NORM_OPSET:  # a hand-written norm (Cohere's), before its Skip step
        for rules in (layer_norm_forms.rules, layer_norm_forms.unbiased_rules):
            counts["layer_norms_written_out"] += settled(rules.apply_to_model(model))
    counts["rms_norms_opset17"] = settled(rms_norm_opset17.rules.apply_to_model(model))
    counts["rms_norms_opset17"] += settled(rms_norm_opset17.unscaled_rules.apply_to_model(model))
    for step in ("erf_gelu", "rms_normalization", "skip_layer_normalization", "skip_rms_normalization"):
        fuse(step)
    fuse("rotary_embedding")
    fuse("cos_sin_cache")
    common_passes.CommonSubexpressionEliminationPass()(model)
    fuse("partial_rotary_embedding")
    # Ours, not onnxscript's: keeps the MHA rule from swallowing a flattening Reshape (see _merge_heads).
    counts["merge_heads_split"] = 0 if "sdpa" in cut else settled(merge_heads.rules.apply_to_model(model))
    # Ours too: T5's relative position bias and its mask become one attention_bias (see _attention_bias).
    counts["attention_biases_grouped"] = 0 if "sdpa" in cut else settled(attention_bias.rules.apply_to_model(model))
    # Ours: a length read off a grown cache (T5's key length for its position bias) from the Concat's inputs;
    # the with-past MHA rule (mha1) replaces that Concat with the attention's present output, which the Shape
    # would then read to compute the attention's own bias: a cycle, and the candidate refused (_concat_shape).
    counts["concat_shapes_split"] = 0 if "sdpa" in cut else concat_shape.split_concat_shapes(model)
    # Ours: attention on heads folded into the batch, sequence first (F.multi_head_attention_forward's bmm), which
    # the SDPA rule reads in 4-D only, straight to MultiHeadAttention (_heads_3d); constants are folded by now.
    counts["folded_heads_mha"] = 0 if "sdpa" in cut else settled(heads_3d.fuse_folded_heads(model))
    # Ours: a scaled query another product reads too (DeBERTa's content-to-position term) gets a copy of its
    # scaling for the scores, which the SDPA rule otherwise refuses to replace (_shared_scale); after the CSE above.
    counts["scores_scale_copied"] = 0 if "sdpa" in cut else shared_scale.give_scores_their_own_scale(model)
    # Ours: a key laid out [B, h, d, S] by its own projection (SqueezeBERT's), given the transpose the SDPA rule
    # reads; here, after the optimizer, which would fold the pair away (_key_transpose).
    counts["key_transposes_exposed"] = 0 if "sdpa" in cut else key_transpose.expose(model)
    fuse("sdpa", shape_inference=True)
    # Ours: onnxscript's cross-attention MHA rule transposes SDPA's key as [B, H, S, d] whatever its key_format
    # says; a [B, S, H, d] key (DAB-DETR's) whose S equals H passed its shape check and fused wrong (refused by
    # verification): each such key is given heads first, explicitly, as every MHA rule reads it (_kernel_fit).
    counts["sdpa_keys_heads_first"] = 0 if "sdpa" in cut else kernel_fit.keys_heads_first(model)
    # onnxscript's GQA rewrite computes seqlens_k as the row maximum of the RotaryEmbedding's [batch, sequence]
    # position_ids; fuse_rotary gives a rotation whose table is cut to the sequence the kernel's one-element
    # start instead, on which that ReduceMax is invalid (the candidate failed to load): MultiHeadAttention there.
    starts = _rotary_from_start(model)
    for step in ("gqa", "packed_qkv_for_gqa", "mha1", "mha2", "mha_scale"):
        if starts and step in ("gqa", "packed_qkv_for_gqa"):
            counts[step] = 0
            continue
        fuse(step)
    # Ours: TorchScript's Add(bias, MatMul), which the mha_bias rule reads in the other order only.
    counts["projection_biases_turned"] = mha_bias_order.put_projection_biases_last(model)
    counts["standing_mha_bias"] = counts["standing_attention"] = 0
    if counts["mha1"] == 0 and counts["mha2"] == 0:
        counts["mha_bias"] = counts["attention"] = 0
        # Ours: onnxscript packs only the attention its own rules fused; fuse_gqa's exact MultiHeadAttention
        # (a causal encoder: CLIP's text tower) gets its biases and packing too, where no cache is involved.
        if mha_bias_order.standing_attention(model):
            fuse("mha_bias", count_as="standing_mha_bias")
            fuse("attention", count_as="standing_attention")
    else:
        fuse("mha_bias")
        fuse("attention")
    # Ours: GPT-2's (0.5 * x) * (1 + tanh(..)) order, with its bias, which onnxscript's gelu rule does not read.
    counts["tanh_gelu"] = settled(tanh_gelu.rules.apply_to_model(model))
    # Ours: (x * 0.5) * (1 + erf(x / sqrt 2)), ESM's order, which onnxscript's erf_gelu rules do not read.
    counts["erf_gelu_half_first"] = settled(erf_gelu.rules.apply_to_model(model))
    for step in ("gelu", "bias_gelu", "sdpa_via_mha"):
        fuse(step)
    settled(optimizer.optimize(model))  # inlines the intermediate fusion functions no later rule consumed
    settled(rewrite(model, ORT_PATTERN_REWRITE_RULES))
    ir.passes.Sequential(
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=1),
        common_passes.RemoveInitializersFromInputsPass(),
        common_passes.ShapeInferencePass(),
    )(model)
    # Ours: sdpa_via_mha's Expand of a bias that already has the query length copies it for nothing.
    counts["noop_bias_expands"] = attention_bias.drop_noop_bias_expands(model)
    # Ours: sdpa_via_mha transposes a [B, N, T, H] cache to [B, T, N*H]; MultiHeadAttention reads it as it is.
    counts["heads_first_kv"] = mha_kv_layout.read_heads_first_kv(model)
    return counts


def _rotary_from_start(model: ir.Model) -> bool:
    """Whether a RotaryEmbedding reads a one-element start (rows 0..S-1) instead of [batch, sequence] positions."""
    for node in model.graph:
        if node.op_type == "RotaryEmbedding" and node.domain == "com.microsoft" and len(node.inputs) > 1:
            positions = node.inputs[1]
            if positions is not None and positions.shape is not None and len(positions.shape) == 1:
                return True
    return False


def closest_match(model: ir.Model, step: str) -> str:
    """Where onnxscript's rule set for ``step`` came closest to matching, as a sentence for the report.

    Uses the exported ``MatchingTracer``; the fields of the matches it records (``MatchInfo``) are not
    documented, so they are read here and nowhere else.
    """
    copy = model.clone()  # tracing must never touch the result; the clone shares the weights, never written
    tracer = pattern.MatchingTracer()
    rule_set(step).apply_to_model(copy, tracer=tracer)
    best = max((m for ms in tracer.best_matches_map.values() for m in ms), key=lambda m: m.score(), default=None)
    if best is None:
        return f"onnxscript {step}: no partial match at all"
    result = best.match_result
    if best.status.name == "SUCCESS":
        return f"onnxscript's {step} rule matches at {best.root_node.name!r}: the onnxscript engine fuses it"
    if len(result.nodes) <= 1:  # any MatMul is a root the SDPA rule tries: naming one (an FFN's) misleads
        return (
            f"onnxscript {step}: no partial match beyond the pattern's first node ({best.root_node.op_type}): no "
            "block of this graph is written in a form the rule reads"
        )
    return (
        f"closest onnxscript {step} match: {len(result.nodes)} nodes matched at {best.root_node.name!r} "
        f"({best.status.name}): {result.reason or 'pattern diverges there'}"
    )


@dataclasses.dataclass(frozen=True)
class Attempt:
    """The best attempt of a rule set at one root node: how far its pattern got and why it stopped."""

    rule: str
    status: str  # onnxscript's MatchStatus name: NO_MATCH, CONDITION_FAILED, REPLACEMENT_FAILED, SUCCESS
    matched: int  # pattern nodes matched before it stopped
    reason: str

    def describe(self) -> str:
        if self.status == "SUCCESS":
            return f"{self.rule} matches here now (an earlier rewrite or a later step stopped it)"
        why = self.reason or "pattern diverges"
        return f"{self.rule} stopped after {self.matched} matched nodes ({self.status}): {why}"


class _PerRootTracer(pattern.MatchingTracer):
    """The exported tracer keeps only the best-scoring matches of a rule over the whole graph; this keeps the
    best one at every root node, so that each layer gets its own reason. ``log`` is the tracer's hook, called
    by the rewriter for every attempt (onnxscript 0.7.2)."""

    def __init__(self) -> None:
        super().__init__()
        self.per_root: dict[str, tuple[int, Attempt]] = {}

    def log(self, rule, container, node, match_result, status) -> None:  # type: ignore[override]
        super().log(rule, container, node, match_result, status)
        score = len(match_result.nodes) + int(status.value) * 100
        best = self.per_root.get(node.name or "")
        if best is None or score > best[0]:
            name = getattr(rule, "name", None) or type(rule).__name__
            reason = match_result.reason or ""
            self.per_root[node.name or ""] = (score, Attempt(name, status.name, len(match_result.nodes), reason))


def trace_roots(model: ir.Model, rule_sets: list[pattern.RewriteRuleSet | str]) -> dict[str, Attempt]:
    """Root node name -> the best attempt of any of ``rule_sets`` (steps named as in ``_RULE_SETS``, or rule
    sets of ours) there, traced on a copy: tracing never touches ``model``."""
    tracer = _PerRootTracer()
    for rules in rule_sets:
        copy = model.clone()  # shares the weights (a serialized copy copied them all, per rule set)
        (rule_set(rules) if isinstance(rules, str) else rules).apply_to_model(copy, tracer=tracer)
    return {root: attempt for root, (_score, attempt) in tracer.per_root.items()}
