"""mixed_precision: nodes that overflow float16 stay float32, the rest converts; refuses when no split fits."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from passes._infra import PassContext
from passes.precision.mixed_precision import MixedPrecision
from tests.passes._util import parse


def _overflowing() -> onnx.ModelProto:
    """x -> MatMul -> Add -> Tanh -> Add(12) -> Exp -> y: Exp writes up to e^13 = 4.4e5 > 65504."""
    rng = np.random.default_rng(0)
    w = ", ".join(f"{v:.4f}" for v in rng.standard_normal(256) * 0.25)
    return parse(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, 16] x) => (float[batch, 16] y)
        <float[16, 16] W = {{{w}}}, float[16] b = {{{", ".join(["1.0"] * 16)}}}, float k = {{12.0}}>
        {{
            [mm] h = MatMul(x, W)
            [add] h2 = Add(h, b)
            [tanh] t = Tanh(h2)
            [shift] u = Add(t, k)
            [exp] y = Exp(u)
        }}
    """)


def _samples() -> list[dict[str, np.ndarray]]:
    return [{"x": np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)}]


def _precision(model: ir.Model) -> dict[str, ir.DataType | None]:
    return {node.name or "": node.outputs[0].dtype for node in model.graph if node.op_type != "Cast"}


def test_mixed_precision_keeps_only_the_overflowing_node_in_float32_when_tolerance_allows():
    # setup
    proto = _overflowing()
    model = ir.serde.deserialize_model(proto)
    # execute
    result = MixedPrecision({"force": True, "rtol": 2e-2})(model, PassContext(samples=_samples()))
    # assert
    assert result.modified
    out = result.model
    precision = _precision(out)
    assert precision["exp"] == ir.DataType.FLOAT
    assert {precision[n] for n in ("mm", "add", "tanh", "shift")} == {ir.DataType.FLOAT16}
    assert result.notes["overflow_nodes"] == ["exp"]
    assert "overflows float16" in result.notes["fp32_nodes"]["exp"]
    assert result.counts["nodes_fp32"] == 1 < result.counts["nodes_fp32"] + result.counts["nodes_fp16"]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    feeds = _samples()[0]
    ref = ort.InferenceSession(proto.SerializeToString(), options).run(None, feeds)[0]
    got = ort.InferenceSession(ir.serde.serialize_model(out).SerializeToString(), options).run(None, feeds)[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=2e-2)


def test_mixed_precision_refuses_with_reason_when_no_split_meets_tolerance():
    model = ir.serde.deserialize_model(_overflowing())
    opts = {"force": True, "atol": 0.0, "rtol": 0.0, "min_cosine": 1.0}
    result = MixedPrecision(opts)(model, PassContext(samples=_samples()))
    assert not result.modified
    assert "no float16 split meets tolerance" in result.non_matches[0].reason
    assert result.counts["conversions_tried"] >= 2  # it bisected before giving up


def test_mixed_precision_refuses_when_target_is_cpu_and_not_forced():
    model = ir.serde.deserialize_model(_overflowing())
    result = MixedPrecision()(model, PassContext(samples=_samples()))
    assert not result.modified and "slower on CPU" in result.non_matches[0].reason
