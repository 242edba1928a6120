"""workers/same_program.py and the gate's use of it: two models ORT turns into the same graph are the same
program, handed back untimed; one attribute or one weight apart, they are timed as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.config import JobConfig
from core.settings import PipelineSettings
from tests.workers.conftest import resolver
from tests.workers.test_pipeline_time import DocString, OneUlp
from workers.pipeline import PipelineRequest, PipelineResult, run_pipeline
from workers.report import validate_report
from workers.same_program import NotProvable, program_digest, same_program


def _cnn(
    *, alpha: float = 0.1, bias_shift: float = 0.0, reverse: bool = False, prefix: str = "", seed: int = 0
) -> onnx.ModelProto:
    """Conv -> LeakyRelu -> Conv -> Add(residual) -> GlobalAveragePool -> Flatten: a ResNet block in small."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((3, 4, 3, 3)).astype(np.float32)
    b2 = rng.standard_normal(3).astype(np.float32) + np.float32(bias_shift)
    p = prefix
    nodes = [
        helper.make_node("Conv", ["x", f"{p}w1"], [f"{p}c1"], name=f"{p}conv1", pads=[1, 1, 1, 1]),
        helper.make_node("LeakyRelu", [f"{p}c1"], [f"{p}r1"], name=f"{p}act", alpha=alpha),
        helper.make_node("Conv", [f"{p}r1", f"{p}w2", f"{p}b2"], [f"{p}c2"], name=f"{p}conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", [f"{p}c2", "x"], [f"{p}s"], name=f"{p}residual"),
        helper.make_node("GlobalAveragePool", [f"{p}s"], [f"{p}g"], name=f"{p}pool"),
        helper.make_node("Flatten", [f"{p}g"], ["y"], name=f"{p}flatten"),
    ]
    inits = [
        numpy_helper.from_array(w1, f"{p}w1"),
        numpy_helper.from_array(w2, f"{p}w2"),
        numpy_helper.from_array(b2, f"{p}b2"),
    ]
    graph = helper.make_graph(
        nodes[::-1] if reverse else nodes,  # reversed: no longer in topological order in the file
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        inits[::-1] if reverse else inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_program_digest_is_equal_when_only_names_order_and_doc_strings_differ() -> None:
    base = _cnn()
    other = _cnn(reverse=True, prefix="renamed_")
    other.graph.doc_string = "documented"
    other.graph.node[0].doc_string = "a node doc string"
    other.graph.value_info.append(helper.make_tensor_value_info("renamed_c1", TensorProto.FLOAT, ["n", 4, 8, 8]))
    assert program_digest(base) == program_digest(other)


def test_program_digest_ignores_an_opset_no_node_uses_and_the_names_of_free_axes() -> None:
    """What a clean-up pass leaves different and no kernel choice reads: the unused ``ai.onnx.ml`` import of an
    skl2onnx classifier it dropped, and the ``unk__0`` names ORT's shape inference gives unnamed axes."""
    base = _cnn()
    base.opset_import.append(helper.make_opsetid("ai.onnx.ml", 1))
    base.graph.input[0].type.tensor_type.shape.dim[0].ClearField("dim_param")  # unnamed
    other = _cnn()
    other.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "unk__0"
    assert program_digest(base) == program_digest(other)
    fixed = _cnn()
    fixed.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1  # a fixed axis is another interface
    assert program_digest(fixed) != program_digest(other)
    newer = _cnn()
    newer.opset_import[0].version = 18  # the version of an opset the nodes use still counts
    assert program_digest(newer) != program_digest(other)
    spelled = _cnn()
    spelled.opset_import[0].domain, spelled.opset_import[0].version = "ai.onnx", 18  # the nodes' "" by its name
    assert program_digest(spelled) == program_digest(newer) != program_digest(other)


def test_program_digest_differs_when_one_attribute_differs() -> None:
    assert program_digest(_cnn(alpha=0.1)) != program_digest(_cnn(alpha=0.2))


def test_program_digest_differs_when_one_initializer_value_differs() -> None:
    base, other = _cnn(), _cnn()
    b2 = numpy_helper.to_array(other.graph.initializer[2]).copy()
    b2[0] = np.nextafter(b2[0], np.float32(np.inf))
    other.graph.initializer[2].CopyFrom(numpy_helper.from_array(b2, other.graph.initializer[2].name))
    assert program_digest(base) != program_digest(other)


def test_program_digest_differs_when_two_nodes_swap_their_inputs() -> None:
    base, other = _cnn(), _cnn()
    add = other.graph.node[3]
    add.input[0], add.input[1] = add.input[1], add.input[0]  # same value for Add, another program all the same
    assert program_digest(base) != program_digest(other)


def test_program_digest_is_not_provable_when_a_node_holds_a_subgraph() -> None:
    model = _cnn()
    branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["z"])], "b", [], [helper.make_value_info("z", onnx.TypeProto())]
    )
    model.graph.node.append(helper.make_node("If", ["cond"], ["unused"], then_branch=branch, else_branch=branch))
    model.graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    with pytest.raises(NotProvable):
        program_digest(model)


