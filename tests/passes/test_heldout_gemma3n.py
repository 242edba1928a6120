"""Gemma 3n's cached TorchScript export through the ``fast`` preset's passes (issues 17/19, held-out decoders,
round 4; dynamo cannot export it: no ONNX function for ``prims.erf_inv``).

Two forms no earlier export had, so none of its rotations and none of its RMS norms fused:

* rope on ``[batch, sequence, heads, head_size]`` before the head transpose (``unsqueeze_dim=2``): now
  ``RotaryEmbedding`` on the flat ``[B, S, N*D]`` with the heads read from the q/k head split, through the
  per-head norm (``_rotary_match``, ``bsnd``);
* RMS norms written ``x * (mean(x^2) + eps) ** -0.5``, the value norm without a weight: now
  ``SimplifiedLayerNormalization`` (``_rms_norm_opset17``), which ORT's session did not build either.

``tests/models/heldout/gemma3n_past_ts.onnx``: ``python -m bench.heldout_dec_round4 --only gemma3n --forms past
--exporters ts_eager --presets --tiny`` (2 layers, hidden 32, 4 heads of 16, 2 kv heads, a window of 64 keys on
layer 1 then global attention, AltUp, Laurel, per-layer embeddings, Optimum's signature).
"""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from tests.passes._decoder_replay import assert_decodes_like_export, fast_upto

PATH = Path(__file__).resolve().parent.parent / "models" / "heldout" / "gemma3n_past_ts.onnx"
LAYERS, HEADS, KV_HEADS = 2, 4, 2


@pytest.fixture(scope="module")
def through_gqa() -> tuple[ir.Model, dict[str, int]]:
    return fast_upto(PATH)


def test_every_heads_last_rotation_becomes_a_rotary_embedding_with_its_heads(through_gqa) -> None:
    model, counts = through_gqa
    assert counts.get("fuse_rotary.rotary_embeddings", 0) == 2 * LAYERS
    rotations = [n for n in model.graph if n.op_type == "RotaryEmbedding"]
    assert sorted(n.attributes.get_int("num_heads", 0) for n in rotations) == [KV_HEADS] * LAYERS + [HEADS] * LAYERS
    assert not any(n.op_type in ("Sin", "Cos") for n in model.graph)
    assert op_histogram(model)["com.microsoft::GroupQueryAttention"] == LAYERS
    assert_decodes_like_export(PATH, model)


def test_the_inverse_root_norms_fuse_and_the_decoder_still_decodes_like_the_export() -> None:
    model, _ = fast_upto(PATH, "fuse_transformer")
    inverse_roots = [
        n
        for n in model.graph
        if n.op_type == "Pow" and n.inputs[1].const_value is not None and n.inputs[1].const_value.numpy() == -0.5
    ]
    assert not inverse_roots
    assert_decodes_like_export(PATH, model)
