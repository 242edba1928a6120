r"""Build the small committed models every layer of the test suite uses.

Run ``python -m tests.models.build_basic`` to regenerate them; the files are deterministic (fixed seeds,
fixed names), so a rebuild yields the same bytes.

``mlp_cleanup.onnx`` is a two-layer MLP over ``x: float32[batch, 16]`` that an exporter might leave dirty,
with one instance of everything the exact cleanup passes remove:

    x -> Identity -> MatMul(W1) -> Add(b1 + Const(0) folded) -> Relu --+--> Add --> MatMul(W2) -> y
                                                                 \-> Relu (duplicate of the Relu) -/
    Const(2) * Const(3) -> Mul (constant subgraph)  -> Add into b1 side
    Relu -> Sigmoid (dead: nothing reads it)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).parent
OPSET = 17


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name)


def make_mlp_cleanup() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 32)).astype(np.float32) * 0.25
    b1 = rng.standard_normal((32,)).astype(np.float32) * 0.1
    w2 = rng.standard_normal((32, 8)).astype(np.float32) * 0.25
    nodes = [
        helper.make_node("Identity", ["x"], ["x_id"], name="identity_in"),
        helper.make_node("MatMul", ["x_id", "W1"], ["h0"], name="matmul_1"),
        # A constant subexpression an exporter leaves behind: b1 + (two * three - six), i.e. b1 + 0.
        helper.make_node("Constant", [], ["two"], name="const_two", value=_init("two_v", np.array(2.0, np.float32))),
        helper.make_node(
            "Constant", [], ["three"], name="const_three", value=_init("three_v", np.array(3.0, np.float32))
        ),
        helper.make_node("Mul", ["two", "three"], ["six_a"], name="const_mul"),
        helper.make_node("Sub", ["six_a", "six"], ["zero"], name="const_sub"),
        helper.make_node("Add", ["b1", "zero"], ["b1_folded"], name="const_add"),
        helper.make_node("Add", ["h0", "b1_folded"], ["h1"], name="add_bias_1"),
        helper.make_node("Relu", ["h1"], ["r_a"], name="relu_a"),
        helper.make_node("Relu", ["h1"], ["r_b"], name="relu_b_duplicate"),
        helper.make_node("Add", ["r_a", "r_b"], ["r_sum"], name="add_branches"),
        helper.make_node("Sigmoid", ["r_a"], ["dead"], name="sigmoid_dead"),
        helper.make_node("Identity", ["r_sum"], ["r_sum_id"], name="identity_mid"),
        helper.make_node("MatMul", ["r_sum_id", "W2"], ["y"], name="matmul_2"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp_cleanup",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        initializer=[_init("W1", w1), _init("b1", b1), _init("W2", w2), _init("six", np.array(6.0, np.float32))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="onnxforge-tests")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


MODELS = {"mlp_cleanup.onnx": make_mlp_cleanup}


def main() -> None:
    for filename, build in MODELS.items():
        onnx.save(build(), HERE / filename)
        print(f"wrote {HERE / filename}")


if __name__ == "__main__":
    main()
