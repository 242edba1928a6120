"""fuse_transformer on torchvision's Swin: rank-4 residual norms are reported as unfused by design (issue 17).

``bench/heldout_detection.py`` sent torchvision's ``swin_t``: the report said "skip_layer_norm: expected 21,
achieved 0" and quoted onnxscript's closest match, a shape mismatch. Nothing failed to match: torchvision's Swin
keeps its tokens as batch x height x width x channels, and ORT's SkipLayerNormalization takes 2-D or 3-D input,
so no rule can fuse those norms. ``fusable_sites`` counts them apart (``residual_norms_rank4``), the expected count
leaves them out, and the report says why. The model: ``tests/models/build_heldout_torchvision.py``.
"""

from __future__ import annotations

import onnx_ir as ir

from passes._infra import PassContext
from passes.cleanup.shape_inference import ShapeInference
from passes.fusion import _fusion_families as fam
from passes.fusion.fuse_transformer import FuseTransformer
from tests.numerics import assert_equivalent
from tests.passes._util import MODELS

SWIN = MODELS / "heldout" / "tv_swin_ts.onnx"


def _annotated() -> ir.Model:
    model = ir.load(SWIN)
    ShapeInference()(model, PassContext())
    return model


def test_fusable_sites_count_rank4_residual_norms_apart() -> None:
    sites = fam.fusable_sites(_annotated())
    # each stage's one block: its first norm reads the patch embedding (or the patch merging), its second the
    # residual after attention; and the final norm, after the last block's MLP residual. None of rank 3.
    assert sites["residual_norms"] == 0 and sites["residual_norms_rank4"] == 3


def test_fuse_transformer_says_the_rank4_norms_are_unfused_by_design_and_stays_exact() -> None:
    model = _annotated()
    result = FuseTransformer()(model, PassContext())
    notes = result.notes
    assert notes["family"] == "vit"
    assert notes["expected"].get("skip_layer_norm") == 0
    why = notes["missing"]["skip_layer_norm"]
    assert why.startswith("3 residual norm(s) left unfused by design: on rank-4 tensors")
    assert "closest" not in why
    assert notes["achieved"]["gelu"] == 2
    # the GELUs fused, as on any ViT; batch sizes other than the export's
    shapes = [{"pixel_values": (b, 3, 32, 32)} for b in (1, 2, 5)]
    assert_equivalent(ir.load(SWIN), result.model, shapes, atol=1e-5, rtol=1e-4)
