"""core/precision.py and ``Tolerance.in_precision``: float32 outputs of half-precision arithmetic."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from core.config import HALF_PRECISION_FLOOR, Tolerance
from core.precision import compute_precision


def _model(*weights: np.ndarray, constant: np.ndarray | None = None):
    inits = [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)]
    nodes = [helper.make_node("Identity", ["x"], ["y"])]
    if constant is not None:
        nodes.append(helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(constant)))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        inits,
    )
    return helper.make_model(graph)


def test_compute_precision_is_the_half_type_holding_most_float_weight_elements() -> None:
    assert compute_precision(_model(np.zeros((8, 8), np.float16), np.zeros(4, np.float32))) == "float16"
    assert compute_precision(_model(np.zeros((8, 8), np.float32), np.zeros(4, np.float16))) is None
    assert compute_precision(_model(np.zeros(3, np.int64))) is None  # no float weights: no claim
    assert compute_precision(_model(np.zeros(2, np.float32), constant=np.zeros(16, np.float16))) == "float16"
    bf16 = _model()
    bf16.graph.initializer.append(helper.make_tensor("b", TensorProto.BFLOAT16, [64], [0] * 64))
    assert compute_precision(bf16) == "bfloat16"


def test_in_precision_raises_atol_and_rtol_to_the_floor_unless_waived_or_already_coarser() -> None:
    floor = HALF_PRECISION_FLOOR["float16"]
    raised = Tolerance().in_precision("float16")
    assert (raised.atol, raised.rtol) == (floor, floor) and raised.bounds(np.float32) == (floor, floor)
    assert Tolerance().in_precision(None) == Tolerance()
    assert Tolerance(half_precision_floor=False).in_precision("float16").atol == Tolerance().atol
    coarse = Tolerance(atol=0.1, rtol=0.1)
    assert coarse.in_precision("float16") is coarse
