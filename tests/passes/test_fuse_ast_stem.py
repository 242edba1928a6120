"""An Audio Spectrogram Transformer's attention fuses: its patch Conv reads the spectrogram through a Transpose.

AST takes log-mel features ``[batch, frames, mel bins]`` and gives them a channel axis and the (bins, frames)
layout its patch Conv expects with ``Unsqueeze`` then ``Transpose``. ``_conv_stem`` walked only the
Unsqueeze/Reshape/Cast/Identity that give raw audio its channel axis, so the stem was not found, the family
was "unknown" and nothing fused (bench/heldout_vision_audio.py: 0/2 attention under every exporter). A layout
Transpose is now walked too. ``heldout_ast_dynamo.onnx`` is ``python -m bench.heldout_vision_audio --only ast
--exporters dynamo`` (2 layers, hidden 32, 48 frames x 32 bins). Compared with the original under ORT,
optimizations off.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from passes._infra import op_histogram
from passes.fusion import _fusion_families as fam
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, session

NAME = "heldout_ast_dynamo"
LAYERS = 2


def test_ast_patch_stem_through_a_transpose_makes_a_known_family_and_its_attention_fuses():
    model = ir.load(MODELS / f"{NAME}.onnx")
    common_passes.ShapeInferencePass()(model)
    family, evidence = fam.detect_family(model)
    assert family != "unknown", evidence
    result = FuseTransformer({})(ir.load(MODELS / f"{NAME}.onnx"))
    ops = op_histogram(result.model)
    assert result.counts["fused_attention"] == LAYERS and "Softmax" not in ops
    assert "attention" not in (result.notes.get("missing") or {})
    reference, fused = session(str(MODELS / f"{NAME}.onnx")), session(result.model)
    rng = np.random.default_rng(0)
    for batch in (1, 3):
        feeds = {"input_values": rng.standard_normal((batch, 48, 32)).astype(np.float32)}
        want, got = reference.run(None, feeds)[0], fused.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"batch {batch}")
