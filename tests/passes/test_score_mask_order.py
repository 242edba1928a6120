"""_score_mask_order's two rewrites on one attention-score graph each: what they match, what they refuse, and
that the probabilities stay what the original computes (masked rows, padded keys, overflow to -inf)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes.fusion import _score_mask_order
from tests.passes._util import checked, parse, session

MIN = float(np.finfo(np.float32).min)


def _mask_then_scale(op: str, scale: str) -> str:
    return f"""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[B,H,S,D] q, float[B,H,T,D] kt_in, float[B,1,S,T] mask) => (float[B,H,S,T] probs) {{
        kt = Transpose <perm = [0, 1, 3, 2]> (kt_in)
        s = MatMul (q, kt)
        masked = Add (s, mask)
        c = Constant <value = float {{{scale}}}> ()
        scaled = {op} (masked, c)
        probs = Softmax <axis = -1> (scaled)
    }}"""


def _where_then_add(fill: str, fill_first: bool) -> str:
    where = "Where (drop, f, s)" if fill_first else "Where (keep, s, f)"
    return f"""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[B,H,S,D] q, float[B,H,T,D] kt_in, bool[1,1,S,T] keep, float[B,1,S,T] mask) => (float[B,H,S,T] probs) {{
        kt = Transpose <perm = [0, 1, 3, 2]> (kt_in)
        s = MatMul (q, kt)
        drop = Not (keep)
        f = Constant <value = float {{{fill}}}> ()
        w = {where}
        scored = Add (w, mask)
        probs = Softmax <axis = -1> (scored)
    }}"""


def _feeds(padding_fill: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    b, h, s, t, d = 2, 3, 4, 6, 8
    keep = np.tril(np.ones((s, t), bool), k=t - s)[None, None]
    mask = np.zeros((b, 1, s, t), np.float32)
    mask[1, ..., -1] = padding_fill  # the second row's last key is padding
    return {
        "q": rng.standard_normal((b, h, s, d)).astype(np.float32) * 4,
        "kt_in": rng.standard_normal((b, h, t, d)).astype(np.float32),
        "keep": keep,
        "mask": np.where(keep, mask, np.float32(MIN)).astype(np.float32),  # causal plus key padding
    }


def _run(text: str, feeds: dict[str, np.ndarray]) -> tuple[int, np.ndarray, np.ndarray]:
    proto = parse(text)
    model = ir.serde.deserialize_model(proto)
    count = _score_mask_order.rules.apply_to_model(model)
    wanted = {i.name for i in proto.graph.input}
    feeds = {k: v for k, v in feeds.items() if k in wanted}
    want = session(ir.serde.deserialize_model(proto)).run(None, feeds)[0]
    got = session(ir.serde.deserialize_model(checked(model))).run(None, feeds)[0]
    return count, want, got


@pytest.mark.parametrize("op,scale", [("Div", "2.8284271"), ("Mul", "0.35355339")])
def test_a_mask_added_before_the_scale_moves_after_it(op: str, scale: str) -> None:
    count, want, got = _run(_mask_then_scale(op, scale), _feeds(MIN))
    assert count == 1
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert np.all(got[1, ..., -1] == 0)  # the padded key stays masked to an exact 0


def test_a_computed_scale_is_not_moved() -> None:
    text = _mask_then_scale("Div", "2.0").replace("c = Constant <value = float {2.0}> ()", "c = ReduceMax (q)")
    model = ir.serde.deserialize_model(parse(text))
    assert _score_mask_order.rules.apply_to_model(model) == 0


@pytest.mark.parametrize("fill_first", [False, True])
@pytest.mark.parametrize("padding", [0.0, MIN])  # MIN + MIN overflows to -inf in both forms
def test_a_where_mask_then_an_additive_one_become_one_additive_mask(fill_first: bool, padding: float) -> None:
    feeds = _feeds(0.0)
    feeds["mask"] = np.zeros_like(feeds["mask"])
    feeds["mask"][1, ..., -1] = padding
    count, want, got = _run(_where_then_add(f"{MIN!r}", fill_first), feeds)
    assert count == 1
    np.testing.assert_array_equal(got, want)  # exact: the fill absorbs the scores


def test_a_small_fill_is_not_a_mask() -> None:
    model = ir.serde.deserialize_model(parse(_where_then_add("-10000.0", False)))
    assert _score_mask_order.rules.apply_to_model(model) == 0
