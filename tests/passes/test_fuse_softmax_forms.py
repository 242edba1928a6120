"""Attention whose Softmax is written in forms onnxscript's SDPA rule does not read fuses (issue 17, held-out probe
round 4: SEW-D and LayoutLMv3 fused 0/2 under both exporters).

* SEW-D's ``XSoftmax`` fills the masked scores with ``finfo.min`` and the masked probabilities with 0, and
  TorchScript writes its Softmax axis as 3 (``_where_mask.ZeroedMaskedRows``, ``_softmax_forms.softmax_last_axis``);
  dynamo folds its heads into the batch and unfolds the product to ``[-1, h, S, d]``, a batch symbolic
  inference leaves unsimplified (``_batched_heads.unfold_batched_heads``).
* LayoutLMv3's CogView PB-Relax: ``Softmax((s / 32 - max(s / 32)) * 32)`` (``_softmax_forms``).
* BROS (round 5) scales the sum of ``q @ k^T`` and a box term, then adds the mask (``_softmax_forms``'s scale
  over a biased product).
* SpeechT5's encoder under TorchScript (round 6) folds its heads into the batch and adds a relative-position
  term computed from the query to the folded scores before its Softmax: the unfold now takes the biased product
  (``_batched_heads.softmax_before_fold``; 0/2 before).

The exports are ``tests.models.build_heldout_score_forms.py``'s; compared with the original under ORT, graph
optimizations off, at shapes other than the export's, rows of padding (SEW-D: padded frames' queries, whose
rows the model zeroes) included. Hand-written graphs pin each rewrite and its refusals.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import PassContext, op_histogram
from passes.fusion import _softmax_forms, _where_mask
from passes.fusion.fuse_transformer import FuseTransformer
from tests.models.build_heldout_score_forms import bros_feeds, layoutlmv3_feeds, sewd_feeds, speecht5_feeds
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import parse, session

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "heldout"
MIN = float(np.finfo(np.float32).min)

EXPORTS = {
    "sewd_mask_ts": lambda b, n, seed: sewd_feeds(b, 40 * n, seed),
    "sewd_dynamo": lambda b, n, seed: {"input_values": sewd_feeds(b, 40 * n, seed)["input_values"]},
    "layoutlmv3_text_ts": layoutlmv3_feeds,
    "layoutlmv3_text_dynamo": layoutlmv3_feeds,
    "bros_ts": bros_feeds,
    "bros_dynamo": bros_feeds,
    "speecht5_encoder_ts": lambda b, n, seed: speecht5_feeds(b, 40 * n, seed),
}


@pytest.mark.parametrize("stem", sorted(EXPORTS))
def test_the_export_fuses_its_attention_and_computes_the_same(stem: str) -> None:
    path = HELDOUT / f"{stem}.onnx"
    model, _ = fast_upto(path)
    # the engine's input sets: the fallback's shortest synthesized audio (20 samples, 2 frames) is shorter than
    # the dynamo export's relative-position bmm runs on (its traced guards), in the upload as in the candidate
    samples = [EXPORTS[stem](batch, size, size) for batch, size in ((1, 5), (2, 9))]
    result = FuseTransformer({"engines": ["onnxscript"], "pack_qkv": True})(model, PassContext(samples=samples))
    ops = op_histogram(result.model)
    fused = ops["com.microsoft::MultiHeadAttention"] + ops["com.microsoft::Attention"]  # Attention: projections packed
    assert result.counts["fused_attention"] == 1 and fused == 1
    assert "Softmax" not in ops and "attention" not in result.notes.get("missing", {})
    reference, fused = session(ir.load(path)), session(result.model)
    for batch, size in ((1, 6), (2, 11), (3, 17)):
        feeds = EXPORTS[stem](batch, size, size)
        for want, got in zip(reference.run(None, feeds), fused.run(None, feeds), strict=True):
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{stem} {batch}x{size}")


ZEROED = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, H, S, D] q, float[B, H, D, S] kt, bool[B, 1, S, S] cond) => (float[B, H, S, S] out)
  <float fill = {%s}, float zero = {0.0}> {
    s = MatMul(q, kt)
    w = Where(%s)
    p = Softmax <axis = -1> (w)
    out = Where(%s)
}
"""


def _zeroed(fill: float, before: str, after: str) -> ir.Model:
    return ir.serde.deserialize_model(parse(ZEROED % (repr(fill), before, after)))


