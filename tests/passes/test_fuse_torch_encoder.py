"""A model written with torch's own ``nn.TransformerEncoder`` (no transformers), dynamo export: fuse_transformer
fuses both attentions. Two things had stopped it: the family (no transformers embedding layout: "family
unknown", nothing tried) and the shared projection weights (both cloned layers read one stored tensor, and the
Gemm rewrite registered its transpose once per reader: "Initializer ... is already registered", every
candidate rejected). ``tests/models/build_heldout_own_models.py`` builds the models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx_ir.passes.common import ShapeInferencePass

from passes._infra import op_histogram
from passes.fusion import fuse_transformer as ft
from passes.fusion.fuse_transformer import FuseTransformer, gemm_to_matmul
from tests.models.build_heldout_own_models import feeds
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import session

HELDOUT = Path(__file__).resolve().parent.parent / "models" / "heldout"


@pytest.mark.parametrize(("name", "family"), [("post", "distilbert"), ("pre", "vit")])
def test_torch_transformer_encoder_fuses_every_attention(name: str, family: str) -> None:
    path = HELDOUT / f"torch_encoder_{name}_dynamo.onnx"
    ft._LAST.clear()
    model, counts = fast_upto(path, through="fuse_transformer")
    assert counts["fuse_transformer.fused_attention"] == 2 and counts["fuse_transformer.gemm_to_matmul"] == 2
    assert "Softmax" not in op_histogram(model)
    reference, fused = session(path), session(model, optimized=True)
    for batch, seq in ((1, 4), (3, 23), (2, 64)):
        x = feeds(batch, seq, seed=seq)
        np.testing.assert_allclose(fused.run(None, x)[0], reference.run(None, x)[0], rtol=1e-4, atol=1e-5)
    ft._LAST.clear()
    assert FuseTransformer()(ir.load(path)).notes["family"] == family


def test_gemm_rewrite_transposes_a_weight_two_gemms_share_once() -> None:
    model = ir.load(HELDOUT / "torch_encoder_post_dynamo.onnx")
    (shared,) = {n.inputs[1].name for n in model.graph if n.op_type == "Gemm" and "out_proj" in n.inputs[1].name}
    ShapeInferencePass()(model)
    assert gemm_to_matmul(model) == 2
    readers = [n for n in model.graph if n.op_type == "MatMul" and n.inputs[1].name == f"{shared}_t"]
    assert len(readers) == 2 and readers[0].inputs[1] is readers[1].inputs[1]


@pytest.mark.parametrize("exporter", ["ts", "dynamo"])
def test_hand_written_attention_with_a_subtracted_mask_fuses(exporter: str) -> None:
    # ``scores - 10000 * (1 - mask)``: fused 0/2 under both exporters before _where_mask.SubtractedMask
    path = HELDOUT / f"own_subtracted_mask_{exporter}.onnx"
    ft._LAST.clear()
    model, counts = fast_upto(path, through="fuse_transformer")
    assert counts["fuse_transformer.fused_attention"] == 2
    assert "Softmax" not in op_histogram(model)
    reference, fused = session(path), session(model, optimized=True)
    for batch, seq in ((1, 4), (3, 23), (2, 64)):
        x = feeds(batch, seq, seed=seq)  # rows after the first half padding
        np.testing.assert_allclose(fused.run(None, x)[0], reference.run(None, x)[0], rtol=1e-4, atol=1e-5)
