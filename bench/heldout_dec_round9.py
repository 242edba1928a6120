"""Held-out probe round 9 (issues 17/19): the decoder families no earlier round built: Mellum, Kolibri 1 and Flint
(sliding windows and MoE), Granite MoE shared and Granite MoE SWA, Mistral 4 (MLA with interleaved rope), A.X K2 and
GLM MoE DSA (MLA with a sparse indexer), LongCat Flash (MLA with zero-compute experts), LFM3 (short convolutions
beside full and sliding attention), Kimi Linear (MLA beside linear attention) and OpenAI's privacy filter (a
bidirectional token classifier with attention sinks).

Run ``python -m bench.heldout_dec_round9 [--only NAME ...] [--forms nocache past] [--exporters E ...]
[--presets fast int4] [--reuse] [--table]``: the options, the builds and the columns are round 2's
(``bench/heldout_dec_round2.py``: 2 layers, hidden 64, 4 heads of 16, 2 key/value heads where the family has
GQA, vocabulary 1024, weights perturbed), the models are this round's; the hybrids, the indexers and the
classifier go without a cache (``--forms nocache``). Rows go to ``bench/out/heldout/dec_round9/<name>.rows.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import heldout_dec_round2 as round2  # noqa: E402
from bench.heldout_dec_round2 import _MOE, Model  # noqa: E402
from bench.heldout_dec_round8 import _BATCHED, _MLA, _mla  # noqa: E402  (round 8's latent sizes and experts)

OUT = REPO / "bench" / "out" / "heldout" / "dec_round9"
SCRIPT = "bench.heldout_dec_round9"
_LOCAL = {"num_local_experts": 4, "experts_implementation": "batched_mm", **_MOE}
_WINDOWED = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}
_INDEXER = {"index_n_heads": 2, "index_head_dim": 16, "index_topk": 8}


NAMES = round2.register(
    (
        Model(
            "mellum",
            "MellumConfig",
            "MellumForCausalLM",
            {"head_dim": 16, "moe_intermediate_size": 32, **_LOCAL, **_WINDOWED},
            note="sliding windows of 64, MoE",
        ),
        Model(
            "kolibri1",
            "Kolibri1Config",
            "Kolibri1ForCausalLM",
            {"head_dim": 16, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, **_LOCAL, **_WINDOWED},
            note="sliding windows of 64, MoE with a shared expert",
        ),
        Model(
            "flint",
            "FlintConfig",
            "FlintForCausalLM",
            {
                "head_dim": 16,
                "num_experts": 4,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
                "experts_implementation": "batched_mm",
                **_MOE,
                **_WINDOWED,
            },
            note="sliding windows of 64, MoE with a shared expert",
        ),
        Model("granitemoeshared", "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", _LOCAL, note="MoE"),
        Model(
            "granitemoe_swa",
            "GraniteMoeSWAConfig",
            "GraniteMoeSWAForCausalLM",
            {**_LOCAL, **_WINDOWED},
            note="MoE, sliding windows of 64",
        ),
        _mla(
            "mistral4",
            "Mistral4Config",
            "Mistral4ForCausalLM",
            {**_BATCHED, "first_k_dense_replace": 0},
            "MLA, interleaved rope, MoE",
        ),
        _mla("axk2", "AXK2Config", "AXK2ForCausalLM", {**_BATCHED, **_INDEXER}, "MLA with a sparse indexer, MoE"),
        _mla(
            "glm_moe_dsa",
            "GlmMoeDsaConfig",
            "GlmMoeDsaForCausalLM",
            {**_BATCHED, **_INDEXER},
            "MLA with a sparse indexer, MoE",
        ),
        _mla(
            "longcat_flash",
            "LongcatFlashConfig",
            "LongcatFlashForCausalLM",
            {
                "n_routed_experts": 4,
                "zero_expert_num": 2,
                "expert_ffn_hidden_size": 32,
                "moe_topk": 2,
                "ffn_hidden_size": 128,
                "head_dim": 8,  # the rope dims: the default 64 sizes the rope tables
                "experts_implementation": "batched_mm",
            },
            "MLA twice per layer, MoE with zero-compute experts",
        ),
        Model(
            "lfm3",
            "Lfm3Config",
            "Lfm3ForCausalLM",
            {
                "head_dim": 16,
                "layer_types": ["conv", "sliding_attention", "full_attention"],
                "sliding_window": 64,
                "num_hidden_layers": 3,
            },
            note="a short convolution, then sliding and full attention",
        ),
        Model(
            "kimi_linear",
            "KimiLinearConfig",
            "KimiLinearForCausalLM",
            {
                **_MLA,
                "num_experts": 4,
                "num_experts_per_token": 2,
                "moe_intermediate_size": 32,
                "num_shared_experts": 1,
                "first_k_dense_replace": 1,
                "linear_head_dim": 16,
                "linear_num_heads": 4,
                "linear_attn_config": {
                    "kda_layers": [1],
                    "full_attn_layers": [2],
                    "head_dim": 16,
                    "num_heads": 4,
                    "short_conv_kernel_size": 4,
                },
            },
            kv_heads=4,
            note="Kimi delta attention on layer 1, MLA on layer 2",
        ),
        Model(
            "openai_privacy_filter",
            "OpenAIPrivacyFilterConfig",
            "OpenAIPrivacyFilterForTokenClassification",
            {
                "head_dim": 16,
                "num_local_experts": 4,
                "experts_implementation": "batched_mm",
                **_MOE,
                "sliding_window": 64,
            },
            note="bidirectional token classifier, attention sinks, MoE",
        ),
    )
)


def main(argv: list[str] | None = None) -> int:
    return round2.main(argv, names=NAMES, script=SCRIPT, doc=__doc__, out=OUT)


if __name__ == "__main__":
    raise SystemExit(main())
