"""workers/model_check.py: the ONNX checker, accepting graph inputs and outputs with a type but no shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.models.build_hf import make_inputs
from workers.model_check import check_model, shapeless_io, unsorted_nodes

MODELS = Path(__file__).resolve().parents[1] / "models"


def _matmul_relu(y_shape: list | None, x_shape: list | None = ("batch", 4), op: str = "Relu") -> onnx.ModelProto:
    """x @ W -> op -> y, built as users build graphs by hand: ``make_tensor_value_info(name, type, shape)``."""
    weight = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node(op, ["m"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None if x_shape is None else list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _save(proto: onnx.ModelProto, path: Path) -> Path:
    onnx.save(proto, str(path))
    return path


def _job(path: Path, out: Path, preset: str):
    """A short job on ``path`` (two generated sets, brief timing) through the engine."""
    from core.config import JobConfig
    from core.settings import PipelineSettings
    from workers.pipeline import PipelineRequest, run_pipeline

    settings = PipelineSettings(
        verify_shape_sets=2, benchmark_warmup=1, benchmark_min_runs=5, benchmark_max_seconds=0.2, ledger_runs=5
    )
    config = JobConfig.parse({"preset": preset})
    return run_pipeline(PipelineRequest(model_path=path, output_dir=out, config=config, settings=settings))


def test_check_model_accepts_the_graph_when_its_output_has_a_type_but_no_shape(tmp_path):
    path = _save(_matmul_relu(y_shape=None), tmp_path / "model.onnx")
    with pytest.raises(onnx.checker.ValidationError, match="shape"):
        onnx.checker.check_model(str(path))  # what the engine ran before
    before = path.read_bytes()
    check_model(path)
    assert path.read_bytes() == before  # checked on a copy: the model is not changed
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 5):
        (y,) = session.run(None, {"x": np.ones((batch, 4), np.float32)})
        assert y.shape == (batch, 3)


def test_check_model_accepts_a_torch_export_when_its_io_shapes_are_dropped(tmp_path):
    """The tiny BERT encoder export with the shape of every graph input and output removed, as some tools
    write them: still checked in full, and ONNX Runtime runs it."""
    proto = onnx.load(str(MODELS / "hf_bert_encoder.onnx"))
    for value in (*proto.graph.input, *proto.graph.output):
        value.type.tensor_type.ClearField("shape")
    assert len(shapeless_io(proto)) == 4
    path = _save(proto, tmp_path / "model.onnx")
    check_model(path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (hidden,) = session.run(None, make_inputs("bert_encoder", 2, 7, pad_fraction=0.25, size="tiny"))
    assert hidden.shape == (2, 7, 32)


def test_check_model_accepts_the_graph_when_an_input_has_no_shape(tmp_path):
    check_model(_save(_matmul_relu(y_shape=["batch", 3], x_shape=None), tmp_path / "model.onnx"))


def test_check_model_refuses_when_an_output_has_no_type(tmp_path):
    proto = _matmul_relu(y_shape=None)
    proto.graph.output[0].ClearField("type")
    with pytest.raises(onnx.checker.ValidationError, match="type"):
        check_model(_save(proto, tmp_path / "model.onnx"))


def test_check_model_refuses_what_else_the_checker_refuses_when_an_output_is_shapeless(tmp_path):
    """A shapeless output waives only its shape: an unknown op in the same graph is still refused."""
    proto = _matmul_relu(y_shape=None, op="NoSuchOp")
    with pytest.raises(onnx.checker.ValidationError, match="NoSuchOp"):
        check_model(_save(proto, tmp_path / "model.onnx"))


def test_check_model_passes_when_every_shape_is_declared(tmp_path):
    path = _save(_matmul_relu(y_shape=["batch", 3]), tmp_path / "model.onnx")
    assert not shapeless_io(onnx.load(str(path)))
    check_model(path)


def test_pipeline_optimizes_the_model_when_its_outputs_carry_no_shape(tmp_path):
    """The issue-17 case end to end: an export whose graph outputs have a type but no shape went through no
    pass ("the model does not load or check"); the engine's check now takes it, and every pass after it too."""
    proto = onnx.load(str(MODELS / "hf_bert_encoder.onnx"))
    for value in proto.graph.output:
        value.type.tensor_type.ClearField("shape")
    result = _job(_save(proto, tmp_path / "model.onnx"), tmp_path / "out", "safe")
    assert result.report["verification"]["ok"] is True
    assert any(p["status"] == "applied" for p in result.report["passes"])
    assert not any("does not load or check" in str(p.get("reason")) for p in result.report["passes"])


