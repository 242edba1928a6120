"""workers/gate.py: a ``fast`` job whose generated sets tie gets a second look at a serving length.

The generated sets hold 8-32 tokens, where a fused attention's gain is lost in the per-op overhead: on the
bench-size corpus ten ``fast`` jobs came back as the upload on such a tie (docs/coverage.md) though their
artifacts ran 1.1-1.3x faster at 256 tokens. The gate now verifies and times the artifact on one full row at
``gate_serving_length`` (``core.inputs.serving_input_set``) and keeps it when faster there beyond noise.

The tie on the generated sets is forced (``_tied``: the real comparison, flagged a tie and not slower), as
whether 8-32 tokens tie depends on the host; the serving-length comparison is real. The artifact that must not
be kept is one clearly slower at the serving length (``AddZeroBranch``): two programs of equal cost can time
apart beyond the 3% floor on a shared host, which once kept a one-ulp copy in CI. The model's costly branch is
quadratic in the sequence and multiplied by zero, so dropping it (``DropZeroBranch``) is exact and pays most at
256 tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.config import JobConfig
from core.settings import PipelineSettings
from passes._infra import Pass, PassContext, PassResult
from tests.workers.conftest import resolver
from workers import gate
from workers.benchmark import Comparison
from workers.pipeline import PipelineRequest, PipelineResult, run_pipeline
from workers.report import validate_report

# Wide enough that the two attention products, not the per-node overhead, make most of a 256-token run.
WIDTH = 256


def _quadratic_model() -> onnx.ModelProto:
    """input_ids [batch, seq] -> embeddings x; out = x + attention(x) + 0 * attention(x / 2)."""
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((50, WIDTH)).astype(np.float32), "table")
    half = numpy_helper.from_array(np.array([0.5], np.float32), "half")
    zero = numpy_helper.from_array(np.array([0.0], np.float32), "zero")
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["x"])]
    for tag, source in (("a", "x"), ("b", "x_half")):
        if tag == "b":
            nodes.append(helper.make_node("Mul", ["x", "half"], ["x_half"]))
        nodes += [
            helper.make_node("Transpose", [source], [f"t_{tag}"], perm=[0, 2, 1]),
            helper.make_node("MatMul", [source, f"t_{tag}"], [f"scores_{tag}"]),
            helper.make_node("Softmax", [f"scores_{tag}"], [f"probs_{tag}"], axis=-1),
            helper.make_node("MatMul", [f"probs_{tag}", source], [f"y_{tag}"]),
        ]
    nodes += [
        helper.make_node("Add", ["x", "y_a"], ["h"]),
        helper.make_node("Mul", ["y_b", "zero"], ["nothing"]),
        helper.make_node("Add", ["h", "nothing"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "quadratic",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "sequence", WIDTH])],
        [table, half, zero],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class DropZeroBranch(Pass):
    """Exact: the branch multiplied by zero is cut (its Add takes the zero itself), then swept."""

    name = "test_drop_zero_branch"
    summary = "test only: drops a branch multiplied by a constant zero"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        graph = model.graph
        times_zero = next(n for n in graph if n.op_type == "Mul" and n.inputs[1].name == "zero")
        add = next(iter(times_zero.outputs[0].uses())).node
        add.replace_input_with(1, times_zero.inputs[1])
        removed = 0
        while dead := [n for n in graph if all(not o.uses() and o not in graph.outputs for o in n.outputs)]:
            for node in dead:
                graph.remove(node, safe=True)
            removed += len(dead)
        return PassResult(model, True, counts={"nodes_removed": removed})


class AddZeroBranch(Pass):
    """Exact and costlier: a third quadratic branch, multiplied by zero, added to the output. Two programs of
    equal cost could still time apart by more than the 3% floor on a shared host; this one cannot be faster."""

    name = "test_add_zero_branch"
    summary = "test only: adds a quadratic branch multiplied by a constant zero"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        graph = model.graph
        x, zero = graph.node(0).outputs[0], graph.initializers["zero"]
        t = ir.node("Transpose", [x], attributes={"perm": [0, 2, 1]})
        scores = ir.node("MatMul", [x, t.outputs[0]])
        probs = ir.node("Softmax", [scores.outputs[0]], attributes={"axis": -1})
        y = ir.node("MatMul", [probs.outputs[0], x])
        nothing = ir.node("Mul", [y.outputs[0], zero])
        last = graph.node(-1)
        out = ir.node("Add", [last.outputs[0], nothing.outputs[0]])
        graph.extend([t, scores, probs, y, nothing, out])
        old = last.outputs[0]
        new = out.outputs[0]
        new.shape, new.type = old.shape, old.type
        old.name, new.name = "out_before_c", "out"  # the model's output keeps its name
        graph.outputs[0] = new
        return PassResult(model, True, counts={"nodes_added": 6})


@pytest.fixture(scope="module")
def quadratic_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quadratic") / "quadratic.onnx"
    onnx.save(_quadratic_model(), path)
    return path


@dataclasses.dataclass
class _Tie(Comparison):
    """The generated sets' comparison as a tie: not slower, whatever this host timed (it times them for real)."""

    @property
    def slower(self) -> bool:
        return False


