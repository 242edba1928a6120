"""fuse_gqa's mask probe runs the mask's subgraph at growing lengths until the model stops taking them (a position
table's rows, TorchScript DistilBERT's mask being expanded to its scores' shape): those expected failures come
back as ProbeError text, and ORT prints nothing of them on the worker's stderr (a DistilBERT job showed ORT's
red "Non-zero status code ... 520 by 1024" line in every log)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.fusion import _gqa_probe


def _position_table(rows: int) -> onnx.ModelProto:
    """positions [n] -> table[positions]: fails past ``rows``, as a learned position embedding does."""
    table = numpy_helper.from_array(np.zeros((rows, 4), np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "positions"], ["y"])],
        "table",
        [helper.make_tensor_value_info("positions", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        [table],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_probe_session_raises_past_the_table_and_prints_no_ort_error(capfd: pytest.CaptureFixture[str]) -> None:
    session = _gqa_probe._session(_position_table(8))
    assert session.run(None, {"positions": np.arange(8)})[0].shape == (8, 4)
    capfd.readouterr()
    with pytest.raises(Exception, match="out of data bounds"):  # the text the probe turns into its ProbeError
        session.run(None, {"positions": np.arange(16)})
    err = capfd.readouterr().err
    assert "[E:onnxruntime" not in err and "Non-zero status code" not in err
