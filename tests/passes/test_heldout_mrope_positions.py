"""A multimodal-rope decoder's positions, ``position_ids [3, batch, sequence]``, fed right by fuse_gqa's probe,
and its rotation fused (issues 17/19: Qwen2.5-VL's, Qwen3-VL's and GLM-4V's language models).

The job's own input sets were right (``3x1x8``), but fuse_gqa's probe fed ``[batch, sequence]`` positions, which
ORT refused ("Invalid rank for input: position_ids Got: 2 Expected: 3"), and read the leading 3 as a batch the
export fixed: both layers declined, attention left to fuse_transformer's MultiHeadAttention. Now the probe reads a
rank-3 position input as one row per rope section: GroupQueryAttention on both layers, both exporters.

The rotation was left computed ("cos comes from neither Cos(angles) nor Gather(table, position_ids)": each
section's angles come from its own row of positions). Its factors are ``Concat(h, h)`` of a computed half, so
fuse_rotary reads them per token: ``RotaryEmbedding`` with caches ``h`` flattened to one row per token, at positions
``arange(batch * sequence)``; the sections' trigonometry stays, and the rotations go. GLM-4V rotates pairs
(interleaved) over half the head: its factors repeat each value on two adjacent channels, proven per token on the
checks' shapes with height and width drawn per token, and their even channels are the per-token caches.
``tests/models/heldout/qwen25vl_text_{ts,dynamo}.onnx``: ``python -m tests.models.build_heldout_mrope``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import PassContext, op_histogram
from passes.fusion._gqa_probe import Feeder
from passes.fusion.fuse_rotary import FuseRotary
from tests.models.build_heldout_mrope import mrope_feeds
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import session

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "heldout"
STEMS = ("qwen25vl_text_ts", "qwen25vl_text_dynamo", "qwen3vl_text_ts", "qwen3vl_text_dynamo")


@pytest.mark.parametrize("stem", STEMS)
def test_the_probe_feeds_one_row_of_positions_per_section_and_reads_no_fixed_batch(stem: str) -> None:
    feeder = Feeder(ir.load(HELDOUT / f"{stem}.onnx"))
    assert feeder.fixed == {}
    feeds = feeder.feeds(2, 3, 0)
    assert feeds["position_ids"].shape == (3, 2, 3)
    assert (feeds["position_ids"] == np.arange(3)).all()


@pytest.mark.parametrize("stem", STEMS)
def test_both_layers_become_group_query_attention_and_compute_the_same(stem: str) -> None:
    path = HELDOUT / f"{stem}.onnx"
    model, counts = fast_upto(path)
    assert counts.get("fuse_gqa.fused_gqa", 0) == 2
    assert counts.get("fuse_rotary.rotary_embeddings", 0) == 4
    ops = op_histogram(model)
    assert ops["com.microsoft::GroupQueryAttention"] == 2
    assert ops["com.microsoft::RotaryEmbedding"] == 4 and "Neg" not in ops
    reference, fused = session(path), session(model, optimized=True)
    for (batch, seq), grid in itertools.product(((1, 4), (2, 9), (3, 17)), (False, True)):
        feeds = mrope_feeds(batch, seq, seed=seq, grid=grid)
        np.testing.assert_allclose(
            fused.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-5, err_msg=f"{batch}x{seq}"
        )


@pytest.mark.parametrize("stem", ["qwen25vl_text_ts", "qwen3vl_text_ts"])
def test_fuse_rotary_alone_reads_the_per_token_factors_of_the_raw_torchscript_export(stem: str) -> None:
    # setup: the export as written (no shape inference or folding first: rotate_half cuts x.shape[-1] // 2, a
    # computed end, so the width comes from the head split)
    path = HELDOUT / f"{stem}.onnx"
    # execute
    result = FuseRotary()(ir.load(path), PassContext())
    # assert: q and k of both layers, one pair of per-token caches, nothing declined or left unexplained
    assert result.counts["rotary_embeddings"] == 4 and result.counts["cos_sin_caches"] == 1
    assert result.non_matches == []
    assert result.notes["decoder"]["rotary"]["form"] == "per_token"
    assert "rotary_emb.position_start" not in result.model.graph.initializers
    reference, fused = session(path), session(result.model)
    for batch, seq in ((1, 3), (2, 9), (4, 21)):
        feeds = mrope_feeds(batch, seq, seed=batch, grid=True)  # height and width drawn per token
        np.testing.assert_allclose(
            fused.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-5, err_msg=f"{batch}x{seq}"
        )


def test_glm4v_interleaved_multimodal_rope_fuses_per_token_over_half_the_head() -> None:
    # setup: GLM-4V rotates pairs (interleaved) over half the head, its angles from three rows of positions
    path = HELDOUT / "glm4v_text_dynamo.onnx"
    # execute
    model, counts = fast_upto(path)
    rotary = FuseRotary()(ir.load(path), PassContext())
    # assert: q and k of both layers, interleaved and partial, on one pair of per-token caches (each factor's
    # even channels), proven with height and width drawn per token
    assert rotary.non_matches == []
    assert rotary.counts["rotary_embeddings"] == rotary.counts["interleaved_rotary"] == 4
    assert rotary.counts["partial_rotary"] == 4 and rotary.counts["cos_sin_caches"] == 1
    assert counts.get("fuse_rotary.rotary_embeddings", 0) == 4 and counts.get("fuse_gqa.fused_gqa", 0) == 2
    for candidate in (rotary.model, model):
        reference, fused = session(path), session(candidate, optimized=candidate is model)
        for batch, seq in ((1, 4), (3, 17)):
            feeds = mrope_feeds(batch, seq, seed=seq, grid=True)
            np.testing.assert_allclose(
                fused.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-5, err_msg=f"{batch}x{seq}"
            )