def test_same_program_is_true_when_ort_folds_what_differs_and_false_for_one_weight(tmp_path: Path) -> None:
    """Through ORT: the same model renamed and reordered is the same program; one bias apart is not; session
    options on the artifact make another session, never proven."""
    upload, renamed, moved = tmp_path / "upload.onnx", tmp_path / "renamed.onnx", tmp_path / "moved.onnx"
    onnx.save(_cnn(), upload)
    onnx.save(_cnn(reverse=True, prefix="r_"), renamed)
    onnx.save(_cnn(bias_shift=1e-3), moved)
    same = same_program(upload, renamed, target="cpu", intra_op_threads=1)
    assert same["same"] is True and same["reason"] == "equal optimized graphs"
    differs = same_program(upload, moved, target="cpu", intra_op_threads=1)
    assert differs["same"] is False and differs["reason"] == "the optimized graphs differ"
    tuned = same_program(upload, renamed, target="cpu", intra_op_threads=1, recipe_b={"intra_op_num_threads": 2})
    assert tuned["same"] is False  # session options on the artifact: another session, timed


def _job(model: Path, out: Path, *passes, preset: str | None = "fast") -> PipelineResult:
    settings = PipelineSettings(
        verify_shape_sets=2, benchmark_warmup=1, benchmark_min_runs=10, benchmark_max_seconds=0.5, ledger_runs=5,
        intra_op_threads=1,
    )  # fmt: skip
    config = JobConfig(preset=preset) if preset else JobConfig()
    return run_pipeline(PipelineRequest(model, out, config, settings, pass_resolver=resolver(*passes)))


@pytest.fixture(scope="module")
def cnn_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cnn") / "cnn.onnx"
    onnx.save(_cnn(), path)
    return path


def test_gate_hands_back_the_artifact_untimed_when_ort_runs_the_same_program(tmp_path: Path, cnn_path: Path) -> None:
    """A pass that changes bytes only (a doc string): the gate proves sameness, times nothing, and the job
    hands back the artifact; the report's baseline times the upload alone."""
    result = _job(cnn_path, tmp_path, DocString())
    report, decision = result.report, result.report["decision"]
    assert validate_report(report) == []
    assert decision["result"] == "optimized" and decision["used_original"] is False
    assert decision["gate"]["same_program"] is True and decision["gate"]["slower"] is None
    assert decision["gate"]["benchmark_mode"] is None and "tie" not in decision["gate"]
    assert "same program" in decision["reason"] and "not timed" in decision["reason"]
    assert report["benchmark"] is None
    assert report["baseline"]["timed_by"] == "alone"
    handed_back = onnx.load(str(result.model_path))
    assert handed_back.graph.doc_string == "documented by a test pass"


