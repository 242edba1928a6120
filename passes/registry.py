"""The explicit pass registry and the presets.

Adding a pass: write ``passes/<name>.py``, its tests in ``tests/passes/test_<name>.py``, add the class to
``PASSES`` below (one line), and a CHANGELOG entry. Nothing registers itself by import side effect.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from core.config import EXACT_TOLERANCE, PassSpec, Tolerance
from core.errors import UnknownPassError
from passes._infra import Pass
from passes.cleanup.common_subexpression_elimination import CommonSubexpressionElimination
from passes.cleanup.constant_folding import ConstantFolding
from passes.cleanup.dead_node_elimination import DeadNodeElimination
from passes.cleanup.identity_elimination import IdentityElimination
from passes.cleanup.initializer_inputs import InitializerInputs
from passes.cleanup.shape_inference import ShapeInference
from passes.compute_order.label_sparsity import LabelSparsity
from passes.compute_order.padding_elimination import PaddingElimination
from passes.compute_order.range_gather_to_slice import RangeGatherToSlice
from passes.compute_order.upstream_reshape import UpstreamReshape
from passes.compute_order.upstream_slice import UpstreamSlice
from passes.fusion.fuse_gqa import FuseGqa
from passes.fusion.fuse_rotary import FuseRotary
from passes.fusion.fuse_transformer import FuseTransformer
from passes.fusion.pack_matmuls import PackMatmuls
from passes.fusion.unfuse_skip_layernorm import UnfuseSkipLayerNorm
from passes.fusion.upgrade_opset import UpgradeOpset
from passes.precision.float16 import Float16
from passes.precision.mixed_precision import MixedPrecision
from passes.precision.quantize_dynamic import QuantizeDynamic
from passes.precision.quantize_int4 import QuantizeInt4
from passes.precision.quantize_static import QuantizeStatic
from passes.prepost.extract_adapters import ExtractAdapters
from passes.prepost.prepost import Prepost
from passes.session.fix_shapes import FixShapes
from passes.session.free_shapes import FreeShapes
from passes.session.shape_profile import ShapeProfile
from passes.session.tune_session import TuneSession

PASSES: tuple[type[Pass], ...] = (
    InitializerInputs,
    ShapeInference,
    IdentityElimination,
    ConstantFolding,
    CommonSubexpressionElimination,
    DeadNodeElimination,
    LabelSparsity,
    PaddingElimination,
    UpstreamReshape,
    UpstreamSlice,
    RangeGatherToSlice,
    UpgradeOpset,
    FuseRotary,
    FuseGqa,
    FuseTransformer,
    PackMatmuls,
    UnfuseSkipLayerNorm,
    QuantizeDynamic,
    QuantizeStatic,
    QuantizeInt4,
    Float16,
    MixedPrecision,
    TuneSession,
    FixShapes,
    FreeShapes,
    ExtractAdapters,
    ShapeProfile,
    Prepost,  # opt-in only, never in a preset: it replaces the model's inputs
)

_BY_NAME: dict[str, type[Pass]] = {cls.name: cls for cls in PASSES}
assert len(_BY_NAME) == len(PASSES), "two registered passes share a name"


class Preset:
    """A named pass list and its tolerance. Entries are pass names or ``PassSpec`` (a pass with options);
    ``passes`` keeps the names (catalogue, cache keys), ``specs`` the full entries the pipeline builds.
    ``candidates`` (preset ``auto`` only) names the presets the pipeline tries instead of a pass list."""

    def __init__(
        self,
        name: str,
        summary: str,
        passes: Sequence[str | PassSpec],
        tolerance: Tolerance,
        *,
        candidates: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.summary = summary
        self.specs = [PassSpec(name=p) if isinstance(p, str) else p for p in passes]
        self.passes = [spec.name for spec in self.specs]
        self.tolerance = tolerance
        self.candidates = list(candidates)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "summary": self.summary,
            "passes": self.passes,
            "pass_specs": [spec.model_dump(mode="json") for spec in self.specs],
            "candidates": self.candidates,
            "tolerance": self.tolerance.model_dump(),
        }


_CLEANUP = [
    "initializer_inputs",  # first: every later pass and ORT then read the weights as constants
    "shape_inference",
    "identity_elimination",
    "constant_folding",
]
# Order matters. label_sparsity inserts a row filter that upstream_reshape and upstream_slice carry up
# through the LM head; CSE merges the copies a slice leaves on shared values, after which upstream_slice
# can move further (a second run crosses more ops on RoBERTa); constant_folding then folds the Reshape
# shapes upstream_slice made constant; dead_node_elimination comes last because moved slices and
# replaced shapes leave dead nodes behind.
_COMPUTE_ORDER = ["label_sparsity", "upstream_reshape", "upstream_slice"]
_AFTER = [
    "common_subexpression_elimination",
    "upstream_slice",
    "constant_folding",
    "range_gather_to_slice",
    "dead_node_elimination",
]
_SAFE = [*_CLEANUP, *_COMPUTE_ORDER, *_AFTER]
# padding_elimination is exact on valid positions only (pad positions of token-aligned outputs become
# zeros), so it is in `fast`, not `safe`.
# fuse_transformer comes after the compute-order passes (they match the unfused graph) and before the final
# dead_node_elimination; pack_qkv merges the Q/K/V projections wherever attention does not fuse into the
# packed com.microsoft::Attention (bench/README.md, presets section, has the measurements).
# unfuse_skip_layernorm follows the fusions: on CPU, ORT's SkipLayerNormalization kernel is 6-14x slower than
# Sum + LayerNormalization (bench/README.md, skip-layernorm section); it changes nothing on GPU targets.
_FAST_FUSION = PassSpec(name="fuse_transformer", options={"pack_qkv": True})
_FAST = [
    *_CLEANUP,
    # an export below opset 17 wrote every LayerNorm out; the passes after it read opset-17 graphs
    "upgrade_opset",
    *_COMPUTE_ORDER,
    "padding_elimination",
    *_AFTER[:-1],
    "fuse_rotary",  # rotary -> RotaryEmbedding; the attention fusions after it take rotated q/k as they are
    "fuse_gqa",  # decoder attention to GroupQueryAttention before fuse_transformer looks for attention
    _FAST_FUSION,
    "unfuse_skip_layernorm",
    _AFTER[-1],
]

# Not exact: int8 moves outputs by about 1e-2 relative, float16 by about 1e-3 (more near fp16's limits).
INT8_TOLERANCE = Tolerance(atol=5e-2, rtol=5e-2, min_cosine=0.99, max_mismatch_ratio=0.05)
FP16_TOLERANCE = Tolerance(atol=1e-2, rtol=1e-2, min_cosine=0.999, max_mismatch_ratio=0.01)
# Fusions first, stopping at MultiHeadAttention: QAttention has no attention_bias input, so a packed
# Attention would keep its QKV projection float; with Q/K/V packed into one MatMul, quantize_dynamic makes
# it one DynamicQuantizeMatMul (one activation quantization, one wide GEMM) and the attention core stays fused.
_INT8 = [
    *_CLEANUP,
    "upgrade_opset",
    PassSpec(name="fuse_transformer", options={"attention": "mha", "pack_qkv": True}),
    "unfuse_skip_layernorm",
    "quantize_dynamic",
    "dead_node_elimination",
]
_FP16 = [*_CLEANUP, "upgrade_opset", "fuse_transformer", "mixed_precision", "dead_node_elimination"]
# Weight-only int4 moves a random-weight decoder's logits by ~0.1 relative L2 (cosine > 0.99 on the corpus
# decoders, tests/models/decoders); the tensor tolerance is loose and quantize_int4 checks its own budget.
INT4_TOLERANCE = Tolerance(atol=1e-1, rtol=1e-1, min_cosine=0.98, max_mismatch_ratio=0.1)
# fuse_transformer stops at MultiHeadAttention there: what fuse_gqa leaves (a seq2seq decoder's self and cross
# attention, ALiBi) fuses with its projections kept as MatMuls for pack_matmuls and quantize_int4 to take.
_INT4 = [
    *_CLEANUP,
    "upgrade_opset",
    "fuse_rotary",
    "fuse_gqa",
    PassSpec(name="fuse_transformer", options={"attention": "mha"}),
    "unfuse_skip_layernorm",
    "pack_matmuls",
    "quantize_int4",
    "dead_node_elimination",
]

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "safe",
            "Exact passes only: every output computes the same values at every position.",
            _SAFE,
            EXACT_TOLERANCE,
        ),
        Preset(
            "fast",
            "Every pass that is exact within tolerance on the positions the model defines, kept only where "
            "it pays on the target.",
            _FAST,
            EXACT_TOLERANCE,
        ),
        Preset(
            "int8",
            "ORT transformer fusions, then dynamic int8 quantization of MatMul/Attention weights, accuracy-checked "
            "per output (CPU).",
            _INT8,
            INT8_TOLERANCE,
        ),
        Preset(
            "int4",
            "Decoder fusions (RotaryEmbedding, GroupQueryAttention; MultiHeadAttention and the norms for the rest), "
            "q/k/v and gate/up packed, then weight-only int4 "
            "MatMulNBits (block size and accuracy_level measured), the lm_head and token tables float or 8-bit, the "
            "int4/8-bit mix chosen by the greedy tokens each MatMul flips (CPU decoders).",
            _INT4,
            INT4_TOLERANCE,
        ),
        Preset(
            "fp16",
            "Transformer fusions, then float16 with the fewest float32 nodes that meet tolerance (GPU targets; "
            "mixed_precision refuses on cpu).",
            _FP16,
            FP16_TOLERANCE,
        ),
        Preset(
            "auto",
            "Within config.time_budget_s, run the candidate presets (safe, fast, fast + fuse_transformer; int8 when "
            "the job's tolerance is as loose as int8's; fp16 on GPU targets when as loose as fp16's), benchmark "
            "each result against the original and keep the fastest within tolerance.",
            [],
            EXACT_TOLERANCE,
            candidates=["safe", "fast", "fast+fuse_transformer", "int8", "fp16"],
        ),
    )
}

# Pass lists of the auto candidates that are not presets of their own.
AUTO_VARIANTS: dict[str, list[PassSpec]] = {
    # fast fuses attention fully; this variant leaves the attention core to ORT's kernels, which can be the
    # faster choice on CPUs at short sequences.
    "fast+fuse_transformer": [
        PassSpec(name="fuse_transformer", options={"attention": "none", "pack_qkv": True})
        if spec == _FAST_FUSION
        else spec
        for spec in PRESETS["fast"].specs
    ],
}


def variant_specs(name: str) -> list[PassSpec]:
    """The pass specs of an auto candidate: a preset's, or one of ``AUTO_VARIANTS``."""
    if name in AUTO_VARIANTS:
        return list(AUTO_VARIANTS[name])
    return list(get_preset(name).specs)


