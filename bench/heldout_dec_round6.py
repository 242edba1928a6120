"""Held-out probe round 6 (issues 17/19): decoder families no round had sent: nanochat (ReLU² MLP, q/k norms without
weights, logits soft-capped), OLMo 1 (LayerNorm without parameters), Jais 2, Ministral 3 (YaRN rope), and the MoE
models MiniMax-M2, AFMoE (sliding windows, a dense first layer, shared experts) and EXAONE MoE.

Run ``python -m bench.heldout_dec_round6 [--only NAME ...] [--forms nocache past] [--exporters E ...]
[--presets fast int4] [--reuse] [--table]``: the options, the builds and the columns are round 2's
(``bench/heldout_dec_round2.py``: 2 layers, hidden 64, 4 heads of 16, 2 key/value heads where the family has
GQA, vocabulary 1024, weights perturbed), the models are this round's. Rows go to
``bench/out/heldout/dec_round6/<name>.rows.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import heldout_dec_round2 as round2  # noqa: E402
from bench.heldout_dec_round2 import _MOE, Model  # noqa: E402

OUT = REPO / "bench" / "out" / "heldout" / "dec_round6"
SCRIPT = "bench.heldout_dec_round6"
_SMALL_EXPERTS = {"moe_intermediate_size": 32, "experts_implementation": "batched_mm", **_MOE}

NAMES = round2.register(
    (
        Model("nanochat", "NanoChatConfig", "NanoChatForCausalLM", note="ReLU² MLP, unweighted q/k norms, soft cap"),
        Model("olmo", "OlmoConfig", "OlmoForCausalLM", note="LayerNorm without weight or bias"),
        Model("jais2", "Jais2Config", "Jais2ForCausalLM", {"head_dim": 16}),
        Model(
            "ministral3",
            "Ministral3Config",
            "Ministral3ForCausalLM",
            {"head_dim": 16},
            note="YaRN rope (its default scaling)",
        ),
        Model(
            "minimax_m2",
            "MiniMaxM2Config",
            "MiniMaxM2ForCausalLM",
            {"head_dim": 16, "num_local_experts": 4, "experts_implementation": "batched_mm", **_MOE},
            note="MoE top-2 of 4, q/k RMS norms over all heads",
        ),
        Model(
            "afmoe",
            "AfmoeConfig",
            "AfmoeForCausalLM",
            {
                "head_dim": 16,
                "num_experts": 4,
                "num_shared_experts": 1,
                "num_dense_layers": 1,
                "sliding_window": 64,
                **_SMALL_EXPERTS,
            },
            note="sliding windows of 64, a dense first layer, a shared expert",
        ),
        Model(
            "exaone_moe",
            "ExaoneMoeConfig",
            "ExaoneMoeForCausalLM",
            {
                "head_dim": 16,
                "num_experts": 4,
                "num_shared_experts": 1,
                "first_k_dense_replace": 1,
                "sliding_window": 64,
                **_SMALL_EXPERTS,
            },
            note="sliding windows of 64, MoE after a dense first layer",
        ),
    )
)


def main(argv: list[str] | None = None) -> int:
    return round2.main(argv, names=NAMES, script=SCRIPT, doc=__doc__, out=OUT)


if __name__ == "__main__":
    raise SystemExit(main())
