"""Held-out probe round 8 (issues 17/19): the decoders with multi-head latent attention transformers added after
round 2's DeepSeek-V3 (MiniCPM3, GLM-4.7 Flash's ``glm4_moe_lite``, Youtu, A.X K1, DeepSeek-V3.2 with its sparse
indexer) and hybrids whose other layers are linear attention or convolutions (Qwen3.5, OLMo hybrid, LFM2 MoE).

Run ``python -m bench.heldout_dec_round8 [--only NAME ...] [--forms nocache past] [--exporters E ...]
[--presets fast int4] [--reuse] [--table]``: the options, the builds and the columns are round 2's
(``bench/heldout_dec_round2.py``: 2 layers, hidden 64, 4 heads of 16, 2 key/value heads where the family has
GQA, vocabulary 1024, weights perturbed), the models are this round's; the hybrids and DeepSeek-V3.2 go without
a cache (``--forms nocache``: their caches hold recurrent states or indexer keys the cached form's builder does
not make). Rows go to ``bench/out/heldout/dec_round8/<name>.rows.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import heldout_dec_round2 as round2  # noqa: E402
from bench.heldout_dec_round2 import _GROUPED_MOE, _MOE, Model  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "dec_round8"
SCRIPT = "bench.heldout_dec_round8"
# round 2's DeepSeek-V3 latent: q and kv LoRA, 8 of each head's 24 query/key dims rotated
_MLA = {"num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 8, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16, "v_head_dim": 16}  # fmt: skip
# the experts as one batched product: the default grouped_mm has no ONNX function, and TorchScript has no histc
_BATCHED = {**_GROUPED_MOE, "experts_implementation": "batched_mm"}
_LINEAR = {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"]}


def _mla(name: str, config: str, model: str, extra: dict, note: str) -> Model:
    return Model(name, config, model, {**_MLA, **extra}, kv_heads=1, cache_head_dim=8, note=note)


NAMES = round2.register(
    (
        _mla("minicpm3", "MiniCPM3Config", "MiniCPM3ForCausalLM", {}, "MLA"),
        _mla("glm4_moe_lite", "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", _BATCHED, "MLA, grouped MoE"),
        _mla("youtu", "YoutuConfig", "YoutuForCausalLM", {}, "MLA"),
        _mla("axk1", "AXK1Config", "AXK1ForCausalLM", _BATCHED, "MLA, grouped MoE"),
        _mla(
            "deepseek_v32",
            "DeepseekV32Config",
            "DeepseekV32ForCausalLM",
            {**_BATCHED, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8},
            "MLA with a sparse indexer keeping 8 keys per query",
        ),
        Model(
            "qwen3_5",
            "Qwen3_5TextConfig",
            "Qwen3_5ForCausalLM",
            {
                **_LINEAR,
                "linear_num_value_heads": 4,
                "linear_num_key_heads": 2,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
            },
            note="gated DeltaNet on layer 1, gated attention on layer 2",
        ),
        Model(
            "olmo_hybrid", "OlmoHybridConfig", "OlmoHybridForCausalLM", _LINEAR, note="linear attention, then attention"
        ),
        Model(
            "lfm2_moe",
            "Lfm2MoeConfig",
            "Lfm2MoeForCausalLM",
            {
                "layer_types": ["conv", "full_attention"],
                "num_experts": 4,
                "moe_intermediate_size": 32,
                "num_dense_layers": 1,
                "experts_implementation": "batched_mm",
                **_MOE,
            },
            note="a short convolution on layer 1, attention on layer 2, MoE",
        ),
    )
)


def main(argv: list[str] | None = None) -> int:
    return round2.main(argv, names=NAMES, script=SCRIPT, doc=__doc__, out=OUT)


if __name__ == "__main__":
    raise SystemExit(main())
