"""_where_mask: a mask broadcast to the scores' shape before ``masked_fill`` (``mask.expand_as(scores)``).

XLM (and FlauBERT, built on it) writes ``scores.masked_fill_((mask == 0).view(...).expand_as(scores), min)``:
TorchScript exports ``Where(Expand(cond, Shape(scores)), min, scores)``. The Shape reads the scores a second
time, so onnxscript's SDPA rule refused the attention (its scores used outside the pattern) and XLM's
TorchScript export fused 0/2 attention (bench/heldout_round2_encoders.py; dynamo drops the Expand itself and
fused 2/2). The Expand is now dropped with the rewrite to an additive mask (``Where`` broadcasts as ``Expand``
does). ``tests/models/heldout/xlm_ts_eager.onnx`` is ``python -m bench.heldout_round2_encoders --only xlm
--exporters ts_eager`` (2 layers, hidden 32, 4 heads). Compared with the original under ORT, optimizations off.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from passes.cleanup.common_subexpression_elimination import CommonSubexpressionElimination
from passes.cleanup.constant_folding import ConstantFolding
from passes.cleanup.shape_inference import ShapeInference
from passes.fusion import _where_mask
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, parse, session

XLM = MODELS / "heldout" / "xlm_ts_eager.onnx"
LAYERS, VOCAB = 2, 384
MIN = float(np.finfo(np.float32).min)

EXPANDED = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, H, S, D] q, float[B, H, D, S] kt, bool[B, 1, 1, S] masked) => (float[B, H, S, S] p) <float fill = {%r}> {
    s = MatMul(q, kt)
    shape = Shape(s)
    wide = Expand(masked, shape)
    w = Where(%s)
    p = Softmax <axis = -1> (w)
}
"""


def _feeds(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    masked = rng.random((batch, 1, 1, seq)) < 0.4
    masked[0, 0, 0, :] = True  # a row whose every key is masked
    return {
        "q": rng.standard_normal((batch, 3, seq, 8), dtype=np.float32),
        "kt": rng.standard_normal((batch, 3, 8, seq), dtype=np.float32),
        "masked": masked,
    }


@pytest.mark.parametrize("order", ["wide, fill, s", "wide, s, fill"], ids=["fill-first", "fill-second"])
def test_expanded_mask_loses_its_expand_and_stays_exact(order):
    text = EXPANDED % (MIN, order)
    model = ir.serde.deserialize_model(parse(text))
    assert _where_mask.apply(model) == 1
    ops = op_histogram(model)
    assert "Expand" not in ops and "Shape" not in ops, ops  # the second read of the scores is gone
    reference, rewritten = session(ir.serde.deserialize_model(parse(text))), session(model)
    for batch, seq in ((1, 5), (3, 17)):
        feeds = _feeds(batch, seq, seed=seq)
        if order.endswith("fill"):  # Where(keep, s, fill): the same positions kept
            feeds["masked"] = ~feeds["masked"]
        np.testing.assert_allclose(rewritten.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-6, atol=1e-7)


def test_expand_to_another_shape_is_not_dropped():
    """Expand to a shape that is not the scores' own may widen the result: the rule must not fire."""
    text = (EXPANDED % (MIN, "wide, fill, s")).replace("shape = Shape(s)", "shape = Shape(q)")
    model = ir.serde.deserialize_model(parse(text))
    _where_mask.apply(model)
    assert "Expand" in op_histogram(model)  # the plain rule may take it as the condition, never drop it


def _xlm_feeds(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[-1, seq // 2 :] = 0  # the last row half padding
    return {"input_ids": rng.integers(5, VOCAB, size=(batch, seq), dtype=np.int64), "attention_mask": mask}


def test_xlm_torchscript_attention_fuses_and_matches_the_export():
    model = ir.load(XLM)
    for step in (ShapeInference({}), ConstantFolding({}), CommonSubexpressionElimination({})):  # the job's order
        model = step(model).model
    result = FuseTransformer({})(model)
    ops = op_histogram(result.model)
    assert result.counts["fused_attention"] == LAYERS and "Softmax" not in ops, ops
    assert "attention" not in (result.notes.get("missing") or {})
    reference, fused = session(XLM), session(result.model)
    for batch, seq in ((1, 5), (3, 23), (2, 40)):
        feeds = _xlm_feeds(batch, seq, seed=seq)
        want, got = reference.run(None, feeds)[0], fused.run(None, feeds)[0]
        valid = feeds["attention_mask"].astype(bool)
        np.testing.assert_allclose(got[valid], want[valid], rtol=1e-4, atol=1e-4, err_msg=f"{batch}x{seq}")