def _reversed_nodes(proto: onnx.ModelProto) -> onnx.ModelProto:
    nodes = list(proto.graph.node)
    del proto.graph.node[:]
    proto.graph.node.extend(reversed(nodes))
    return proto


def test_check_model_accepts_nodes_out_of_topological_order_and_refuses_a_value_nothing_gives(tmp_path):
    """ORT sorts a graph on load; ONNX requires the nodes in order. Out of order is waived, a node reading a
    value that no input, initializer or node gives is still refused."""
    path = _save(_reversed_nodes(_matmul_relu(y_shape=["batch", 3])), tmp_path / "model.onnx")
    assert unsorted_nodes(onnx.load(str(path))) == 1
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(str(path))
    before = path.read_bytes()
    check_model(path)
    assert path.read_bytes() == before
    dangling = _matmul_relu(y_shape=["batch", 3])
    dangling.graph.node[1].input[0] = "nothing_gives_this"
    with pytest.raises(onnx.checker.ValidationError, match="nothing_gives_this"):
        check_model(_save(dangling, tmp_path / "dangling.onnx"))


def test_pipeline_optimizes_a_float16_conversion_whose_input_casts_come_last(tmp_path):
    """ORT's float16 converter with ``keep_io_types=True`` appends the graph inputs' Casts after the nodes that
    read them: the job was refused ("Nodes in a graph must be topologically sorted"); ORT runs that file. The
    engine now sorts the graph it works on, and the passes and the verification run."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    proto = onnx.load(str(MODELS / "corpus" / "vit_dynamo.onnx"))
    converted = convert_float_to_float16(proto, keep_io_types=True)
    assert unsorted_nodes(converted) > 0  # the converter's own output, unchanged
    result = _job(_save(converted, tmp_path / "model.onnx"), tmp_path / "out", "fast")
    assert result.report["verification"]["ok"] is True
    applied = {p["name"] for p in result.report["passes"] if p["status"] == "applied"}
    assert "fuse_transformer" in applied
    assert unsorted_nodes(onnx.load(str(result.model_path))) == 0 or result.report["decision"]["used_original"]


def test_a_map_typed_input_is_refused_with_what_to_send_instead(tmp_path):
    """onnx-ir has no map type: a map anywhere but a classifier's trailing ZipMap (which is taken off and put
    back: tests/workers/test_output_adapters.py) is refused up front, not with a SerdeError traceback."""
    from core.errors import InvalidModelError
    from workers.artifacts import load_checked

    features = helper.make_value_info(
        "features", helper.make_map_type_proto(TensorProto.STRING, helper.make_tensor_type_proto(TensorProto.FLOAT, []))
    )
    vector = helper.make_tensor_value_info("vector", TensorProto.FLOAT, [1, 2])
    graph = helper.make_graph(
        [
            helper.make_node(
                "DictVectorizer", ["features"], ["vector"], domain="ai.onnx.ml", string_vocabulary=["a", "b"]
            )
        ],
        "g",
        [features],
        [vector],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    path = _save(proto, tmp_path / "dictvectorizer.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.run(None, {"features": {"a": 1.0, "b": 2.0}})[0].tolist() == [[1.0, 2.0]]
    with pytest.raises(InvalidModelError) as caught:
        load_checked(path)
    assert caught.value.code == "UNSUPPORTED_MODEL"
    assert "input 'features' has a map type" in str(caught.value) and "DictVectorizer" in str(caught.value)
