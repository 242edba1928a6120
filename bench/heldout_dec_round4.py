"""Held-out probe round 4 (issues 17/19): decoder families no round had sent, as a new user sends them: Cohere 2
(parallel attention and MLP, windowed layers without rope), Ministral and CWM (windowed then global), Llama 4's
text model (chunked attention, NoPE layers, L2 q/k norms, MoE), DiffLlama (differential attention: two softmaxes
subtracted), JetMoE (mixture-of-attention experts), Gemma 3n (AltUp, per-layer embeddings, shared KV), the MoE
families GraniteMoE, PhiMoE, GLM-4 MoE and FlexOlmo; and hybrids with state-space or linear-attention layers
(GraniteMoeHybrid, MiniMax), those without a cache.

Run ``python -m bench.heldout_dec_round4 [--only NAME ...] [--forms nocache past] [--exporters E ...]
[--presets fast int4] [--reuse] [--table]``: the options, the builds and the columns are round 2's
(``bench/heldout_dec_round2.py``: 2 layers, hidden 64, 4 heads of 16, 2 key/value heads where the family has
GQA, vocabulary 1024, weights perturbed), the models are this round's. Rows go to
``bench/out/heldout/dec_round4/<name>.rows.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import heldout_dec_round2 as round2  # noqa: E402
from bench.heldout_dec_round2 import _GROUPED_MOE, _MOE, Model  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "dec_round4"
SCRIPT = "bench.heldout_dec_round4"
_WINDOWED = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}
_EXPERTS = {"num_local_experts": 4, "experts_implementation": "batched_mm", **_MOE}

NAMES = round2.register(
    (
        Model(
            "cohere2",
            "Cohere2Config",
            "Cohere2ForCausalLM",
            _WINDOWED,
            note="parallel attention and MLP over one LayerNorm, interleaved rotary on windowed layers only, "
            "scaled logits",
        ),
        Model("ministral", "MinistralConfig", "MinistralForCausalLM", {"head_dim": 16, **_WINDOWED}),
        Model("cwm", "CwmConfig", "CwmForCausalLM", {"head_dim": 16, **_WINDOWED}, note="Llama-3 with windows"),
        Model(
            "llama4",
            "Llama4TextConfig",
            "Llama4ForCausalLM",
            {
                "head_dim": 16,
                "intermediate_size_mlp": 128,
                "attention_chunk_size": 32,
                "no_rope_layers": [1, 0],
                "moe_layers": [1],
                **_EXPERTS,
            },
            note="chunked attention with complex-number rope and L2 q/k norm on layer 1, NoPE global layer 2 "
            "with attention temperature, MoE with a shared expert on layer 2",
        ),
        Model(
            "diffllama",
            "DiffLlamaConfig",
            "DiffLlamaForCausalLM",
            {"head_dim": 16},
            note="differential attention: two softmax maps subtracted with a learned lambda, group norm of heads",
        ),
        Model(
            "jetmoe",
            "JetMoeConfig",
            "JetMoeForCausalLM",
            {"kv_channels": 16, "num_local_experts": 4, **_MOE},
            kv_heads=4,
            note="mixture of attention experts (q and o routed per token), MoE MLP",
        ),
        Model(
            "gemma3n",
            "Gemma3nTextConfig",
            "Gemma3nForCausalLM",
            {
                "head_dim": 16,
                "hidden_size_per_layer_input": 16,
                "vocab_size_per_layer_input": 1024,
                "laurel_rank": 8,
                "num_kv_shared_layers": 0,
                "activation_sparsity_pattern": [0.95, 0.0],
                **_WINDOWED,
            },
            cache_head_dim=16,  # head_dim is given: the --tiny build keeps it
            note="AltUp (4 predicted streams), Laurel low-rank residual, per-layer embeddings, top-k sparse GELU "
            "on layer 1, v RMSNorm without scale",
        ),
        Model("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", _EXPERTS, note="muP multipliers, MoE"),
        Model("phimoe", "PhimoeConfig", "PhimoeForCausalLM", _EXPERTS, note="sparsemixer routing, LayerNorm"),
        Model(
            "glm4_moe",
            "Glm4MoeConfig",
            "Glm4MoeForCausalLM",
            {"use_qk_norm": True, "experts_implementation": "batched_mm", **_GROUPED_MOE},
            note="partial rotary, q/k norms, grouped top-k routing after one dense layer",
        ),
        Model(
            "flex_olmo",
            "FlexOlmoConfig",
            "FlexOlmoForCausalLM",
            {"num_experts": 4, "experts_implementation": "batched_mm", **_MOE},
            note="OLMo 2 post-norms and q/k norms over all heads, MoE",
        ),
        # hybrids: their caches hold recurrent states the cached form's builder does not make (no-cache form)
        Model(
            "granitemoehybrid",
            "GraniteMoeHybridConfig",
            "GraniteMoeHybridForCausalLM",
            {
                "layer_types": ["mamba", "attention"],
                "position_embedding_type": "nope",
                "mamba_n_heads": 4,
                "mamba_d_head": 16,
                "mamba_d_state": 16,
                "mamba_n_groups": 1,
                "mamba_chunk_size": 16,
                "mamba_expand": 1,
                "shared_intermediate_size": 128,
                **_EXPERTS,
            },
            rotary=False,
            note="Mamba-2 on layer 1, NoPE attention on layer 2, MoE with a shared MLP (Granite 4)",
        ),
        Model(
            "minimax",
            "MiniMaxConfig",
            "MiniMaxForCausalLM",
            {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "block_size": 16, **_EXPERTS},
            note="lightning (linear) attention on layer 1, softmax attention on layer 2, MoE",
        ),
    )
)


def main(argv: list[str] | None = None) -> int:
    return round2.main(argv, names=NAMES, script=SCRIPT, doc=__doc__, out=OUT)


if __name__ == "__main__":
    raise SystemExit(main())
