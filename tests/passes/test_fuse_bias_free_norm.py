"""LayerNorms without a bias still fuse with their residual Add into SkipLayerNormalization (issue 17).

``nn.LayerNorm(bias=False)`` (ModernBERT) exports under dynamo as ``LayerNormalization(x, scale)``; onnxscript's
skip-norm rules bind a bias and stopped there ("pattern variable beta does not match None"), so on GPU targets
(where ``unfuse_skip_layernorm`` does not run) its residual norms stayed apart: held-out probe
(bench/heldout_text.py), ModernBERT dynamo 0/4. ``zero_norm_biases`` gives them the zero bias ONNX defines
for the missing input. ``heldout_modernbert_dynamo.onnx`` is ``python -m bench.heldout_text --only
modernbert --exporters dynamo``. Compared with the original under ORT with graph optimizations off.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes._infra import op_histogram
from passes.fusion.fuse_transformer import FuseTransformer, zero_norm_biases
from tests.passes._util import MODELS, parse, session

NAME = "heldout_modernbert_dynamo"
LAYERS = 2

NORMS = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, S, 4] x, float[B, S, 4] r) => (float[B, S, 4] y, float[B, S, 4] z)
  <float[4] g1 = {1.5, 0.5, 2.0, 1.0}, float[4] b1 = {0.1, 0.2, 0.3, 0.4}> {
    s = Add(x, r)
    y = LayerNormalization <axis = -1> (s, g1)
    z = LayerNormalization <axis = -1> (s, g1, b1)
}
"""


def test_a_missing_bias_becomes_an_explicit_zero_and_the_outputs_stay():
    original = ir.serde.deserialize_model(parse(NORMS))
    model = ir.serde.deserialize_model(parse(NORMS))
    assert zero_norm_biases(model) == 1  # the norm with a bias is left as it is
    norms = [n for n in model.graph if n.op_type == "LayerNormalization"]
    assert all(len(n.inputs) == 3 and n.inputs[2] is not None for n in norms)
    assert not np.any(norms[0].inputs[2].const_value.numpy())
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal((2, 5, 4)).astype(np.float32) for k in ("x", "r")}
    for want, got in zip(session(original).run(None, feeds), session(model).run(None, feeds), strict=True):
        np.testing.assert_array_equal(got, want)


def test_modernbert_dynamo_residual_norms_fuse():
    result = FuseTransformer({"engines": ["onnxscript"]})(ir.load(MODELS / f"{NAME}.onnx"))
    candidate = result.notes["candidates"]["onnxscript"]
    assert candidate["verified"] is True and candidate["norm_biases_zeroed"] == 2 * LAYERS + 1
    assert result.counts["fused_skip_layer_norm"] == 2 * LAYERS
    assert op_histogram(result.model)["com.microsoft::SkipLayerNormalization"] == 2 * LAYERS
    assert "skip_layer_norm" not in result.notes["missing"]
    reference, fused = session(str(MODELS / f"{NAME}.onnx")), session(result.model)
    rng = np.random.default_rng(1)
    for batch, seq in ((1, 5), (3, 23)):
        feeds = {
            "input_ids": rng.integers(5, 384, size=(batch, seq), dtype=np.int64),
            "attention_mask": np.ones((batch, seq), np.int64),
        }
        np.testing.assert_allclose(fused.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
