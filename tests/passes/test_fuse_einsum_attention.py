"""_einsum_matmul: an attention written with ``torch.einsum`` (CvT) fuses once its Einsums are MatMuls.

CvT computes ``einsum("bhlk,bhtk->bhlt", q, k)`` and ``einsum("bhlt,bhtv->bhlv", probs, v)``; both exporters
keep ``Einsum`` nodes, which onnxscript's SDPA rule does not read, and the fast job fused 0/3 attention
(bench/heldout_round2_encoders.py). ``cvt_dynamo.onnx`` is ``python -m bench.heldout_round2_encoders --only cvt
--exporters dynamo`` (2 stages of 1 and 2 layers, 16 and 32 channels, 2 heads, 64 px, a class token in the
last stage). Compared with the original under ORT, optimizations off, at batches other than the export's.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from passes.fusion._einsum_matmul import einsum_to_matmul
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, parse, session

CVT = MODELS / "heldout" / "cvt_dynamo.onnx"
CVT_LAYERS = 3

EINSUM = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[%s] a, float[%s] b) => (float[%s] y) {
    e = Einsum <equation = "%s"> (a, b)
    y = Relu(e)
}
"""
# equation, then each operand's and the result's dims from (B=2, H=3, L=5, T=7, K=4)
PRODUCTS = {
    "bhlk,bhtk->bhlt": ("B,H,L,K", "B,H,T,K", "B,H,L,T"),
    "bhlt,bhtv->bhlv": ("B,H,L,T", "B,H,T,K", "B,H,L,K"),
    "bhkl,bhkt->bhlt": ("B,H,K,L", "B,H,K,T", "B,H,L,T"),
    "bkl,btk->blt": ("B,K,L", "B,T,K", "B,L,T"),
}
NOT_PRODUCTS = {
    "bhlk,bhtk->bhtl": ("B,H,L,K", "B,H,T,K", "B,H,T,L"),  # the result transposed
    "bhlk,bhtk->blt": ("B,H,L,K", "B,H,T,K", "B,L,T"),  # a batch letter summed
    "...lk,...tk->...lt": ("B,H,L,K", "B,H,T,K", "B,H,L,T"),  # an ellipsis
}
SIZES = {"B": 2, "H": 3, "L": 5, "T": 7, "K": 4}


def _model(equation: str, dims: tuple[str, str, str]) -> ir.Model:
    return ir.serde.deserialize_model(parse(EINSUM % (*dims, equation)))


@pytest.mark.parametrize("equation", list(PRODUCTS))
def test_batched_product_einsum_becomes_matmul_and_stays_exact(equation):
    dims = PRODUCTS[equation]
    model = _model(equation, dims)
    assert einsum_to_matmul(model) == 1
    ops = op_histogram(model)
    assert "Einsum" not in ops and ops["MatMul"] == 1, ops
    rng = np.random.default_rng(0)
    for scale in (1, 2):  # the declared sizes and others
        feeds = {
            name: rng.standard_normal([SIZES[d] * scale for d in shape.split(",")], dtype=np.float32)
            for name, shape in zip("ab", dims[:2], strict=True)
        }
        want = session(_model(equation, dims)).run(None, feeds)[0]
        np.testing.assert_allclose(session(model).run(None, feeds)[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equation", list(NOT_PRODUCTS))
def test_other_einsums_are_left(equation):
    model = _model(equation, NOT_PRODUCTS[equation])
    assert einsum_to_matmul(model) == 0
    assert op_histogram(model)["Einsum"] == 1


def test_cvt_einsum_attention_fuses_and_matches_the_export():
    result = FuseTransformer({})(ir.load(CVT))
    ops = op_histogram(result.model)
    assert result.counts["fused_attention"] == CVT_LAYERS and "Softmax" not in ops and "Einsum" not in ops, ops
    assert not (result.notes.get("missing") or {}).get("attention")
    reference, fused = session(CVT), session(result.model)
    rng = np.random.default_rng(0)
    for batch in (1, 3):
        feeds = {"pixel_values": rng.standard_normal((batch, 3, 64, 64)).astype(np.float32)}
        want, got = reference.run(None, feeds)[0], fused.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"batch {batch}")
