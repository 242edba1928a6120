"""The ledger rolls back the one pass whose model ORT cannot run at its default level (issue 17).

Found on torchvision's RetinaNet (``bench/heldout_detection.py``): with random weights it keeps no box, and the
boxes are reshaped from ``[0, 2, 2]`` to ``[0, 4]`` through ``Concat(Shape(boxes)[0], Shape(boxes)[1])``. The
shapes ``shape_inference`` writes (correct ones: the pairs and the boxes share their first dimension) let ORT's
ReshapeFusion, at ORT's default level, turn that target into ``[0, -1]``, which no empty tensor can take. The
verification runs with ORT's optimizations off and passed; the gate's benchmark failed, and the whole job came
back as the upload, although only that one annotation was at fault. The cleanup group is now run again pass by
pass, and the ledger rolls back the pass the benchmark cannot run (``workers.benchmark.run_failure``), keeping
the rest.

The graph here is that detector's tail, the filter made empty by construction (no box scores above 1e30).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from core.config import JobConfig
from core.settings import PipelineSettings
from passes.cleanup.identity_elimination import IdentityElimination
from passes.cleanup.shape_inference import ShapeInference
from tests.workers.conftest import resolver
from workers.pipeline import PipelineRequest, run_pipeline


def _ints(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(values)], values)
    )


def _scalar(name: str, value: float, elem: int) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, elem, [], [value]))


def empty_boxes_model() -> onnx.ModelProto:
    """boxes[n, m] -> the rows scoring above 1e30 (none) -> their x and y columns paired as [k, m/2, 2] -> reshaped
    back to [k, m] with a target read from the kept rows' Shape; an Identity for identity_elimination."""
    nodes = [
        helper.make_node("ReduceMax", ["boxes"], ["best"], axes=[1], keepdims=0),
        _scalar("big", 1e30, TensorProto.FLOAT),
        helper.make_node("Greater", ["best", "big"], ["hit"]),
        helper.make_node("NonZero", ["hit"], ["nz"]),
        _ints("axis0", [0]),
        helper.make_node("Squeeze", ["nz", "axis0"], ["idx"]),
        helper.make_node("Gather", ["boxes", "idx"], ["kept"], axis=0),
        _ints("zero", [0]),
        _ints("one", [1]),
        _ints("end", [1 << 62]),
        _ints("step", [2]),
        helper.make_node("Slice", ["kept", "zero", "end", "one", "step"], ["xs"]),
        helper.make_node("Slice", ["kept", "one", "end", "one", "step"], ["ys"]),
        _ints("last", [-1]),
        helper.make_node("Unsqueeze", ["xs", "last"], ["xu"]),
        helper.make_node("Unsqueeze", ["ys", "last"], ["yu"]),
        helper.make_node("Concat", ["xu", "yu"], ["pairs"], axis=2),
        helper.make_node("Shape", ["kept"], ["shape"]),
        _scalar("i0", 0, TensorProto.INT64),
        _scalar("i1", 1, TensorProto.INT64),
        helper.make_node("Gather", ["shape", "i0"], ["rows"]),
        helper.make_node("Gather", ["shape", "i1"], ["cols"]),
        helper.make_node("Unsqueeze", ["rows", "axis0"], ["rows1"]),
        helper.make_node("Unsqueeze", ["cols", "axis0"], ["cols1"]),
        helper.make_node("Concat", ["rows1", "cols1"], ["target"], axis=0),
        helper.make_node("Reshape", ["pairs", "target"], ["reshaped"]),
        helper.make_node("Identity", ["reshaped"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "empty_boxes",
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["n", "m"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["k", "m"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def test_the_upload_runs_at_the_default_level_and_gives_no_box() -> None:
    session = ort.InferenceSession(empty_boxes_model().SerializeToString(), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"boxes": np.random.default_rng(0).random((3, 4), dtype=np.float32)})
    assert out.shape == (0, 4)


def test_the_pass_the_benchmark_cannot_run_is_rolled_back_and_the_others_kept(
    tmp_path: Path, fast_settings: PipelineSettings
) -> None:
    src = tmp_path / "boxes.onnx"
    onnx.save(empty_boxes_model(), src)
    request = PipelineRequest(
        model_path=src,
        output_dir=tmp_path / "out",
        config=JobConfig.parse({"rollback_slower": False}),
        settings=fast_settings,
        pass_resolver=resolver(ShapeInference(), IdentityElimination()),
    )
    report = run_pipeline(request).report
    records = {p["name"]: p for p in report["passes"]}
    shapes = records["shape_inference"]
    assert shapes["status"] == "rolled_back"
    assert "failed to run as users run it" in shapes["reason"] and "Reshape" in shapes["reason"]
    assert records["identity_elimination"]["status"] == "applied"
    assert "benchmark_error" not in report["decision"]["gate"]
    assert report["verification"]["ok"]
