"""_where_mask: a ``masked_fill`` mask (``Where``) before the Softmax becomes the additive mask SDPA reads.

Graphs are written the way eager ``masked_fill`` exports them (DeBERTa-v2: ``Where(Not(mask), min, scores)``;
a causal decoder: ``Where(keep, scores, min)``); outputs are compared with the original under ORT, graph
optimizations off, including rows whose every position is masked.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes.fusion import _where_mask
from tests.passes._util import parse, session

MIN = float(np.finfo(np.float32).min)

MASKED_FILL = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, H, S, D] q, float[B, H, D, S] kt, bool[B, 1, S, S] masked) => (float[B, H, S, S] p) <float fill = {%s}> {
    s = MatMul(q, kt)
    w = Where(%s)
    p = Softmax <axis = -1> (w)
}
"""


def _model(fill: float, order: str) -> ir.Model:
    return ir.serde.deserialize_model(parse(MASKED_FILL % (repr(fill), order)))


def _feeds(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    masked = rng.random((batch, 1, seq, seq)) < 0.4
    masked[0, 0, 0, :] = True  # a fully masked row
    return {
        "q": rng.standard_normal((batch, 2, seq, 8), dtype=np.float32),
        "kt": rng.standard_normal((batch, 2, 8, seq), dtype=np.float32),
        "masked": masked,
    }


@pytest.mark.parametrize(
    ("order", "invert"), [("masked, fill, s", False), ("masked, s, fill", True)], ids=["fill-first", "fill-second"]
)
@pytest.mark.parametrize("fill", [MIN, -np.inf], ids=["finfo-min", "-inf"])
def test_where_mask_becomes_additive_and_exact_when_fill_is_large_negative(order, invert, fill):
    original = _model(fill, order)
    model = _model(fill, order)
    assert _where_mask.apply(model) == 1
    ops = [n.op_type for n in model.graph]
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    assert softmax.inputs[0].producer().op_type == "Add"
    assert ops.count("Where") == 1  # now on the mask, not on the scores
    reference, candidate = session(original), session(model)
    for batch, seq in ((1, 3), (2, 9)):
        feeds = _feeds(batch, seq, seed=seq)
        if invert:
            feeds["masked"] = ~feeds["masked"]  # the condition selects kept positions
        want, got = reference.run(None, feeds)[0], candidate.run(None, feeds)[0]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fill", [0.0, -10000.0], ids=["zero", "small-negative"])
def test_where_mask_is_left_when_fill_is_not_large_negative(fill):
    """``masked_fill(x, 0)`` or -1e4 is not a mask that an addition reproduces: left as it is."""
    model = _model(fill, "masked, fill, s")
    assert _where_mask.apply(model) == 0
    assert next(n for n in model.graph if n.op_type == "Softmax").inputs[0].producer().op_type == "Where"


SUBTRACTED = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, H, S, D] q, float[B, H, D, S] kt, float[B, 1, 1, S] keep) => (float[B, H, S, S] p) {
    scale = Constant <value = float {0.35}> ()
    big = Constant <value = float {10000.0}> ()
    one = Constant <value = float {1.0}> ()
    s = MatMul(q, kt)
    scaled = Mul(s, scale)
    dropped = Sub(one, keep)
    m = Mul(dropped, big)
    w = Sub(%s, m)
    p = Softmax <axis = -1> (w)
}
"""


def test_a_subtracted_mask_is_added_negated_and_bit_exact():
    # hand-written attention's ``scores - 10000 * (1 - mask)`` (XLNet's and Funnel's ``- INF * mask`` too): a
    # model a team wrote this way fused no attention under either exporter (0/2)
    original, model = (ir.serde.deserialize_model(parse(SUBTRACTED % "scaled")) for _ in range(2))
    assert _where_mask.apply(model) == 1
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    added = softmax.inputs[0].producer()
    assert added.op_type == "Add" and added.inputs[1].producer().op_type == "Neg"
    assert "Sub" in [n.op_type for n in model.graph]  # 1 - keep stays: only the subtraction from the scores goes
    reference, candidate = session(original), session(model)
    for batch, seq in ((1, 3), (2, 9)):
        feeds = _feeds(batch, seq, seed=seq)
        feeds = {"q": feeds["q"], "kt": feeds["kt"], "keep": (feeds["masked"][:, :, :1, :] == 0).astype(np.float32)}
        np.testing.assert_array_equal(candidate.run(None, feeds)[0], reference.run(None, feeds)[0])


def test_a_subtraction_from_something_other_than_scores_is_left():
    model = ir.serde.deserialize_model(parse(SUBTRACTED % "keep"))  # keep - m: no product of q and k
    assert _where_mask.apply(model) == 0
