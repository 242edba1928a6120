"""_erf_gelu: ``(x * 0.5) * (1 + erf(x / sqrt 2))`` (ESM's gelu) becomes ``com.microsoft::Gelu`` (issue 17).

The held-out probe (bench/heldout_text.py) found ESM-2's GELU unfused on its TorchScript exports: onnxscript's
erf rules read the half applied to the product, not to ``x``. Graphs below are written in that order and its
commuted and ``Mul(x, 1/sqrt 2)`` variants; each is compared with the original under ORT (optimizations off)
on several shapes. ``heldout_esm_ts_eager.onnx`` is ``python -m bench.heldout_text --only esm --exporters
ts_eager``.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from passes.fusion import _erf_gelu
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, parse, session

GRAPH = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, S, 8] x) => (float[B, S, 8] y) <float half = {%r}, float root = {%r}, float one = {1.0}> {
    s = %s
    e = Erf(s)
    a = %s
    h = %s
    y = Mul(h, a)
}
"""
ROOT2 = math.sqrt(2.0)
FORMS = {
    "esm": (0.5, ROOT2, "Div(x, root)", "Add(e, one)", "Mul(x, half)"),
    "commuted": (0.5, ROOT2, "Div(x, root)", "Add(one, e)", "Mul(half, x)"),
    "inverse_root": (0.5, 1 / ROOT2, "Mul(x, root)", "Add(e, one)", "Mul(x, half)"),
    "inverse_root_commuted": (0.5, 1 / ROOT2, "Mul(root, x)", "Add(e, one)", "Mul(x, half)"),
}


def _model(half: float, root: float, scaled: str, added: str, halved: str) -> ir.Model:
    return ir.serde.deserialize_model(parse(GRAPH % (half, root, scaled, added, halved)))


def _assert_same(original: ir.Model, rewritten: ir.Model) -> None:
    reference, candidate = session(original), session(rewritten)
    rng = np.random.default_rng(0)
    for shape in ((1, 3, 8), (4, 17, 8)):
        x = (rng.standard_normal(shape) * 3).astype(np.float32)
        np.testing.assert_allclose(candidate.run(None, {"x": x})[0], reference.run(None, {"x": x})[0], atol=1e-5)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_half_first_erf_gelu_becomes_one_gelu(form):
    original, model = _model(*FORMS[form]), _model(*FORMS[form])
    assert _erf_gelu.rules.apply_to_model(model) == 1
    ops = op_histogram(model)
    assert ops["com.microsoft::Gelu"] == 1 and "Erf" not in ops
    _assert_same(original, model)


@pytest.mark.parametrize(("half", "root"), [(0.6, ROOT2), (0.5, 1.5)])
def test_other_constants_are_not_gelu(half, root):
    model = _model(half, root, "Div(x, root)", "Add(e, one)", "Mul(x, half)")
    assert _erf_gelu.rules.apply_to_model(model) == 0
    assert "Erf" in op_histogram(model)


def test_esm_gelu_fuses_with_its_bias_in_fuse_transformer():
    result = FuseTransformer({"engines": ["onnxscript"]})(ir.load(MODELS / "heldout_esm_ts_eager.onnx"))
    candidate = result.notes["candidates"]["onnxscript"]
    assert candidate["onnxscript_counts"]["erf_gelu_half_first"] == 2
    assert result.counts["fused_gelu"] == 2 and op_histogram(result.model)["com.microsoft::BiasGelu"] == 2
    assert "gelu" not in result.notes["missing"] and "Erf" not in op_histogram(result.model)
    reference, fused = session(str(MODELS / "heldout_esm_ts_eager.onnx")), session(result.model)
    rng = np.random.default_rng(1)
    for batch, seq in ((1, 6), (3, 29)):
        feeds = {
            "input_ids": rng.integers(5, 384, size=(batch, seq), dtype=np.int64),
            "attention_mask": np.ones((batch, seq), np.int64),
        }
        np.testing.assert_allclose(fused.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
