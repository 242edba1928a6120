"""Falcon's SDPA export with a KV cache through the ``fast`` preset's passes up to fuse_gqa (issue 17,
held-out decoders).

``tests/models/heldout/falcon_past_ts_sdpa.onnx``: ``python -m bench.heldout_dec_past --only falcon
--exporters ts_sdpa`` (tiny FalconForCausalLM from its config: 2 layers, hidden 32, 4 query heads, one KV
head, rotary, parallel attention; TorchScript with ``attn_implementation="sdpa"``, Optimum's signature).
TorchScript's decomposed SDPA scales q and k^T each by ``sqrt(1/sqrt(Shape(q)[-1:]))``: the head size read
off q's shape, static while batch and sequence are not. constant_folding left that Slice of the shape, the
scale stayed computed at run time, and fuse_gqa found a Mul where it looks for k^T: 0 of 2 layers fused.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from tests.passes._decoder_replay import assert_decodes_like_export, fast_upto

MODEL = Path(__file__).resolve().parent.parent / "models" / "heldout" / "falcon_past_ts_sdpa.onnx"
LAYERS = 2


@pytest.fixture(scope="module")
def fused() -> tuple[ir.Model, dict[str, int]]:
    return fast_upto(MODEL)


def test_sdpa_scale_folds_and_every_layer_becomes_group_query_attention(fused) -> None:
    model, counts = fused
    ops = op_histogram(model)
    assert counts.get("constant_folding.static_dims_folded", 0) >= 2  # the head size, once per layer
    assert counts.get("fuse_gqa.fused_gqa", 0) == LAYERS
    assert ops["com.microsoft::GroupQueryAttention"] == LAYERS
    assert "Softmax" not in ops and "Sqrt" not in ops  # no attention and no run-time scale left
    for node in (n for n in model.graph if n.op_type == "GroupQueryAttention"):
        assert node.attributes.get_int("kv_num_heads") == 1
        assert node.attributes.get_float("scale") == pytest.approx(8**-0.5, rel=1e-6)
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


def test_sdpa_fused_decoder_computes_what_the_export_does_on_a_growing_cache(fused) -> None:
    model, _ = fused
    assert_decodes_like_export(MODEL, model)
