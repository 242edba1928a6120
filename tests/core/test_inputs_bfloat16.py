"""core/inputs: a bfloat16 input is refused with the reason, not with a request for samples (issue 17).

``python -m bench.heldout_export_variants --exporters ts_bf16`` (``model.to(torch.bfloat16)``): a Llama with a
KV cache has bfloat16 cache inputs, and the job asked for samples.npz, which numpy cannot hold in bfloat16 and
ORT's Python API cannot take; the CPU EP also lacks most bfloat16 kernels (the same export's ``Where`` and
``Add`` fail to load). The message now says the service cannot run it and what export it can.
"""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from core.errors import InvalidModelError
from core.inputs import generate_input_sets


def _model(elem: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT), helper.make_node("Relu", ["c"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", elem, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_bfloat16_input_is_refused_with_why_and_without_asking_for_samples() -> None:
    with pytest.raises(InvalidModelError) as caught:
        generate_input_sets(_model(TensorProto.BFLOAT16), 1)
    assert caught.value.code == "UNSUPPORTED_INPUT"
    message = str(caught.value)
    assert "'x' is bfloat16" in message and "float16 or float32" in message and "samples.npz" not in message


def test_other_ungenerable_dtypes_still_ask_for_samples() -> None:
    with pytest.raises(InvalidModelError, match=r"upload samples\.npz"):
        generate_input_sets(_model(TensorProto.COMPLEX64), 1)  # strings are generated: core/inputs/graph.py