def test_gate_still_times_the_artifact_when_one_weight_differs(tmp_path: Path, cnn_path: Path) -> None:
    result = _job(cnn_path, tmp_path, OneUlp(), preset=None)
    report, decision = result.report, result.report["decision"]
    assert validate_report(report) == []
    assert decision["gate"]["same_program"] is False
    assert decision["gate"]["benchmark_mode"] == "full" and report["benchmark"] is not None
    assert decision["gate"]["slower"] is not None


def test_fast_job_on_a_cnn_hands_back_the_artifact_untimed_when_its_passes_only_do_what_ort_does(
    tmp_path: Path, cnn_path: Path
) -> None:
    """The ResNet case (docs/coverage.md): the real ``fast`` preset only infers shapes on a plain CNN, which ORT's
    session optimizer makes no difference of; the gate proves it instead of timing a tie."""
    settings = PipelineSettings(verify_shape_sets=2, benchmark_warmup=1, ledger_runs=5, intra_op_threads=1)
    result = run_pipeline(PipelineRequest(cnn_path, tmp_path, JobConfig(preset="fast"), settings))
    report, decision = result.report, result.report["decision"]
    assert validate_report(report) == []
    applied = [p["name"] for p in report["passes"] if p["status"] == "applied"]
    assert applied == ["shape_inference"]
    assert decision["result"] == "optimized" and decision["gate"]["same_program"] is True
    assert report["benchmark"] is None and report["baseline"]["timed_by"] == "alone"
    assert result.model_path.read_bytes() != cnn_path.read_bytes()  # the artifact (with its shapes) came back


def test_program_digest_differs_when_a_node_fills_an_optional_output_no_one_reads() -> None:
    """MaxPool's Indices, asked for or not: the kernel computes them or not, so another program."""

    def pool(with_indices: bool) -> onnx.ModelProto:
        outputs = ["y", "idx"] if with_indices else ["y"]
        node = helper.make_node("MaxPool", ["x"], outputs, kernel_shape=[2, 2])
        graph = helper.make_graph(
            [node],
            "pool",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 7, 7])],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    assert program_digest(pool(False)) != program_digest(pool(True))
    assert program_digest(pool(True)) == program_digest(pool(True))


def _attention(*, fused: bool) -> onnx.ModelProto:
    """q, k, v [B, S, 8] -> attention over 2 heads: com.microsoft::MultiHeadAttention, or (unfused) a plain Add
    standing in for the ONNX ops ORT's CPU session turns into no MultiHeadAttention."""
    names = ["q", "k", "v"]
    if fused:
        node = helper.make_node("MultiHeadAttention", names, ["y"], domain="com.microsoft", num_heads=2)
        nodes = [node]
    else:
        nodes = [helper.make_node("Add", ["q", "k"], ["s"]), helper.make_node("Add", ["s", "v"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "attention",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", 8]) for n in names],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 8])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def test_same_program_says_differ_without_building_the_artifact_when_it_holds_an_attention_ort_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The artifact holds a MultiHeadAttention that ORT's CPU session neither builds for the reference nor
    removes: the graphs differ, said from the reference's optimized graph and the artifact as written."""
    from workers import same_program as module

    upload, fused = tmp_path / "upload.onnx", tmp_path / "fused.onnx"
    onnx.save(_attention(fused=False), upload)
    onnx.save(_attention(fused=True), fused)
    built: list[str] = []
    real = module.make_session

    def counting(path: Path, *args: object, **kwargs: object) -> object:
        built.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(module, "make_session", counting)
    answer = same_program(upload, fused, target="cpu", intra_op_threads=1)
    assert answer["same"] is False
    assert "com.microsoft::MultiHeadAttention" in answer["reason"] and "keeps" in answer["reason"]
    assert built == ["upload.onnx"]  # the artifact's session was never built
    # The full proof agrees: ORT's optimized graph of the artifact keeps the node, and the digests differ.
    assert ("com.microsoft", "MultiHeadAttention") in module.optimized_ops(fused, target="cpu", intra_op_threads=1)
    cpu = {"target": "cpu", "intra_op_threads": 1}
    assert module.optimized_digest(fused, **cpu) != module.optimized_digest(upload, **cpu)  # type: ignore[arg-type]
