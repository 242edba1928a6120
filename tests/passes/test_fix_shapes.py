"""fix_shapes: named dims become static everywhere, ORT runs at that shape and refuses others."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from passes._infra import PassContext
from passes.session.fix_shapes import FixShapes
from tests.passes._util import parse


def _model() -> onnx.ModelProto:
    return parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, seq] x) => (float[batch, seq] y)
        {
            [relu] r = Relu(x)
            [neg] y = Neg(r)
        }
    """)


def _session(model: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])


def test_fix_shapes_freezes_named_dims_everywhere_when_dims_are_given():
    # setup
    model = ir.serde.deserialize_model(_model())
    # execute
    result = FixShapes({"dims": {"batch": 2, "seq": 8}})(model, PassContext())
    # assert
    assert result.modified and result.counts["dims_fixed"] >= 4
    assert list(model.graph.inputs[0].shape) == [2, 8] and list(model.graph.outputs[0].shape) == [2, 8]
    session = _session(model)
    assert session.get_inputs()[0].shape == [2, 8]
    x = np.ones((2, 8), np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], -x)
    with pytest.raises(Exception, match=r"dimensions|Got invalid"):
        session.run(None, {"x": np.ones((3, 8), np.float32)})


def test_fix_shapes_freezes_one_input_when_inputs_gives_its_shape():
    model = ir.serde.deserialize_model(_model())
    result = FixShapes({"inputs": {"x": [1, 4]}})(model, PassContext())
    assert result.modified and list(model.graph.outputs[0].shape) == [1, 4]


def test_fix_shapes_refuses_with_reason_when_dim_name_is_not_in_the_graph():
    model = ir.serde.deserialize_model(_model())
    result = FixShapes({"dims": {"sequence_length": 8}})(model, PassContext())
    assert not result.modified and "sequence_length" in result.non_matches[0].reason
    assert model.graph.inputs[0].shape[0].value == "batch"


def test_fix_shapes_refuses_when_the_given_rank_differs():
    model = ir.serde.deserialize_model(_model())
    result = FixShapes({"inputs": {"x": [1, 2, 3]}})(model, PassContext())
    assert not result.modified and "rank" in result.non_matches[0].reason
