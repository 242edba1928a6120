"""Held-out probe round 10 (issues 17/19): decoder families no earlier round built: DBRX (clipped fused QKV, MoE),
Qwen4 Exp's text model (linear attention, hyper-connections, n-gram embeddings), dots3 note's text model (MLA with
an indexer, sliding windows), Inkling 2's text model (relative positions, soft caps), DeepSeek-V4 (compressed
attention, hyper-connections), HY V4 (MLA with sinks, hyper-connections), Mamba 2 and Falcon Mamba (state-space
scans, no attention), xLSTM (matrix memory), CPM-Ant (relative position buckets) and Bailing hybrid (MLA beside
Kimi delta attention).

Run ``python -m bench.heldout_dec_round10 [--only NAME ...] [--forms nocache past] [--exporters E ...]
[--presets fast int4] [--reuse] [--table]``: the options, the builds and the columns are round 2's
(``bench/heldout_dec_round2.py``: 2 layers, hidden 64, 4 heads of 16, 2 key/value heads where the family has
GQA, vocabulary 1024, weights perturbed), the models are this round's. Rows go to
``bench/out/heldout/dec_round10/<name>.rows.json``.
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

OUT = REPO / "bench" / "out" / "heldout" / "dec_round10"
SCRIPT = "bench.heldout_dec_round10"
_INDEXER = {"index_n_heads": 2, "index_head_dim": 16, "index_topk": 8}
_HYPER = {"hc_mult": 2, "hc_sinkhorn_iters": 2}
_SSM = {"state_size": 8, "conv_kernel": 4, "expand": 2, "time_step_rank": 8}

NAMES = round2.register(
    (
        Model(
            "dbrx",
            "DbrxConfig",
            "DbrxForCausalLM",
            {
                "d_model": 64,  # DbrxConfig sizes its experts from d_model, which the standard names do not set
                "n_heads": 4,
                "n_layers": 2,
                "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
                "experts_implementation": "batched_mm",
                "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
            },
            note="fused QKV clipped, MoE",
        ),
        Model(
            "qwen4_exp",
            "Qwen4ExpTextConfig",
            "Qwen4ExpForCausalLM",
            {
                "head_dim": 16,
                "layer_types": ["linear_attention", "full_attention"],
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
                "num_experts": 4,
                "hc_count": 2,
                "hc_lowrank": 16,
                "ple_embed_dim": 64,
                "ngram_vocab_size_base": 4096,
                "split_ngram_parts": 8,
                "heads_per_ngram": 2,
                "indexer_n_heads": 2,
                "indexer_kv_heads": 1,
                "indexer_head_dim": 16,
                "indexer_budget": 16,
                "indexer_compress_ratio": 4,
                "experts_implementation": "batched_mm",
                **_MOE,
            },
            note="gated delta rule beside full attention, hyper-connections, n-gram embeddings, MoE",
        ),
        _mla(
            "dots3_note",
            "Dots3NoteTextConfig",
            "Dots3NoteForCausalLM",
            {**_BATCHED, **_INDEXER, "head_dim": 24, "sliding_window": 64, "shared_experts_intermediate_size": 32},
            "MLA with an indexer, MoE",
        ),
        Model(
            "inkling2",
            "Inkling2TextConfig",
            "Inkling2ForCausalLM",
            {
                "head_dim": 16,
                "swa_num_attention_heads": 4,
                "swa_num_key_value_heads": 2,
                "swa_head_dim": 16,
                "sliding_window_size": 64,
                "rel_extent": 64,
                "unpadded_vocab_size": 1000,
                "moe_intermediate_size": 32,
                "n_routed_experts": 4,
                "n_layers_per_attn_res_block": 1,
                "experts_implementation": "batched_mm",
                **_MOE,
            },
            rotary=False,
            note="relative positions, sliding windows, soft-capped MLP and logits, MoE",
        ),
        Model(
            "deepseek_v4",
            "DeepseekV4Config",
            "DeepseekV4ForCausalLM",
            {
                "head_dim": 16,
                "qk_rope_head_dim": 8,
                "q_lora_rank": 32,
                "o_lora_rank": 32,
                "o_groups": 2,
                "moe_intermediate_size": 32,
                "n_routed_experts": 4,
                "n_shared_experts": 1,
                "sliding_window": 64,
                "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                "num_nextn_predict_layers": 0,
                **_INDEXER,
                **_HYPER,
                "experts_implementation": "batched_mm",
                **_MOE,
            },
            kv_heads=1,
            note="compressed and sliding attention, hyper-connections, MoE",
        ),
        Model(
            "hy_v4",
            "HYV4Config",
            "HYV4ForCausalLM",
            {**_MLA, **_BATCHED, **_INDEXER, "head_dim": 16, "hc_mult": 2},
            kv_heads=4,
            cache_head_dim=8,
            note="MLA with an indexer and sinks, hyper-connections, MoE",
        ),
        Model(
            "mamba2",
            "Mamba2Config",
            "Mamba2ForCausalLM",
            {**_SSM, "num_heads": 8, "head_dim": 16, "n_groups": 1, "chunk_size": 16},
            rotary=False,
            positions=False,
            note="state-space scan, no attention",
        ),
        Model(
            "falcon_mamba",
            "FalconMambaConfig",
            "FalconMambaForCausalLM",
            {**_SSM, "intermediate_size": 128},
            rotary=False,
            positions=False,
            note="selective scan, no attention",
        ),
        Model(
            "xlstm",
            "xLSTMConfig",
            "xLSTMForCausalLM",
            {
                "embedding_dim": 64,
                "num_blocks": 2,
                "num_heads": 4,
                "chunk_size": 16,
                "mode": "train",
                "autocast_kernel_dtype": "float32",
                "return_last_states": False,
            },
            rotary=False,
            positions=False,
            note="matrix memory (mLSTM), no attention",
        ),
        Model(
            "cpmant",
            "CpmAntConfig",
            "CpmAntForCausalLM",
            {
                "dim_head": 16,
                "dim_ff": 128,
                "position_bias_num_buckets": 32,
                "position_bias_max_distance": 128,
                "prompt_length": 4,
            },
            kv_heads=4,
            rotary=False,
            positions=False,
            note="relative position buckets",
        ),
        Model(
            "bailing_hybrid",
            "BailingHybridConfig",
            "BailingHybridForCausalLM",
            {
                **_MLA,
                "num_experts": 4,
                "num_experts_per_token": 2,
                "num_shared_experts": 1,
                "moe_intermediate_size": 32,
                "first_k_dense_replace": 1,
                "num_expert_group": 1,
                "topk_group": 1,
                "head_dim": 16,
                "linear_head_dim": 16,
                "linear_num_heads": 4,
                "layer_group_size": 2,
                "num_nextn_predict_layers": 0,
                "experts_implementation": "batched_mm",
            },
            kv_heads=4,
            cache_head_dim=8,
            note="MLA beside Kimi delta attention, MoE",
        ),
    )
)


def main(argv: list[str] | None = None) -> int:
    return round2.main(argv, names=NAMES, script=SCRIPT, doc=__doc__, out=OUT)


if __name__ == "__main__":
    raise SystemExit(main())
