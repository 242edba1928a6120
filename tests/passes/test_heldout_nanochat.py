"""NanoChat's cached TorchScript export through the ``fast`` preset's passes (issues 17/19, held-out decoders,
round 6): its ``rotate_half`` is flipped, ``Concat(x2, -x1)``, so ``q * cos + rotate_half(q) * sin`` rotates by the
negative angle; no rotation fused (0/4: "Cos feeds no q*cos + rotate_half(q)*sin this pass matches"). It is the
usual rotation with sin negated: ``RotaryEmbedding`` with a negated sin cache, 4/4.

``tests/models/heldout/nanochat_past_ts.onnx``: ``python -m bench.heldout_dec_round6 --only nanochat --forms past
--exporters ts_eager --presets --tiny`` (2 layers, hidden 32, 4 heads, 2 kv heads, ReLU² MLP, unweighted q/k
norms, soft-capped logits, Optimum's signature).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from passes._infra import op_histogram
from tests.passes._decoder_replay import assert_decodes_like_export, fast_upto

PATH = Path(__file__).resolve().parent.parent / "models" / "heldout" / "nanochat_past_ts.onnx"
LAYERS = 2


def test_the_flipped_rotation_is_a_rotary_embedding_with_sin_negated() -> None:
    model, counts = fast_upto(PATH)
    assert counts.get("fuse_rotary.rotary_embeddings", 0) == 2 * LAYERS
    assert not any(n.op_type in ("Sin", "Cos") for n in model.graph)
    caches = {v.name: v.const_value.numpy() for v in model.graph.initializers.values() if "_cache" in (v.name or "")}
    sin = next(c for name, c in caches.items() if "sin" in name)
    assert (sin[1:] < 0).any() and sin[1, 0] == np.float32(-np.sin(1.0))  # position 1, the first frequency: -sin 1
    assert op_histogram(model)["com.microsoft::GroupQueryAttention"] == LAYERS
    assert_decodes_like_export(PATH, model)
