"""upstream_reshape crosses a whole RMS norm (held-out probe round 2: a mixture of experts flattens its input,
``hidden.view(-1, H)``, right after the post-attention RMS norm). Before, the flatten climbed the norm's
Mul/Div and its [B,S,1] statistic up to ``ReduceMean`` and stopped there, leaving the norm half 2-D, which
neither onnxscript nor ORT's session fuses (Mixtral/Qwen2-MoE dynamo: 3 of 5 norms fused in the session)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes.compute_order.upstream_reshape import UpstreamReshape
from tests.passes._util import checked, parse, session

NORM_THEN_FLATTEN = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[B,S,8] h, float[B,S,8] r) => (float[N,4] y) {
    x = Add (h, r)
    two = Constant <value = float {2.0}> ()
    axes = Constant <value = int64[1] {AXIS}> ()
    eps = Constant <value = float {1e-6}> ()
    w = Constant <value = float[8] {1,2,3,4,5,6,7,8}> ()
    flat = Constant <value = int64[2] {-1, 8}> ()
    proj = Constant <value = float[8,4] {1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1, 1,1,0,0, 0,1,1,0, 0,0,1,1, 1,0,0,1}> ()
    sq = Pow (x, two)
    mean = ReduceMean <keepdims = 1> (sq, axes)
    var = Add (mean, eps)
    root = Sqrt (var)
    inv = Reciprocal (root)
    normed = Mul (x, inv)
    scaled = Mul (normed, w)
    rows = Reshape (scaled, flat)
    y = MatMul (rows, proj)
}
"""


def _run(axis: int) -> ir.Model:
    model = ir.serde.deserialize_model(parse(NORM_THEN_FLATTEN.replace("AXIS", str(axis))))
    UpstreamReshape()(model)
    return model


def test_the_flatten_crosses_the_whole_norm_and_the_result_is_unchanged() -> None:
    reference = parse(NORM_THEN_FLATTEN.replace("AXIS", "-1"))
    model = _run(-1)
    square = next(n for n in model.graph if n.op_type == "Pow")
    normalize = next((n for n in model.graph if n.op_type == "Mul" and n.inputs[0] is square.inputs[0]), None)
    assert normalize is not None  # the norm reads one value, 2-D: the residual sum of the flattened inputs
    assert square.inputs[0].producer().op_type == "Add"
    assert sorted(n.inputs[0].name for n in model.graph if n.op_type == "Reshape") == ["h", "r"]
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal((3, 5, 8)).astype(np.float32) for k in ("h", "r")}
    want = session(ir.serde.deserialize_model(reference)).run(None, feeds)[0]
    got = session(ir.serde.deserialize_model(checked(model))).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("axis", [2, 1])
def test_a_statistic_over_an_axis_named_otherwise_stops_it(axis: int) -> None:
    model = _run(axis)  # axis 2 is the last too, but would have to become 1: left as it is
    square = next(n for n in model.graph if n.op_type == "Pow")
    assert square.inputs[0].name == "x" and len(square.inputs[0].shape) == 3
