"""ORT's symbolic shape inference, given opset 18's reductions that read their axes from an input.

Ultralytics' RT-DETR export (opset 18, ``bench/heldout_detection.py``) picks its queries with a TopK over a
``ReduceMax(scores, axes=[-1])``. ORT's inference reads the axes input of ReduceSum and ReduceMean only; for
ReduceMax, ONNX's inference of the node alone left the output without a rank, the TopK after it raised
"object of type 'NoneType' has no len()", the whole inference stopped and fuse_transformer had no heads dims for
any of the model's 7 attentions. ``passes.fusion._symbolic_gqa`` gives those reductions ReduceSum's rule.
"""

from __future__ import annotations

import onnx
import pytest
from onnxruntime.transformers.shape_infer_helper import SymbolicShapeInference

from passes.fusion._symbolic_gqa import infer_shapes
from tests.passes._util import parse

# scores -> max over the classes (axes an input, as opset 18 writes it) -> the top 2 queries
TOP_QUERIES = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, Q, C] scores) => (float[B, K] best, int64[B, K] index)
  <int64[1] last = {-1}, int64[1] k = {2}> {
    score = %s <keepdims = 0> (scores, last)
    best, index = TopK(score, k)
}
"""


def _dims(model: onnx.ModelProto, name: str) -> list:
    values = {v.name: v for v in [*model.graph.value_info, *model.graph.output]}
    return [d.dim_param or d.dim_value for d in values[name].type.tensor_type.shape.dim]


def test_ort_alone_stops_at_the_reduce_max() -> None:
    with pytest.raises(TypeError):
        SymbolicShapeInference.infer_shapes(parse(TOP_QUERIES % "ReduceMax"), auto_merge=True)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin", "ReduceL2", "ReduceLogSumExp", "ReduceSumSquare"])
def test_the_reduction_keeps_the_dims_it_does_not_reduce(op: str) -> None:
    inferred = infer_shapes(parse(TOP_QUERIES % op))
    assert _dims(inferred, "score") == ["B", "Q"]
    assert _dims(inferred, "best") == ["B", 2]