def tolerance_allows(job: Tolerance, needed: Tolerance) -> bool:
    """True when ``job`` is at least as loose as ``needed`` on every bound (the opt-in to a lossy candidate)."""
    return (
        job.atol >= needed.atol
        and job.rtol >= needed.rtol
        and job.min_cosine <= needed.min_cosine
        and job.max_mismatch_ratio >= needed.max_mismatch_ratio
    )


def _unknown(kind: str, name: str, known: Sequence[str]) -> UnknownPassError:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(sorted(known))}"
    error = UnknownPassError(f"unknown {kind} {name!r}{hint}", detail={"name": name, "close_matches": close})
    if kind == "preset":
        error.code = "UNKNOWN_PRESET"
    return error


def get_pass_class(name: str) -> type[Pass]:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise _unknown("pass", name, list(_BY_NAME)) from None


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise _unknown("preset", name, list(PRESETS)) from None


def build_passes(specs: Sequence[PassSpec]) -> list[Pass]:
    """Instantiate passes from specs, validating every name and option before anything runs."""
    return [get_pass_class(spec.name)(spec.options) for spec in specs]


def catalogue() -> list[dict[str, Any]]:
    return [
        {
            "name": cls.name,
            "summary": cls.summary,
            "exact": cls.exact,
            "in_place": cls.in_place,
            "options_schema": cls.options_schema(),
        }
        for cls in PASSES
    ]
