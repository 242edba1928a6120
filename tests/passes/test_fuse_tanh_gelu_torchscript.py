"""The TorchScript exporter's ``F.gelu(x, approximate="tanh")`` and BLOOM's factored tanh GELU fused into
``com.microsoft::FastGelu`` (issue 17, held-out decoders: Gemma's gated MLP and BLOOM's MLP kept their Tanh
chains under ``fast``; ``bench/heldout_dec_nocache.py``).

The graphs are the exporter's ``aten::gelu`` symbolic node for node (constants first, the cube as
``Mul(h, Mul(h, h))``) and BLOOM's ``x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))`` as both
exporters write it, on a projection with and without a bias, alone and gating an up-projection as
Gemma's ``act(gate) * up`` does; each is checked in ORT against the unfused graph run with optimizations off.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass

from passes._infra import op_histogram
from passes.fusion import _onnxscript_adapter as adapter
from passes.fusion import _tanh_gelu as tanh_gelu

D, F = 16, 24
SHAPES = ((2, 5), (1, 1), (3, 17))


def _const(name: str, value: float) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.float32)))


def _torchscript(h: str, cubic: float) -> list[onnx.NodeProto]:
    """torch's ``aten::gelu(approximate="tanh")`` symbolic, node for node."""
    return [
        _const("beta", math.sqrt(2 / math.pi)),
        _const("kappa", cubic),
        _const("one", 1.0),
        _const("half", 0.5),
        helper.make_node("Mul", [h, h], ["sq"]),
        helper.make_node("Mul", [h, "sq"], ["cube"]),
        helper.make_node("Mul", ["kappa", "cube"], ["kc"]),
        helper.make_node("Add", [h, "kc"], ["inner0"]),
        helper.make_node("Mul", ["beta", "inner0"], ["inner"]),
        helper.make_node("Tanh", ["inner"], ["t"]),
        helper.make_node("Add", ["one", "t"], ["t1"]),
        helper.make_node("Mul", [h, "t1"], ["ht"]),
        helper.make_node("Mul", ["half", "ht"], ["gelu"]),
    ]


def _factored(h: str, cubic: float) -> list[onnx.NodeProto]:
    """BLOOM's ``x * 0.5 * (1.0 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))`` as both exporters write it
    (torch evaluates left to right, the scalars on the right)."""
    return [
        _const("beta", 0.79788456),
        _const("kappa", cubic),
        _const("one", 1.0),
        _const("half", 0.5),
        helper.make_node("Mul", [h, "half"], ["xh"]),
        helper.make_node("Mul", [h, "beta"], ["xb"]),
        helper.make_node("Mul", [h, "kappa"], ["xk"]),
        helper.make_node("Mul", ["xk", h], ["xkx"]),
        helper.make_node("Add", ["xkx", "one"], ["poly"]),
        helper.make_node("Mul", ["xb", "poly"], ["inner"]),
        helper.make_node("Tanh", ["inner"], ["t"]),
        helper.make_node("Add", ["t", "one"], ["t1"]),
        helper.make_node("Mul", ["xh", "t1"], ["gelu"]),
    ]


FORMS = {"torchscript": _torchscript, "factored": _factored}


def tanh_gelu_graph(
    *, bias: bool, gated: bool, form: str = "torchscript", cubic: float = 0.044715, bias_reader: bool = False
) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((D, F)).astype(np.float32), "W")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"])]
    h = "mm"
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(F).astype(np.float32), "b"))
        nodes.append(helper.make_node("Add", ["b", "mm"], ["h"]))  # the exporter's order: bias first
        h = "h"
    nodes += FORMS[form](h, cubic)
    out = "gelu"
    if gated:
        inits.append(numpy_helper.from_array(rng.standard_normal((D, F)).astype(np.float32), "U"))
        nodes += [helper.make_node("MatMul", ["x", "U"], ["up"]), helper.make_node("Mul", ["gelu", "up"], ["y"])]
        out = "y"
    outputs = [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["B", "S", F])]
    if bias_reader:  # a second reader of the biased projection: the bias must stay outside the kernel
        outputs.append(helper.make_tensor_value_info(h, TensorProto.FLOAT, ["B", "S", F]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", D])], outputs, inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _loaded(proto: onnx.ModelProto) -> ir.Model:
    """As the rule meets the graph inside ``fuse_transformer``: shapes and types inferred."""
    model = ir.serde.deserialize_model(proto)
    ShapeInferencePass()(model)
    return model


def _run(model: onnx.ModelProto, x: np.ndarray, optimize: bool) -> list[np.ndarray]:
    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def _assert_same(original: onnx.ModelProto, fused: ir.Model) -> None:
    proto = ir.serde.serialize_model(fused)
    rng = np.random.default_rng(1)
    for batch, seq in SHAPES:
        x = (rng.standard_normal((batch, seq, D)) * 2).astype(np.float32)  # reaches tanh's flat tails too
        for got, want in zip(_run(proto, x, True), _run(original, x, False), strict=True):
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"at {batch}x{seq}")


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_tanh_gelu_fuses_fast_gelu_when_torchscript_or_factored_gelu_tanh(bias, gated, form):
    original = tanh_gelu_graph(bias=bias, gated=gated, form=form)
    model = _loaded(original)
    assert tanh_gelu.rules.apply_to_model(model) == 1
    RemoveUnusedNodesPass()(model)  # the rule leaves the bias Add and the constants unread, not removed
    ops = op_histogram(model)
    assert ops["com.microsoft::FastGelu"] == 1
    assert "Tanh" not in ops
    gelu = next(n for n in model.graph if n.op_type == "FastGelu")
    assert len(gelu.inputs) == (2 if bias else 1)  # the bias moves into the kernel
    assert "Add" not in ops and "Constant" not in ops
    assert ops.get("Mul", 0) == (1 if gated else 0)  # only the gate's product is left
    _assert_same(original, model)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_tanh_gelu_keeps_bias_add_when_biased_projection_read_elsewhere(form):
    original = tanh_gelu_graph(bias=True, gated=False, form=form, bias_reader=True)
    model = _loaded(original)
    assert tanh_gelu.rules.apply_to_model(model) == 1
    RemoveUnusedNodesPass()(model)
    gelu = next(n for n in model.graph if n.op_type == "FastGelu")
    assert len(gelu.inputs) == 1 and op_histogram(model)["Add"] == 1
    _assert_same(original, model)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_tanh_gelu_leaves_graph_when_cubic_constant_differs(form):
    model = _loaded(tanh_gelu_graph(bias=False, gated=True, form=form, cubic=0.05))
    assert tanh_gelu.rules.apply_to_model(model) == 0
    assert "com.microsoft::FastGelu" not in op_histogram(model)


def test_fuse_for_ort_fuses_gated_torchscript_gelu_when_no_attention():
    """What ``fuse_transformer``'s onnxscript engine runs: the rule's FastGelu survives onnxscript's own
    gelu/bias_gelu steps and the cleanups after them."""
    original = tanh_gelu_graph(bias=True, gated=True)
    model = _loaded(original)
    counts = adapter.fuse_for_ort(model)
    assert counts["tanh_gelu"] == 1
    ops = op_histogram(model)
    assert ops["com.microsoft::FastGelu"] == 1 and "Tanh" not in ops
    _assert_same(original, model)
