"""Held-out probe round 7 (issues 17/19): decoder families transformers added since round 6: Gemma 4 (per-layer
inputs, proportional partial rope on its global layers, sliding windows), ERNIE 4.5 and its MoE, Hunyuan v3,
HyperCLOVA X, GPT-NeoX Japanese, Granite SWA, Cohere 2 MoE, MiMo v2 Flash, Solar Open, HRM text, Laguna and ZAYA.

Run ``python -m bench.heldout_dec_round7 [--only NAME ...] [--forms nocache past] [--exporters E ...]
[--presets fast int4] [--reuse] [--table]``: the options, the builds and the columns are round 2's
(``bench/heldout_dec_round2.py``: 2 layers, hidden 64, 4 heads of 16, 2 key/value heads where the family has
GQA, vocabulary 1024, weights perturbed), the models are this round's. Rows go to
``bench/out/heldout/dec_round7/<name>.rows.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import heldout_dec_round2 as round2  # noqa: E402
from bench.heldout_dec_round2 import _MOE, Model  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "dec_round7"
SCRIPT = "bench.heldout_dec_round7"
_WINDOWED = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}
_EXPERTS = {"num_experts": 4, "moe_intermediate_size": 32, "experts_implementation": "batched_mm", **_MOE}
_ROUTED = {"n_routed_experts": 4, "moe_intermediate_size": 32, "experts_implementation": "batched_mm", **_MOE}
_DENSE_FIRST = {"mlp_layer_types": ["dense", "sparse"]}

NAMES = round2.register(
    (
        Model(
            "gemma4",
            "Gemma4TextConfig",
            "Gemma4ForCausalLM",
            {
                "head_dim": 16,
                "global_head_dim": 16,  # 512 by default: the cached probe's cache has one head size for all layers
                "vocab_size_per_layer_input": 1024,
                "hidden_size_per_layer_input": 16,
                **_WINDOWED,
            },
            note="per-layer inputs, proportional rope over a quarter of the global heads, pow(ms, -0.5) norms, "
            "sliding windows of 64",
        ),
        Model("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 16}),
        Model(
            "ernie4_5_moe",
            "Ernie4_5_MoeConfig",
            "Ernie4_5_MoeForCausalLM",
            {"head_dim": 16, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32, "moe_layer_start_index": 1},
            note="MoE after a dense first layer",
        ),
        Model(
            "hy_v3",
            "HYV3Config",
            "HYV3ForCausalLM",
            {"head_dim": 16, **_EXPERTS, **_DENSE_FIRST},
            note="Hunyuan v3, MoE after a dense first layer",
        ),
        Model("hyperclovax", "HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", {"head_dim": 16}),
        Model(
            "gpt_neox_japanese",
            "GPTNeoXJapaneseConfig",
            "GPTNeoXJapaneseForCausalLM",
            kv_heads=4,
            note="fused qkv, a dense bias added after the residual",
        ),
        Model(
            "granite_swa",
            "GraniteSWAConfig",
            "GraniteSWAForCausalLM",
            _WINDOWED,
            note="attention sinks as a context scale",
        ),
        Model(
            "cohere2_moe",
            "Cohere2MoeConfig",
            "Cohere2MoeForCausalLM",
            {"head_dim": 16, **_WINDOWED, **_EXPERTS},
            note="parallel attention + MoE, LayerNorm, sliding windows",
        ),
        Model(
            "mimo_v2_flash",
            "MiMoV2FlashConfig",
            "MiMoV2FlashForCausalLM",
            {
                "head_dim": 16,
                "v_head_dim": 16,
                # its sliding layers have twice the config's kv heads, its global ones the config's: both layers
                # slide here, so that the cached probe's one kv head count holds for each
                "num_key_value_heads": 1,
                "layer_types": ["sliding_attention", "sliding_attention"],
                "sliding_window": 64,
                **_ROUTED,
                **_DENSE_FIRST,
            },
            note="sliding windows with attention sinks and twice the kv heads, MoE after a dense first layer",
        ),
        Model(
            "solar_open",
            "SolarOpenConfig",
            "SolarOpenForCausalLM",
            {"head_dim": 16, **_ROUTED},
            note="MoE, a shared expert",
        ),
        Model("hrm_text", "HrmTextConfig", "HrmTextForCausalLM", {"head_dim": 16}),
        Model(
            "laguna",
            "LagunaConfig",
            "LagunaForCausalLM",
            {"head_dim": 16, "shared_expert_intermediate_size": 32, **_EXPERTS, **_DENSE_FIRST},
            note="MoE after a dense first layer, a shared expert",
        ),
        Model(
            "zaya",
            "ZayaConfig",
            "ZayaForCausalLM",
            {"head_dim": 16, **_EXPERTS, "num_experts_per_tok": 1},
            note="q/k norms, an MLP router, top-1",
        ),
    )
)


def main(argv: list[str] | None = None) -> int:
    return round2.main(argv, names=NAMES, script=SCRIPT, doc=__doc__, out=OUT)


if __name__ == "__main__":
    raise SystemExit(main())
