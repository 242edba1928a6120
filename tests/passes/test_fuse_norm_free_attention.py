"""Attention without a LayerNorm or RMS norm around it still fuses: the "encoder" family (issue 17).

MobileBERT normalizes with NoNorm (an element-wise ``x * w + b``), so ``detect_family`` found no
LayerNormalization, answered "unknown", and fuse_transformer fused nothing, although its attention is the
usual scaled dot product (bench/heldout_text.py: 0/2 under every exporter). A Softmax of the product of two
activations that multiplies a third is now the "encoder" family, for which only attention is expected; a
Softmax over a weight product (a classifier head) is not attention and stays "unknown".
``heldout_mobilebert_ts_eager.onnx`` is ``python -m bench.heldout_text --only mobilebert --exporters
ts_eager`` (2 layers, hidden 32, bottlenecks of 16). Compared with the original under ORT, optimizations off.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from passes._infra import op_histogram
from passes.fusion import _fusion_families as fam
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, parse, session

NAME = "heldout_mobilebert_ts_eager"
LAYERS = 2


def _family(model: ir.Model) -> tuple[str, str]:
    common_passes.ShapeInferencePass()(model)
    return fam.detect_family(model)


def test_mobilebert_attention_fuses_without_a_layer_norm():
    assert _family(ir.load(MODELS / f"{NAME}.onnx"))[0] == "encoder"
    result = FuseTransformer({"engines": ["onnxscript"]})(ir.load(MODELS / f"{NAME}.onnx"))
    ops = op_histogram(result.model)
    assert result.notes["family"] == "encoder" and result.notes["expected"] == {"attention": LAYERS}
    assert result.counts["fused_attention"] == LAYERS and "Softmax" not in ops
    assert result.notes["missing"] == {}
    reference, fused = session(str(MODELS / f"{NAME}.onnx")), session(result.model)
    rng = np.random.default_rng(0)
    for batch, seq, valid in ((1, 4, [4]), (3, 21, [21, 12, 2]), (2, 48, [48, 30])):
        mask = (np.arange(seq)[None, :] < np.array(valid)[:, None]).astype(np.int64)
        feeds = {
            "input_ids": np.where(mask == 1, rng.integers(5, 384, size=(batch, seq)), 1).astype(np.int64),
            "attention_mask": mask,
            "token_type_ids": np.zeros((batch, seq), np.int64),
        }
        want, got = reference.run(None, feeds)[0], fused.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{batch}x{seq}")


HEADS = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, S, 4] x) => (float[B, S, 4] y) <float[4, 4] w = {%s}> {
    k = Relu(x)
    kt = Transpose <perm = [0, 2, 1]> (k)
    s = MatMul(%s)
    p = Softmax <axis = -1> (s)
    y = MatMul(%s)
}
"""


def _graph(scores: str, product: str) -> ir.Model:
    return ir.serde.deserialize_model(parse(HEADS % (", ".join(["0.25"] * 16), scores, product)))


def test_only_a_softmax_between_activation_products_is_attention():
    assert _family(_graph("x, kt", "p, k"))[0] == "encoder"
    assert _family(_graph("x, w", "p, w"))[0] == "unknown"  # a classifier's Softmax over a weight product
    assert _family(_graph("x, kt", "p, w"))[0] == "unknown"  # probabilities projected by a weight, not V
