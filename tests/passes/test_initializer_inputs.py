"""initializer_inputs: weights listed among the graph inputs (``torch.onnx.export(keep_initializers_as_inputs=
True)``, IR-3 exports) are overridable inputs from IR version 4 on, so ONNX Runtime does not fold them: a
Conv-BatchNorm-ReLU stack keeps its BatchNormalization and ReLU. Without the listing ORT folds both into the Conv.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from passes.cleanup.initializer_inputs import InitializerInputs
from tests.passes._util import apply, checked, session


def _conv_bn_relu(ir_version: int, opset: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    arrays = {
        "w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.2,
        "scale": rng.random(8).astype(np.float32) + 0.5,
        "bias": rng.standard_normal(8).astype(np.float32) * 0.1,
        "mean": rng.standard_normal(8).astype(np.float32) * 0.1,
        "var": rng.random(8).astype(np.float32) + 0.5,
    }
    inits = [numpy_helper.from_array(a, n) for n, a in arrays.items()]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["y"]),
    ]
    listed = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(a.shape)) for n, a in arrays.items()]
    graph = helper.make_graph(
        nodes,
        "conv_bn_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16]), *listed],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 16, 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    onnx.checker.check_model(model, full_check=True)
    return model


def _ort_ops(model: onnx.ModelProto | ir.Model, tmp_path: Path) -> list[str]:
    """The ops of ORT's own optimized graph (its default level) for ``model``."""
    import onnxruntime as ort

    proto = model if isinstance(model, onnx.ModelProto) else ir.serde.serialize_model(model)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "ort_optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(str(tmp_path / "ort_optimized.onnx")).graph.node]


def _assert_same(original: onnx.ModelProto, optimized: ir.Model) -> None:
    reference, candidate = session(ir.serde.deserialize_model(original)), session(optimized)
    rng = np.random.default_rng(1)
    for batch in (1, 3, 5):
        feeds = {"x": rng.standard_normal((batch, 3, 16, 16)).astype(np.float32)}
        np.testing.assert_allclose(candidate.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-6, atol=1e-6)


def test_listed_weights_leave_the_inputs_and_ort_then_folds_the_batch_norm(tmp_path: Path):
    original = _conv_bn_relu(ir_version=8, opset=17)
    assert "BatchNormalization" in _ort_ops(original, tmp_path)  # overridable: ORT keeps it

    model, result = apply(InitializerInputs(), original)

    assert result.modified and result.counts["initializer_inputs_removed"] == 5
    assert [v.name for v in model.graph.inputs] == ["x"]
    assert set(model.graph.initializers) == {"w", "scale", "bias", "mean", "var"}
    assert "'w'" in result.notes["removed_inputs"]
    folded = _ort_ops(checked(model), tmp_path)
    assert "BatchNormalization" not in folded and "Relu" not in folded, folded  # folded into the Conv
    _assert_same(original, model)


def test_an_ir3_model_is_raised_to_ir4_where_the_listing_may_go(tmp_path: Path):
    original = _conv_bn_relu(ir_version=3, opset=9)  # IR 3 requires every initializer among the inputs

    model, result = apply(InitializerInputs(), original)

    assert result.modified and model.ir_version == 4 and "3 -> 4" in result.notes["ir_version"]
    assert [v.name for v in model.graph.inputs] == ["x"]
    checked(model)
    _assert_same(original, model)


def test_a_model_without_listed_weights_is_left_as_it_is():
    listed = _conv_bn_relu(ir_version=8, opset=17)
    del listed.graph.input[1:]
    model, result = apply(InitializerInputs(), listed)
    assert not result.modified and result.counts["initializer_inputs_removed"] == 0
    assert [v.name for v in model.graph.inputs] == ["x"]
