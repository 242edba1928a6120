"""T5Gemma's encoder fuses to GroupQueryAttention with ``causal=0`` (issue 17, held-out probe round 8: 0/2).

Its scores are soft-capped, ``50 * tanh(s / 50)``, before a bidirectional mask (padding; a window on its sliding
layers). MultiHeadAttention cannot cap; fuse_gqa took soft-caps for causal decoders only. ORT 1.32's
GroupQueryAttention with ``causal=0`` caps, then adds ``attention_bias``, the model's order: the mask becomes the
bias and every key is counted (``seqlens_k`` = S - 1), so padded rows compute what the export does.

``tests/models/heldout/t5gemma_encoder_ts.onnx``: ``python -m bench.heldout_round8 build t5gemma_encoder``
(2 layers, hidden 32, 2 heads of 16, 1 KV head, vocabulary 128; TorchScript).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import session

PATH = Path(__file__).resolve().parents[1] / "models" / "heldout" / "t5gemma_encoder_ts.onnx"


def _feeds(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    """Ids and a mask whose last row is padded to 60% of its length."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    if batch > 1:
        mask[-1, int(seq * 0.6) :] = 0
    return {"input_ids": rng.integers(3, 128, (batch, seq)).astype(np.int64), "attention_mask": mask}


@pytest.fixture(scope="module")
def fused() -> tuple[ir.Model, dict[str, int]]:
    return fast_upto(PATH)


def test_both_layers_become_bidirectional_group_query_attention_with_the_cap(fused) -> None:
    model, counts = fused
    assert counts.get("fuse_gqa.fused_gqa", 0) == 2 and counts.get("fuse_gqa.bidirectional", 0) == 2
    assert op_histogram(model)["com.microsoft::GroupQueryAttention"] == 2
    for node in model.graph:
        if node.op_type == "GroupQueryAttention":
            assert node.attributes.get_int("causal") == 0
            assert node.attributes.get_float("softcap") == pytest.approx(50.0)
            assert node.inputs[10] is not None  # the mask as attention_bias
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


def test_padded_rows_compute_what_the_export_does(fused) -> None:
    model, _ = fused
    reference, candidate = session(PATH), session(model, optimized=True)
    for batch, seq in ((1, 5), (2, 9), (3, 17)):
        feeds = _feeds(batch, seq, seed=seq)
        np.testing.assert_allclose(
            candidate.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-5, err_msg=f"{batch}x{seq}"
        )
