"""Build tests/gpu/static_mlp.onnx: ``python -m tests.gpu.build_static_mlp``.

A two-layer MLP with a fully static input (x: float[4, 64]) and every op on the CUDA EP, so a CUDA graph
can capture it; small enough (about 130 KiB) to commit. Seeded: the same bytes on every build.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PATH = Path(__file__).resolve().parent / "static_mlp.onnx"
BATCH, WIDTH, HIDDEN = 4, 64, 256


def build() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)

    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], ["h4"]),
        helper.make_node("Softmax", ["h4"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "static_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, WIDTH])],
        [
            weight("w1", WIDTH, HIDDEN),
            weight("b1", HIDDEN),
            weight("w2", HIDDEN, WIDTH),
            weight("b2", WIDTH),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnxforge-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


if __name__ == "__main__":
    onnx.save(build(), str(PATH))
    print(PATH)
