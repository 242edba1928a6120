"""float16: every node with a float16 form converts, float32 I/O stays with keep_io_types, blocked ops stay
float32, and the pass refuses on target cpu unless forced."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from passes._infra import PassContext
from passes.precision.float16 import Float16
from tests.passes._util import parse

GPU = "CUDAExecutionProvider" in ort.get_available_providers()


def _mlp() -> onnx.ModelProto:
    """x[batch,8] -> MatMul(W) -> Add(b) -> Relu -> Softmax -> y; Shape(y) -> s (int64 output)."""
    rng = np.random.default_rng(0)
    w = ", ".join(f"{v:.4f}" for v in rng.standard_normal(64) * 0.3)
    b = ", ".join(f"{v:.4f}" for v in rng.standard_normal(8) * 0.1)
    return parse(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, 8] x) => (float[batch, 8] y, int64[2] s)
        <float[8, 8] W = {{{w}}}, float[8] b = {{{b}}}>
        {{
            [mm] h = MatMul(x, W)
            [add] h2 = Add(h, b)
            [relu] r = Relu(h2)
            [softmax] y = Softmax(r)
            [shape] s = Shape(y)
        }}
    """)


def _run(model: onnx.ModelProto | ir.Model, x: np.ndarray, providers: list[str] | None = None) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model) if isinstance(model, ir.Model) else model
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=providers or ["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def _dtypes(model: ir.Model) -> dict[str, ir.DataType | None]:
    return {v.name or "": v.dtype for node in model.graph for v in node.outputs}


def test_float16_converts_every_float_node_and_keeps_float32_io_when_forced_on_cpu():
    # setup
    proto = _mlp()
    model = ir.serde.deserialize_model(proto)
    # execute
    result = Float16({"force": True})(model, PassContext())
    # assert
    assert result.modified and result.counts["nodes_fp16"] == 4
    dtypes = _dtypes(model)
    assert {dtypes[n] for n in ("h", "h2", "r")} == {ir.DataType.FLOAT16}
    assert model.graph.initializers["W"].dtype == ir.DataType.FLOAT16
    assert [v.dtype for v in model.graph.inputs] == [ir.DataType.FLOAT]
    assert [v.dtype for v in model.graph.outputs] == [ir.DataType.FLOAT, ir.DataType.INT64]
    assert [v.name for v in model.graph.outputs] == ["y", "s"]
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    ref, got = _run(proto, x), _run(model, x)
    assert got[0].dtype == np.float32
    np.testing.assert_allclose(got[0], ref[0], atol=5e-3, rtol=1e-2)
    np.testing.assert_array_equal(got[1], ref[1])


def test_float16_keeps_op_in_float32_when_op_block_list_names_it():
    model = ir.serde.deserialize_model(_mlp())
    result = Float16({"force": True, "op_block_list": ["Softmax"]})(model, PassContext())
    assert result.modified
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    assert softmax.inputs[0].dtype == ir.DataType.FLOAT and softmax.outputs[0].dtype == ir.DataType.FLOAT
    assert "softmax" in result.notes["fp32_nodes"]
    assert _dtypes(model)["r"] == ir.DataType.FLOAT16  # the rest still converts


def test_float16_makes_graph_io_float16_when_keep_io_types_is_false():
    model = ir.serde.deserialize_model(_mlp())
    Float16({"force": True, "keep_io_types": False})(model, PassContext())
    assert model.graph.inputs[0].dtype == ir.DataType.FLOAT16
    assert model.graph.outputs[0].dtype == ir.DataType.FLOAT16


def test_float16_refuses_with_reason_when_target_is_cpu_and_not_forced():
    model = ir.serde.deserialize_model(_mlp())
    result = Float16()(model, PassContext(target="cpu"))
    assert not result.modified
    assert "usually slower on CPU" in result.non_matches[0].reason
    assert _dtypes(model)["h"] in (ir.DataType.FLOAT, None)


def test_float16_refuses_when_node_block_list_names_a_missing_node():
    model = ir.serde.deserialize_model(_mlp())
    result = Float16({"force": True, "node_block_list": ["nope"]})(model, PassContext())
    assert not result.modified and "nope" in result.non_matches[0].reason


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDAExecutionProvider")
def test_float16_matches_float32_on_cuda_when_target_is_cuda():
    proto = _mlp()
    model = ir.serde.deserialize_model(proto)
    assert Float16()(model, PassContext(target="cuda")).modified
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    got = _run(model, x, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    np.testing.assert_allclose(got[0], _run(proto, x)[0], atol=5e-3, rtol=1e-2)
