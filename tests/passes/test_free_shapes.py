"""free_shapes: Reshape/Expand constants that pin the batch are reported and freed; the model then runs at
another batch."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from passes._infra import PassContext
from passes.session.free_shapes import FreeShapes
from tests.passes._util import MLP_CLEANUP, parse


def _pinned() -> onnx.ModelProto:
    """Traced at batch 2: every shape constant says 2 where the batch goes."""
    return parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, 16] x) => (float[batch, 16] y)
        <int64[3] s1 = {2, 4, 4}, int64[3] e = {2, 4, 4}, int64[2] s2 = {2, 16}>
        {
            [split_heads] r = Reshape(x, s1)
            [relu] a = Relu(r)
            [expand] ex = Expand(a, e)
            [merge_heads] y = Reshape(ex, s2)
        }
    """)


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), options).run(None, {"x": x})[0]


def test_free_shapes_frees_reshape_and_expand_pins_when_they_pin_the_batch():
    # setup
    proto = _pinned()
    x2 = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    model = ir.serde.deserialize_model(proto)
    # execute
    result = FreeShapes()(model, PassContext(samples=[{"x": x2}]))
    # assert
    assert result.modified
    pins = {(p["node"], p["axis"]): p for p in result.notes["pins"]}
    assert set(pins) == {("split_heads", 0), ("expand", 0), ("merge_heads", 0)}
    assert all(p["freed"] and p["dim"] == "batch" for p in pins.values())
    freed = ir.serde.serialize_model(model)
    np.testing.assert_array_equal(_run(freed, x2), _run(proto, x2))  # same at the export shape
    x5 = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)
    np.testing.assert_array_equal(_run(freed, x5), np.maximum(x5, 0))  # and runs at batch 5
    assert model.graph.outputs[0].shape[0].value == "batch"


def test_free_shapes_only_reports_when_rewrite_is_off():
    model = ir.serde.deserialize_model(_pinned())
    result = FreeShapes({"rewrite": False})(model, PassContext())
    assert not result.modified
    assert any("pins batch" in m.reason for m in result.non_matches)


def test_free_shapes_finds_nothing_when_no_constant_pins_an_axis():
    model = ir.serde.deserialize_model(onnx.load(str(MLP_CLEANUP)))
    result = FreeShapes()(model, PassContext())
    assert not result.modified and result.counts["pins_found"] == 0
