"""workers/ledger.py: the input sets a pass declares (``PassResult.verify_inputs``) outlive an input change and are
listed in the report.

A pass may hand the engine sets the job's own do not reach (fuse_gqa: a cache at a sliding window's edge); every
later stage is verified on them. When a later pass changes the model's inputs (``changes_inputs``), the job's own
sets give way to that pass's raw inputs and the reference becomes its model: the declared sets go on where that
model can run them (fed by input name), and where it cannot, the report says which were dropped and why. Either
way the report's ``input_sets`` lists them with the pass that declared them, why, their shapes and whether the
reference ran them. The passes below are TEST-ONLY, on a model built here: ``y = 2 * x`` over ``x[batch,
sequence]``, plus an input ``unused`` that no node reads (some exports keep such inputs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.config import EXACT_TOLERANCE, JobConfig
from core.inputs import make_input_sets
from core.settings import PipelineSettings
from passes._infra import InputChange, Pass, PassContext, PassOptions, PassResult
from tests.workers.conftest import resolver
from workers.ledger_parts import pass_sets
from workers.pipeline import PipelineRequest, run_pipeline
from workers.report import validate_report
from workers.verify import Verifier

ODD = "test odd length: 1x7"  # the job's generated sequences are 8, 16, ...: none is odd
WRONG_RANK = "test wrong rank"


def _model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Identity", ["x"], ["h"], name="copy"),
        helper.make_node("Mul", ["h", "two"], ["y"], name="double"),
    ]
    graph = helper.make_graph(
        nodes,
        "doubler",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence"]),
            helper.make_tensor_value_info("unused", TensorProto.FLOAT, ["batch"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence"])],
        initializer=[numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


class DeclareOptions(PassOptions):
    declare: bool = True


class DropIdentityAndDeclare(Pass[DeclareOptions]):
    """GOOD and exact: drops the Identity; declares an odd sequence length (which the job's sets miss) and a set
    of the wrong rank (which the original refuses)."""

    name = "test_declare_sets"
    summary = "test only: an exact rewrite that hands the engine two more input sets"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        node = next(n for n in model.graph if n.op_type == "Identity")
        ir.convenience.replace_all_uses_with(node.outputs[0], node.inputs[0])
        model.graph.remove(node, safe=True)
        rng = np.random.default_rng(1)
        declared = {
            ODD: {"x": rng.standard_normal((1, 7)).astype(np.float32), "unused": np.zeros(1, np.float32)},
            WRONG_RANK: {"x": np.ones((1, 2, 3), np.float32), "unused": np.zeros(1, np.float32)},
        }
        return PassResult(model, True, {"nodes_removed": 1}, verify_inputs=declared if self.options.declare else {})


class ChangeOptions(PassOptions):
    how: str = "drop_unused"  # drop_unused | rename | fix_length


class ChangeInputs(Pass[ChangeOptions]):
    """An input change (``changes_inputs``) that verifies itself, as the contract asks: ``drop_unused`` removes
    the input no node reads; ``rename`` calls ``x`` ``features``; ``fix_length`` makes the sequence 8 long."""

    name = "test_change_inputs"
    summary = "test only: replaces the model's inputs"
    exact = False
    changes_inputs = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        original = ir.serde.serialize_model(model).SerializeToString()
        graph, how = model.graph, self.options.how
        x = next(v for v in graph.inputs if v.name == "x")
        if how == "drop_unused":
            graph.inputs.remove(next(v for v in graph.inputs if v.name == "unused"))
        elif how == "rename":
            x.name = "features"
        else:
            x.shape = ir.Shape([x.shape[0], 8])
        rng = np.random.default_rng(2)
        raw = [{x.name: rng.standard_normal(shape).astype(np.float32)} for shape in ((2, 8), (1, 8))]
        if how != "drop_unused":
            raw = [{**feeds, "unused": np.zeros(len(feeds[x.name]), np.float32)} for feeds in raw]
        ours = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString())
        theirs = ort.InferenceSession(original)
        worst = 0.0
        for feeds in raw:
            before = {"x": feeds[x.name], "unused": np.zeros(len(feeds[x.name]), np.float32)}
            diff = np.abs(ours.run(None, feeds)[0] - theirs.run(None, before)[0])
            worst = max(worst, float(diff.max()))
        assert worst == 0.0, worst  # raises a PassError through Pass.__call__
        inputs = [{"name": v.name, "dtype": "float32"} for v in graph.inputs]
        return PassResult(model, True, inputs_changed=InputChange(inputs, raw, len(raw), max_abs=worst))


class WrongOnOddLengths(Pass):
    """WRONG, only where the sequence is odd: adds ``sequence % 2`` to the output (0 on every even length)."""

    name = "test_wrong_on_odd_lengths"
    summary = "test only: computes something else on odd sequence lengths"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        graph = model.graph
        x, y = graph.inputs[0], graph.outputs[0]
        two = ir.Value(name="test/two_i64", const_value=ir.tensor(np.array([2], np.int64)))
        graph.register_initializer(two)
        shape = ir.node("Shape", [x], attributes={"start": 1, "end": 2})
        odd = ir.node("Mod", [shape.outputs[0], two])
        as_float = ir.node("Cast", [odd.outputs[0]], attributes={"to": ir.DataType.FLOAT})
        out = ir.Value(name=y.name, type=y.type, shape=y.shape)
        y.name = "test/y_before"
        add = ir.node("Add", [y, as_float.outputs[0]], outputs=[out])
        for node in (shape, odd, as_float, add):
            graph.append(node)
        graph.outputs[0] = out
        return PassResult(model, True, {"nodes_added": 4})


def _job(tmp_path: Path, *passes: Pass) -> dict[str, Any]:
    path = tmp_path / "doubler.onnx"
    onnx.save(_model(), str(path))
    settings = PipelineSettings(
        verify_shape_sets=2, benchmark_warmup=1, benchmark_min_runs=5, benchmark_max_seconds=0.1, ledger_runs=5,
        intra_op_threads=1,
    )  # fmt: skip
    config = JobConfig(rollback_slower=False, benchmark=False)
    request = PipelineRequest(path, tmp_path / "out", config, settings, pass_resolver=resolver(*passes))
    report = run_pipeline(request).report
    assert validate_report(report) == []
    return report


def _sets(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in report["input_sets"]}


def _records(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in report["passes"]}


@pytest.mark.parametrize("declare", [True, False])
def test_a_later_pass_wrong_only_on_a_declared_set_is_rolled_back_after_an_input_change(
    declare: bool, tmp_path: Path
) -> None:
    # execute
    report = _job(tmp_path, DropIdentityAndDeclare({"declare": declare}), ChangeInputs(), WrongOnOddLengths())
    # assert: the job's own sets and the change's raw ones are all even, so only the declared set catches the bug
    records, sets = _records(report), _sets(report)
    assert all(s["shapes"]["x"][1] % 2 == 0 for s in report["input_sets"] if s["origin"] != "pass")
    assert records["test_declare_sets"]["status"] == records["test_change_inputs"]["status"] == "applied"
    wrong = records["test_wrong_on_odd_lengths"]
    carried = f"{ODD} (after test_change_inputs)"
    if not declare:  # verified within tolerance (the gate may still refuse its four extra nodes as slower)
        assert wrong["verification"]["ok"] is True, wrong["reason"]
        assert not any(s["origin"] == "pass" for s in report["input_sets"])
        return
    assert wrong["status"] == "rolled_back" and wrong["verification"]["ok"] is False, wrong["reason"]
    assert wrong["reason"].startswith(f"broke tolerance: output 'y' on {carried}"), wrong["reason"]
    # the report lists the declared sets: who, why, shapes, whether the original ran them, what the change did
    odd = sets[ODD]
    assert (odd["origin"], odd["shapes"]) == ("pass", {"x": [1, 7], "unused": [1]})
    assert odd["inputs"]["pass"] == "test_declare_sets" and "verify_inputs" in odd["inputs"]["why"]
    assert (odd["inputs"]["reference"], odd["inputs"]["accepted"]) == ("original", True)
    change = odd["inputs"]["after_input_change"]
    assert (change["by"], change["carried"]) == ("test_change_inputs", True)
    assert "without unused" in change["why"], change["why"]
    copy = sets[carried]
    assert (copy["origin"], copy["shapes"], copy["inputs"]["carried_from"]) == ("pass", {"x": [1, 7]}, ODD)
    assert (copy["inputs"]["reference"], copy["inputs"]["accepted"]) == ("the model after test_change_inputs", True)
    refused = sets[WRONG_RANK]
    assert (refused["shapes"]["x"], refused["inputs"]["accepted"]) == ([1, 2, 3], False)
    assert "after_input_change" not in refused["inputs"] and refused["inputs"]["error"]
    assert list(records["test_declare_sets"]["notes"]["verify_inputs_refused_by_the_original"]) == [WRONG_RANK]
    assert records["test_change_inputs"]["notes"]["verify_inputs_carried"] == [carried]
    # the model handed back was verified on the carried set too
    assert carried in {o["input_set"] for o in report["verification"]["outputs"]}


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("rename", "the model after test_change_inputs takes features, which this set has no value for"),
        ("fix_length", "the model after test_change_inputs refuses it: "),
    ],
)
def test_a_declared_set_the_input_change_leaves_no_way_to_feed_is_dropped_and_the_report_says_why(
    how: str, why: str, tmp_path: Path
) -> None:
    # execute
    report = _job(tmp_path, DropIdentityAndDeclare(), ChangeInputs({"how": how}))
    # assert
    records, sets = _records(report), _sets(report)
    assert records["test_change_inputs"]["status"] == "applied", records["test_change_inputs"]["reason"]
    change = sets[ODD]["inputs"]["after_input_change"]
    assert (change["by"], change["carried"]) == ("test_change_inputs", False)
    assert change["why"].startswith(f"dropped: {why}"), change["why"]
    notes = records["test_change_inputs"]["notes"]
    assert notes["verify_inputs_carried"] == [] and notes["verify_inputs_dropped"] == {ODD: change["why"]}
    assert not any(s["inputs"].get("carried_from") for s in report["input_sets"] if s["origin"] == "pass")
    assert ODD not in {o["input_set"] for o in report["verification"]["outputs"]}


def test_declared_sets_are_listed_once_when_their_pass_runs_again_alone_and_the_html_says_who_declared_them(
    tmp_path: Path,
) -> None:
    # execute: both passes are exact, so they form one group, which fails on the odd set; each then runs alone
    report = _job(tmp_path, DropIdentityAndDeclare(), WrongOnOddLengths())
    # assert
    records = _records(report)
    assert records["test_declare_sets"]["status"] == "applied", records["test_declare_sets"]["reason"]
    wrong = records["test_wrong_on_odd_lengths"]
    assert wrong["status"] == "rolled_back" and f"on {ODD}" in wrong["reason"], wrong["reason"]
    assert "(run alone: the group test_declare_sets + test_wrong_on_odd_lengths" in wrong["reason"]
    names = [s["name"] for s in report["input_sets"]]
    assert len(names) == len(set(names)) and {ODD, WRONG_RANK} <= set(names)
    html = (tmp_path / "out" / "report.html").read_text()
    assert "declared by test_declare_sets; the original ran it" in html
    assert "declared by test_declare_sets; the original refused it (" in html


def test_a_declared_set_named_as_a_set_the_verifier_holds_is_listed_as_not_run(tmp_path: Path) -> None:
    # setup: the verifier holds the job's own set and one test_declare_sets declared
    path = tmp_path / "doubler.onnx"
    onnx.save(_model(), str(path))
    job = make_input_sets(onnx.load(str(path)), count=1)
    verifier = Verifier(path, job, EXACT_TOLERANCE)
    feeds = {"x": np.ones((1, 3), np.float32), "unused": np.zeros(1, np.float32)}
    pass_sets({"edge": feeds}, "test_declare_sets", "original", verifier)
    # execute
    taken = pass_sets({job[0].name: feeds, "edge": feeds, "new": feeds}, "other_pass", "original", verifier)
    # assert: only the new name is run; the others say whose set holds their name
    by_name = {s.name: s.provenance for s in taken}
    assert by_name["new"]["accepted"] is True and "error" not in by_name["new"]
    assert by_name[job[0].name]["error"] == "not run: the name is taken by a set of the job"
    assert by_name["edge"]["error"] == "not run: the name is taken by a set test_declare_sets declared"
    assert [s.name for s in verifier.input_sets] == [job[0].name, "edge", "new"]
