"""A pre-norm text encoder with one embedding table and no embedding LayerNorm is a family fuse_transformer knows.

ESM-2 (issue 17, held-out probe: bench/heldout_text.py) scales its word embeddings by the padding mask and feeds
them straight to the first block's LayerNorm and residual Add, with rotary positions and no token types: no
rule of ``detect_family`` held, the family was "unknown" and nothing fused, attention included. It is now
detected as a pre-norm encoder (ViT's layer structure), and its attention and residual norms fuse.
``heldout_esm_ts_eager.onnx`` is ``python -m bench.heldout_text --only esm --exporters ts_eager`` (2 layers,
hidden 32, rotary). Compared with the original under ORT with graph optimizations off.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from passes._infra import op_histogram
from passes.fusion import _fusion_families as fam
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, parse, session

NAME = "heldout_esm_ts_eager"
LAYERS = 2


def _load(model: onnx.ModelProto | str) -> ir.Model:
    loaded = ir.load(model) if isinstance(model, str) else ir.serde.deserialize_model(model)
    common_passes.ShapeInferencePass()(loaded)
    return loaded


def test_esm_is_a_pre_norm_encoder_and_its_attention_and_norms_fuse():
    family, evidence = fam.detect_family(_load(str(MODELS / f"{NAME}.onnx")))
    assert family == "vit" and "pre-norm" in evidence
    result = FuseTransformer({"engines": ["onnxscript"]})(ir.load(MODELS / f"{NAME}.onnx"))
    ops = op_histogram(result.model)
    assert result.notes["candidates"]["onnxscript"]["verified"] is True
    assert result.counts["fused_attention"] == LAYERS and ops["com.microsoft::MultiHeadAttention"] == LAYERS
    assert result.counts["fused_skip_layer_norm"] == 2 * LAYERS and "Softmax" not in ops
    reference, candidate = session(str(MODELS / f"{NAME}.onnx")), session(result.model)
    rng = np.random.default_rng(0)
    for batch, seq, valid in ((1, 5, [5]), (3, 23, [23, 9, 1]), (2, 64, [64, 40])):
        ids = rng.integers(5, 384, size=(batch, seq), dtype=np.int64)
        mask = (np.arange(seq)[None, :] < np.array(valid)[:, None]).astype(np.int64)
        feeds = {"input_ids": np.where(mask == 1, ids, 1), "attention_mask": mask}
        want, got = reference.run(None, feeds)[0], candidate.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{batch}x{seq}")


# a 32-row vocabulary (2-16 rows would read as token types), the padding mask's product, then the first block
EMBEDDING = """
<ir_version: 9, opset_import: ["" : 18]>
g (int64[B, S] input_ids, float[B, S] m) => (float[B, S, 4] y)
  <float[32, 4] table = {%s}, float[4] g1 = {1, 1, 1, 1}, int64[1] axes = {2}> {
    e = Gather(table, input_ids)
    mm = Unsqueeze(m, axes)
    x = Mul(e, mm)
    n = LayerNormalization(x, g1)
    s = Softmax(n)
    y = %s
}
"""


def _family(readers: str) -> str:
    return fam.detect_family(_load(parse(EMBEDDING % (", ".join(["0.5"] * 128), readers))))[0]


def test_pre_norm_needs_the_residual_add_next_to_the_norm():
    assert _family("Add(x, s)") == "vit"
    assert _family("Mul(x, s)") == "unknown"  # a LayerNorm alone: no residual around a block
