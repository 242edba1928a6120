"""A key its projection lays out ``[B, h, d, S]`` (SqueezeBERT's 1-D convolutions over ``[B, C, S]``) fuses.

onnxscript's SDPA rule reads the key as ``Transpose(k, [0, 1, 3, 2])``; SqueezeBERT views its key straight to
``[B, h, d, S]``, so neither of its exports fused (0/2, bench/README.md "Stop 40", round 13).
``_key_transpose.expose`` hands the rule the key as the transpose of its transpose. The graph here is that layout
by hand (the key projected, transposed to ``[B, C, S]`` and viewed as ``[B, h, d, S]``), compared with itself under
ORT at several shapes after ``fuse_transformer``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import parse, session


def _weights(seed: int) -> str:
    return ", ".join(str(round(0.05 * ((i * seed) % 17 - 8), 3)) for i in range(256))


GRAPH = f"""
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, S, 16] x) => (float[B, S, 16] y) {{
  wq = Constant <value = float[16, 16] {{{_weights(7)}}}> ()
  wk = Constant <value = float[16, 16] {{{_weights(5)}}}> ()
  wv = Constant <value = float[16, 16] {{{_weights(3)}}}> ()
  heads = Constant <value = int64[4] {{0, 0, 2, 8}}> ()
  channels = Constant <value = int64[4] {{0, 2, 8, -1}}> ()
  merged = Constant <value = int64[3] {{0, 0, 16}}> ()
  root = Constant <value = float {{2.828427}}> ()
  q = MatMul (x, wq)
  k = MatMul (x, wk)
  v = MatMul (x, wv)
  q3 = Reshape (q, heads)
  q4 = Transpose <perm = [0, 2, 1, 3]> (q3)
  kc = Transpose <perm = [0, 2, 1]> (k)
  kt = Reshape (kc, channels)
  v3 = Reshape (v, heads)
  v4 = Transpose <perm = [0, 2, 1, 3]> (v3)
  raw = MatMul (q4, kt)
  scores = Div (raw, root)
  probs = Softmax <axis = -1> (scores)
  context = MatMul (probs, v4)
  back = Transpose <perm = [0, 2, 1, 3]> (context)
  y = Reshape (back, merged)
}}
"""


def test_a_key_viewed_as_its_own_transpose_fuses_exactly():
    model = ir.serde.deserialize_model(parse(GRAPH))
    result = FuseTransformer({"family": "bert", "engines": ["onnxscript"]})(model, PassContext())
    ops = op_histogram(result.model)
    assert result.counts["fused_attention"] == 1 and "Softmax" not in ops
    assert result.notes["candidates"]["onnxscript"]["onnxscript_counts"]["key_transposes_exposed"] == 1
    reference, fused = session(ir.serde.deserialize_model(parse(GRAPH))), session(result.model)
    rng = np.random.default_rng(7)
    for batch, seq in ((1, 3), (3, 17)):
        feeds = {"x": rng.standard_normal((batch, seq, 16)).astype(np.float32)}
        np.testing.assert_allclose(fused.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-5, atol=1e-6)