def _tied(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The gate's comparisons, real; the one on the generated sets flagged a tie. Returns their modes."""
    real, modes = gate.compare, []

    def compare(*args, **kwargs):
        result = real(*args, **kwargs)
        modes.append(result.mode)
        if result.mode == "serving":
            return result
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.init}
        return _Tie(**{**fields, "tie": True})

    monkeypatch.setattr(gate, "compare", compare)
    return modes


def _job(model: Path, out: Path, the_pass: Pass, **settings: int) -> PipelineResult:
    settings = PipelineSettings(
        verify_shape_sets=2, benchmark_warmup=2, benchmark_min_runs=10, benchmark_max_seconds=1.0, ledger_runs=5,
        intra_op_threads=1, **settings,
    )  # fmt: skip
    request = PipelineRequest(
        model_path=model, output_dir=out, config=JobConfig(preset="fast"), settings=settings,
        pass_resolver=resolver(the_pass),
    )  # fmt: skip
    return run_pipeline(request)


def test_gate_keeps_a_tied_artifact_when_faster_at_the_serving_length(
    tmp_path: Path, quadratic_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    modes = _tied(monkeypatch)
    result = _job(quadratic_path, tmp_path, DropZeroBranch())
    report, decision = result.report, result.report["decision"]
    assert modes == ["full", "serving"]
    serving = decision["gate"]["serving"]
    assert serving["input_set"] == "input_ids=1x256 (serving length)"
    assert serving["verified"] is True and serving["faster"] is True and serving["speedup"] > 1.0
    assert decision["result"] == "optimized" and not decision["used_original"] and decision["gate"]["tie"]
    assert "at a serving length (input_ids=1x256 (serving length)) faster beyond noise" in decision["reason"]
    timed = report["benchmark"]["serving"]["shapes"][0]
    assert report["benchmark"]["serving"]["mode"] == "serving"
    # A fixed count of paired blocks answers "faster?": no early stop on "not slower", which the tie answered.
    assert timed["original"]["runs"] == timed["optimized"]["runs"] == gate.SERVING_BLOCKS
    assert result.model_path.read_bytes() != quadratic_path.read_bytes()
    assert "nothing" not in {n.output[0] for n in onnx.load(str(result.model_path)).graph.node}
    assert validate_report(report) == []


def test_gate_returns_the_upload_when_the_tied_artifact_is_no_faster_at_the_serving_length(
    tmp_path: Path, quadratic_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    modes = _tied(monkeypatch)
    result = _job(quadratic_path, tmp_path, AddZeroBranch())
    decision = result.report["decision"]
    assert modes == ["full", "serving"]
    assert decision["gate"]["serving"]["verified"] is True and decision["gate"]["serving"]["faster"] is False
    assert decision["result"] == "original" and decision["used_original"]
    assert "at a serving length (input_ids=1x256 (serving length)) not faster beyond noise" in decision["reason"]
    assert result.model_path.read_bytes() == quadratic_path.read_bytes()


def test_gate_returns_the_upload_on_a_tie_when_the_serving_length_is_off(
    tmp_path: Path, quadratic_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    modes = _tied(monkeypatch)
    result = _job(quadratic_path, tmp_path, DropZeroBranch(), gate_serving_length=0)
    decision = result.report["decision"]
    assert modes == ["full"] and "serving" not in decision["gate"]
    assert decision["result"] == "original" and "at a serving length" not in decision["reason"]


def test_job_goes_on_without_the_serving_look_when_the_set_cannot_be_made(
    tmp_path: Path, quadratic_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second look is optional: a model the synthesis cannot size at the serving length keeps its job."""
    from workers import pipeline

    def refuse(*args, **kwargs):
        raise ValueError("no such length")

    monkeypatch.setattr(pipeline, "serving_input_set", refuse)
    modes = _tied(monkeypatch)
    result = _job(quadratic_path, tmp_path, DropZeroBranch())
    decision = result.report["decision"]
    assert modes == ["full"] and "serving" not in decision["gate"]
    assert decision["result"] == "original" and decision["gate"]["tie"]


def _free_size_convnet() -> onnx.ModelProto:
    """pixel_values [batch, 3, height, width] -> conv a; out = pool(a + 0 * three more convs of a): an image model
    whose graph leaves the size free (a convnet as Optimum exports it), its costly branch quadratic in the side."""
    rng = np.random.default_rng(1)

    def weight(name: str, out: int, into: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal((out, into, 3, 3)) * 0.1).astype(np.float32), name)

    zero = numpy_helper.from_array(np.array([0.0], np.float32), "zero")
    nodes = [helper.make_node("Conv", ["pixel_values", "w0"], ["a"], pads=[1, 1, 1, 1])]
    source = "a"
    for i in range(1, 4):
        nodes.append(helper.make_node("Conv", [source, f"w{i}"], [f"b{i}"], pads=[1, 1, 1, 1]))
        source = f"b{i}"
    nodes += [
        helper.make_node("Mul", [source, "zero"], ["nothing"]),
        helper.make_node("Add", ["a", "nothing"], ["sum"]),
        helper.make_node("GlobalAveragePool", ["sum"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "convnet",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 8])],
        [weight("w0", 8, 3), *(weight(f"w{i}", 8, 8) for i in range(1, 4)), zero],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_gate_keeps_a_tied_image_artifact_when_faster_at_the_serving_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image model of free size gets its generated sets at 8-32 pixels, where the dropped branch costs little;
    the second look is one 224 x 224 image (``gate_serving_image_side``)."""
    path = tmp_path / "convnet.onnx"
    onnx.save(_free_size_convnet(), path)
    modes = _tied(monkeypatch)
    result = _job(path, tmp_path / "out", DropZeroBranch())
    decision = result.report["decision"]
    assert modes == ["full", "serving"]
    serving = decision["gate"]["serving"]
    assert serving["input_set"] == "pixel_values=1x3x224x224 (serving size)"
    assert serving["verified"] is True and serving["faster"] is True
    assert decision["result"] == "optimized" and decision["gate"]["tie"]
    assert "at a serving size (pixel_values=1x3x224x224 (serving size)) faster beyond noise" in decision["reason"]
    assert validate_report(result.report) == []


def test_gate_takes_no_image_look_when_the_serving_side_is_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "convnet.onnx"
    onnx.save(_free_size_convnet(), path)
    modes = _tied(monkeypatch)
    result = _job(path, tmp_path / "out", DropZeroBranch(), gate_serving_image_side=0)
    assert modes == ["full"] and "serving" not in result.report["decision"]["gate"]
