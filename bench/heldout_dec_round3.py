"""Held-out probe round 3 (issues 17/19): the decoder families released after the first two rounds were written,
sent as a new user sends them: attention sinks (GPT-OSS), short-convolution hybrids (LFM2), xIELU and q/k norms
(Apertus), the Llama descendants with their own twists (ERNIE 4.5, Seed-OSS, Hunyuan, Arcee, OLMo 3,
VaultGemma, BitNet), and hybrids beside state-space or linear-attention layers (Falcon-H1, Bamba, Qwen3-Next;
Doge's dynamic mask; dots.llm1's MoE), those without a cache.

Run ``python -m bench.heldout_dec_round3 [--only NAME ...] [--forms nocache past] [--exporters E ...]
[--presets fast int4] [--reuse] [--table]``: the options, the builds and the columns are round 2's
(``bench/heldout_dec_round2.py``: 2 layers, hidden 64, 4 heads of 16, 2 key/value heads where the family has
GQA, vocabulary 1024, weights perturbed), the models are this round's. Rows go to
``bench/out/heldout/dec_round3/<name>.rows.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import heldout_dec_round2 as round2  # noqa: E402
from bench.heldout_dec_round2 import _MOE, Model  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "dec_round3"
SCRIPT = "bench.heldout_dec_round3"
_WINDOWED = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}

NAMES = round2.register(
    (
        Model(
            "gpt_oss",
            "GptOssConfig",
            "GptOssForCausalLM",
            {
                "head_dim": 16,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "experts_implementation": "batched_mm",  # the default kernel exports with neither exporter
                **_WINDOWED,
            },
            cache_head_dim=16,  # head_dim is given: the --tiny build (hidden 32) keeps it
            note="attention sinks (a learned logit per head joins the softmax), window 64 then global, MoE top-2 "
            "with clamped SwiGLU (batched_mm experts), YaRN rotary",
        ),
        Model(
            "lfm2",
            "Lfm2Config",
            "Lfm2ForCausalLM",
            {"layer_types": ["conv", "full_attention"], "block_ff_dim": 128, "conv_L_cache": 3},
            note="gated short convolution on layer 1, attention with q/k RMSNorm on layer 2; its cache holds "
            "convolution states, which the cached form's builder does not make",
        ),
        Model(
            "apertus", "ApertusConfig", "ApertusForCausalLM", note="xIELU MLP (no gate), q/k RMSNorm, Llama-3 rotary"
        ),
        Model("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 16}, note="interleaved rotary"),
        Model(
            "seed_oss",
            "SeedOssConfig",
            "SeedOssForCausalLM",
            {"head_dim": 16, "attention_bias": True},
            note="q/k/v bias, no o bias",
        ),
        Model(
            "hunyuan",
            "HunYuanDenseV1Config",
            "HunYuanDenseV1ForCausalLM",
            {"head_dim": 16},
            note="q/k RMSNorm after rotary",
        ),
        Model("arcee", "ArceeConfig", "ArceeForCausalLM", {"head_dim": 16}, note="ReLU^2 MLP without a gate"),
        Model("olmo3", "Olmo3Config", "Olmo3ForCausalLM", _WINDOWED, note="post-norms, q/k RMSNorm over all heads"),
        Model(
            "vaultgemma",
            "VaultGemmaConfig",
            "VaultGemmaForCausalLM",
            {"head_dim": 16, "query_pre_attn_scalar": 16, **_WINDOWED},
            note="Gemma: (1 + w) RMSNorm, scaled embeddings, soft-capped logits, window 64 then global",
        ),
        Model("bitnet", "BitNetConfig", "BitNetForCausalLM", note="sub-norms inside attention and MLP, ReLU^2 gate"),
        # hybrids: attention beside state-space or linear-attention layers, MoE; the no-cache form (their caches
        # hold recurrent states the cached form's builder does not make)
        Model(
            "falcon_h1",
            "FalconH1Config",
            "FalconH1ForCausalLM",
            {
                "head_dim": 16,
                "mamba_d_ssm": 64,
                "mamba_n_heads": 4,
                "mamba_d_head": 16,
                "mamba_d_state": 16,
                "mamba_n_groups": 1,
                "mamba_chunk_size": 16,
            },
            note="Mamba-2 and attention in parallel in every layer, muP multipliers",
        ),
        Model(
            "bamba",
            "BambaConfig",
            "BambaForCausalLM",
            {
                "attn_layer_indices": [1],
                "mamba_n_heads": 4,
                "mamba_d_head": 16,
                "mamba_d_state": 16,
                "mamba_n_groups": 1,
                "mamba_chunk_size": 16,
                "mamba_expand": 1,
            },
            note="Mamba-2 on layer 1, attention on layer 2",
        ),
        Model(
            "qwen3_next",
            "Qwen3NextConfig",
            "Qwen3NextForCausalLM",
            {
                "head_dim": 16,
                "layer_types": ["linear_attention", "full_attention"],
                "linear_num_value_heads": 4,
                "linear_num_key_heads": 2,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 64,
                "shared_expert_intermediate_size": 64,
                "experts_implementation": "batched_mm",
            },
            note="gated DeltaNet on layer 1, gated attention (output gate, partial rope) on layer 2, MoE",
        ),
        Model("doge", "DogeConfig", "DogeForCausalLM", {"head_dim": 16}, note="dynamic mask attention"),
        Model(
            "dots1",
            "Dots1Config",
            "Dots1ForCausalLM",
            {
                "head_dim": 16,
                "n_routed_experts": 4,
                "n_shared_experts": 1,
                "moe_intermediate_size": 64,
                "first_k_dense_replace": 1,
                "experts_implementation": "batched_mm",
                **_MOE,
            },
            note="q/k norms, MoE after one dense layer",
        ),
    )
)


def main(argv: list[str] | None = None) -> int:
    return round2.main(argv, names=NAMES, script=SCRIPT, doc=__doc__, out=OUT)


if __name__ == "__main__":
    raise SystemExit(main())