def _zeroed_feeds(batch: int, seq: int, seed: int, keep: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    masked = rng.random((batch, 1, seq, seq)) < 0.4
    masked[0, 0, 0, :] = True  # a fully masked row: 0 in the model
    masked[-1, 0, -1, :] = False  # a row with no masked key
    return {
        "q": rng.standard_normal((batch, 2, seq, 8), dtype=np.float32),
        "kt": rng.standard_normal((batch, 2, 8, seq), dtype=np.float32),
        "cond": ~masked if keep else masked,
    }


@pytest.mark.parametrize(
    ("before", "after", "keep"),
    [("cond, fill, s", "cond, zero, p", False), ("cond, s, fill", "cond, p, zero", True)],
    ids=["fill-first", "fill-second"],
)
@pytest.mark.parametrize("fill", [MIN, -np.inf], ids=["finfo-min", "-inf"])
def test_probabilities_zeroed_by_the_scores_mask_become_an_inf_mask_and_a_nan_guard(before, after, keep, fill):
    original, model = _zeroed(fill, before, after), _zeroed(fill, before, after)
    assert _where_mask.apply(model) == 2  # the zeroed rows, then the -inf fill made additive
    ops = [n.op_type for n in model.graph]
    assert ops.count("IsNaN") == 1 and ops.count("Where") == 2  # the guard's, and the mask's on the bias
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    bias = softmax.inputs[0].producer().inputs[1].producer()
    assert bias.op_type == "Where" and any(
        v.const_value is not None and np.isneginf(v.const_value.numpy()).all() for v in bias.inputs[1:]
    )
    reference, candidate = session(original), session(model)
    for batch, seq in ((1, 3), (2, 9)):
        feeds = _zeroed_feeds(batch, seq, seed=seq, keep=keep)
        want, got = reference.run(None, feeds)[0], candidate.run(None, feeds)[0]
        assert not want[0, :, 0].any()  # the fully masked row is 0 in both
        np.testing.assert_array_equal(got, want)


def test_probabilities_zeroed_by_another_condition_are_left_alone() -> None:
    model = ir.serde.deserialize_model(
        parse("""
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[1, 2, 4, 8] q, float[1, 2, 8, 4] kt, bool[1, 1, 4, 4] a, bool[1, 1, 4, 4] b)
          => (float[1, 2, 4, 4] out) <float fill = {-3.4028234663852886e+38}, float zero = {0.0}> {
            s = MatMul(q, kt)
            w = Where(a, fill, s)
            p = Softmax <axis = -1> (w)
            out = Where(b, zero, p)
        }
        """)
    )
    assert _where_mask.apply(model) == 1  # only the scores' mask, made additive
    assert "IsNaN" not in [n.op_type for n in model.graph]


RELAXED = """
<ir_version: 9, opset_import: ["" : %d]>
g (float[B, H, S, T] s) => (float[B, H, S, T] p) <float inner = {%s}, float outer = {%s}%s> {
    scaled = %s(s, inner)
    %s
    shifted = Sub(scaled, row_max)
    relaxed = Mul(shifted, outer)
    p = Softmax <axis = %d> (relaxed)
}
"""


def _relaxed(inner: float, outer: float, *, reciprocal: bool, unsqueezed: bool, axis: int = -1,
             max_axis: int = -1, opset: int = 18) -> ir.Model:  # fmt: skip
    consts = f", int64[1] max_axes = {{{max_axis}}}"  # Unsqueeze takes its axes as an input from opset 13
    unsqueeze = "row_max = Unsqueeze(m, max_axes)"
    if opset >= 18:
        reduce = "ReduceMax <keepdims = %d> (scaled, max_axes)"
    else:  # ReduceMax's axes an attribute until opset 18
        reduce = "ReduceMax <keepdims = %d, axes = [" + str(max_axis) + "]> (scaled)"
    body = f"m = {reduce % 0}\n    {unsqueeze}" if unsqueezed else f"row_max = {reduce % 1}"
    text = RELAXED % (opset, repr(inner), repr(outer), consts, "Mul" if reciprocal else "Div", body, axis)
    return ir.serde.deserialize_model(parse(text))


def _scores(seed: int, shape=(2, 2, 5, 7)) -> dict[str, np.ndarray]:
    s = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 8
    s[0, 0, 0, 3:] = MIN  # an additively masked row
    return {"s": s}


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("unsqueezed", [False, True], ids=["keepdims", "unsqueezed"])
@pytest.mark.parametrize(("inner", "outer", "reciprocal"), [(32.0, 32.0, False), (1 / 3, 3.0, True), (3.0, 3.0, False)])
def test_pb_relax_softmax_becomes_the_softmax_of_the_scores(opset, unsqueezed, inner, outer, reciprocal):
    original = _relaxed(inner, outer, reciprocal=reciprocal, unsqueezed=unsqueezed, opset=opset)
    model = _relaxed(inner, outer, reciprocal=reciprocal, unsqueezed=unsqueezed, opset=opset)
    assert _softmax_forms.apply(model) == 1
    (softmax,) = list(model.graph)[-1:]
    assert softmax.op_type == "Softmax" and softmax.inputs[0] is model.graph.inputs[0]
    assert not {"ReduceMax", "Sub", "Mul", "Div"} & {n.op_type for n in model.graph}
    reference, candidate = session(original), session(model)
    for seed, shape in ((0, (2, 2, 5, 7)), (1, (1, 3, 9, 4))):
        feeds = _scores(seed, shape)
        np.testing.assert_allclose(candidate.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("inner", "outer", "max_axis", "why"),
    [(32.0, 16.0, -1, "scales that do not undo each other"), (32.0, 32.0, 2, "a maximum over another axis")],
)
def test_pb_relax_is_refused_where_the_softmax_would_change(inner, outer, max_axis, why):
    model = _relaxed(inner, outer, reciprocal=False, unsqueezed=False, max_axis=max_axis)
    assert _softmax_forms.relaxed_rules.apply_to_model(model) == 0, why


def test_a_softmax_over_the_last_axis_by_number_is_given_minus_one() -> None:
    model = ir.serde.deserialize_model(
        parse("""
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[B, 2, S, S] s, float[B, S, 4] t) => (float[B, 2, S, S] p, float[B, S, 4] r) {
            p = Softmax <axis = 3> (s)
            r = Softmax <axis = 1> (t)
        }
        """)
    )
    assert _softmax_forms.softmax_last_axis(model) == 1
    assert [n.attributes.get_int("axis") for n in model.graph] == [-1, 1]  # the axis-1 Softmax is not the last


SCALED_SUM = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, H, S, D] q, float[B, H, D, S] kt, float[B, H, S, S] rel, float[B, 1, 1, S] mask)
  => (float[B, H, S, S] p) <float c = {%s}> {
    s = MatMul(q, kt)
    total = Add(%s)
    scaled = %s(total, c)
    %s
}
"""


def _scaled_sum(op: str, order: str, masked: bool, scale: float = 8.0) -> ir.Model:
    tail = "biased = Add(scaled, mask)\n    p = Softmax <axis = -1> (biased)" if masked else "p = Softmax(scaled)"
    return ir.serde.deserialize_model(parse(SCALED_SUM % (repr(scale), order, op, tail)))


@pytest.mark.parametrize("masked", [True, False], ids=["then-mask", "softmax"])
@pytest.mark.parametrize("order", ["s, rel", "rel, s"])
@pytest.mark.parametrize(("op", "scale"), [("Div", 8.0), ("Mul", 0.125)])
def test_a_scale_over_the_product_and_its_bias_is_distributed(op, scale, order, masked):
    original, model = _scaled_sum(op, order, masked, scale), _scaled_sum(op, order, masked, scale)
    assert _softmax_forms.scale_rules.apply_to_model(model) == 1
    matmul = next(n for n in model.graph if n.op_type == "MatMul")
    (scaled,) = [use for use, _ in matmul.outputs[0].uses()]
    assert scaled.op_type == op and [u.op_type for u, _ in scaled.outputs[0].uses()] == ["Add"]
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((2, 2, 5, 4), dtype=np.float32),
             "kt": rng.standard_normal((2, 2, 4, 5), dtype=np.float32),
             "rel": rng.standard_normal((2, 2, 5, 5), dtype=np.float32),
             "mask": np.where(rng.random((2, 1, 1, 5)) < 0.3, MIN, 0).astype(np.float32)}  # fmt: skip
    np.testing.assert_allclose(session(model).run(None, feeds)[0], session(original).run(None, feeds)[0], atol=1e-6)


def test_a_scaled_sum_that_is_not_attention_scores_is_left_alone() -> None:
    model = ir.serde.deserialize_model(
        parse("""
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[2, 4] x, float[4, 3] w, float[2, 3] b) => (float[2, 3] y) <float c = {8.0}> {
            s = MatMul(x, w)
            total = Add(s, b)
            y = Div(total, c)
        }
        """)
    )
    assert _softmax_forms.scale_rules.apply_to_model(model) == 0
