"""A video encoder's attention fuses: its tubelet Conv3d reads the 5-D pixel values through a Transpose.

VideoMAE (and ViViT, TimeSformer) takes ``[batch, frames, 3, height, width]`` and moves the channels first
(``permute``) for a Conv3d of kernel (tubelet, patch, patch). ``_conv_stem`` knew inputs of rank 2 to 4 only,
so the family was "unknown" ("attention found, but no embedding structure of a known family") and nothing
fused under any exporter (bench/heldout_round2_encoders.py: VideoMAE 0/2 attention, 0/2 GELU). A rank-5 input
read by the stem Conv is now a tubelet embedding of ViT layers. ``videomae_dynamo.onnx`` is ``python -m
bench.heldout_round2_encoders --only videomae --exporters dynamo`` (2 layers, hidden 32, 4 frames of 32 px,
tubelets of 2 x 8 x 8). Compared with the original under ORT, optimizations off, at batches other than the
export's.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from passes._infra import op_histogram
from passes.fusion import _fusion_families as fam
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, session

MODEL = MODELS / "heldout" / "videomae_dynamo.onnx"
LAYERS = 2


def test_tubelet_stem_makes_the_vit_family_and_attention_fuses():
    model = ir.load(MODEL)
    common_passes.ShapeInferencePass()(model)
    family, evidence = fam.detect_family(model)
    assert family == "vit" and "tubelet" in evidence, evidence
    result = FuseTransformer({})(ir.load(MODEL))
    ops = op_histogram(result.model)
    assert result.counts["fused_attention"] == LAYERS and "Softmax" not in ops, ops
    assert result.counts["fused_gelu"] == LAYERS
    assert not (result.notes.get("missing") or {}).get("attention")
    reference, fused = session(MODEL), session(result.model)
    rng = np.random.default_rng(0)
    for batch in (1, 3):
        feeds = {"pixel_values": rng.standard_normal((batch, 4, 3, 32, 32)).astype(np.float32)}
        want, got = reference.run(None, feeds)[0], fused.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"batch {batch}")
