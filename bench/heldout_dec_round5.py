"""Held-out probe round 5 (issues 17/19): decoder families no round had sent: the MoE models HunYuan MoE and
ERNIE 4.5 MoE, DeepSeek-V2 (MLA with the dense query projection), StableLM 2 with q/k LayerNorms per head and a
parallel residual, and hybrids with recurrent or state-space layers beside attention (RecurrentGemma's Griffin,
Zamba2's shared attention block, Nemotron-H, LFM2-MoE), those without a cache.

Run ``python -m bench.heldout_dec_round5 [--only NAME ...] [--forms nocache past] [--exporters E ...]
[--presets fast int4] [--reuse] [--table]``: the options, the builds and the columns are round 2's
(``bench/heldout_dec_round2.py``: 2 layers, hidden 64, 4 heads of 16, 2 key/value heads where the family has
GQA, vocabulary 1024, weights perturbed), the models are this round's. Rows go to
``bench/out/heldout/dec_round5/<name>.rows.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import heldout_dec_round2 as round2  # noqa: E402
from bench.heldout_dec_round2 import _MOE, Model  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "dec_round5"
SCRIPT = "bench.heldout_dec_round5"

NAMES = round2.register(
    (
        Model(
            "hunyuan_moe",
            "HunYuanMoEV1Config",
            "HunYuanMoEV1ForCausalLM",
            {"head_dim": 16, "num_experts": 4, "moe_topk": 2, "experts_implementation": "batched_mm"},
            note="q/k RMSNorm after rotary, MoE top-2 with a shared MLP",
        ),
        Model(
            "ernie4_5_moe",
            "Ernie4_5_MoeConfig",
            "Ernie4_5_MoeForCausalLM",
            {
                "moe_num_experts": 4,
                "moe_k": 2,
                "moe_intermediate_size": 64,
                "moe_num_shared_experts": 1,
                "moe_layer_start_index": 1,
                "experts_implementation": "batched_mm",
            },
            note="interleaved rotary, MoE from layer 2 with a shared expert and expert bias",
        ),
        Model(
            "deepseek_v2",
            "DeepseekV2Config",
            "DeepseekV2ForCausalLM",
            {
                "num_key_value_heads": 4,
                "q_lora_rank": None,  # V2-Lite: the query projected densely
                "kv_lora_rank": 8,
                "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 16,
                "v_head_dim": 16,
                "n_routed_experts": 4,
                "n_shared_experts": 1,
                "moe_intermediate_size": 64,
                "first_k_dense_replace": 1,
                "experts_implementation": "batched_mm",
                **_MOE,
            },
            kv_heads=1,
            cache_head_dim=8,
            note="MLA without q LoRA (V2-Lite), rope on 8 of 24 as complex numbers, MoE on layer 2",
        ),
        Model(
            "stablelm2",
            "StableLmConfig",
            "StableLmForCausalLM",
            {"partial_rotary_factor": 0.25, "qk_layernorm": True, "use_parallel_residual": True},
            note="LayerNorm per head on q and k, parallel residual, partial rotary 0.25",
        ),
        # hybrids: their caches hold recurrent states the cached form's builder does not make (no-cache form)
        Model(
            "recurrent_gemma",
            "RecurrentGemmaConfig",
            "RecurrentGemmaForCausalLM",
            {
                "block_types": ["recurrent", "attention"],
                "lru_width": 64,
                "attention_window_size": 16,
                "num_key_value_heads": 1,
            },
            kv_heads=1,
            note="Griffin: an RG-LRU block on layer 1, windowed MQA with partial rope on layer 2",
        ),
        Model(
            "zamba2",
            "Zamba2Config",
            "Zamba2ForCausalLM",
            {
                "layers_block_type": ["mamba", "hybrid"],
                "mamba_d_state": 16,
                "n_mamba_heads": 4,
                "mamba_ngroups": 1,
                "chunk_size": 16,
                "num_mem_blocks": 1,
                "use_mem_rope": True,
            },
            note="Mamba-2 on both layers, a shared attention block (with its LoRA adapter) on layer 2",
        ),
        Model(
            "nemotron_h",
            "NemotronHConfig",
            "NemotronHForCausalLM",
            {
                "layers_block_type": ["mamba", "attention"],
                "head_dim": 16,
                "ssm_state_size": 16,
                "mamba_num_heads": 4,
                "mamba_head_dim": 16,
                "n_groups": 1,
                "chunk_size": 16,
            },
            rotary=False,
            note="Mamba-2 on layer 1, NoPE attention on layer 2",
        ),
    )
)


def main(argv: list[str] | None = None) -> int:
    return round2.main(argv, names=NAMES, script=SCRIPT, doc=__doc__, out=OUT)


if __name__ == "__main__":
    raise SystemExit(main())
