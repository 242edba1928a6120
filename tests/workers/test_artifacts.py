"""workers/artifacts.py: stages and artifacts on disk, their side files, provenance, and the returned model."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import onnx_ir as ir

from core import model_files
from core.recipe import RECIPE_KEY
from passes._infra import Pass
from tests.workers.conftest import DropReluChain, Idle
from workers import artifacts


def _model(path: Path) -> ir.Model:
    return artifacts.load_ir(path)


def test_stamp_replaces_onnxforge_metadata_but_keeps_the_recipe_when_a_pass_wrote_one(mlp_path: Path) -> None:
    # setup
    model = _model(mlp_path)
    model.metadata_props.update({RECIPE_KEY: "{}", "onnxforge.job_id": "stale", "author": "team"})
    passes: list[Pass] = [DropReluChain(), Idle()]
    # execute
    artifacts.stamp(model, passes, artifacts.Provenance("ab" * 32, "fast", None))
    # assert
    props = dict(model.metadata_props)
    assert props[RECIPE_KEY] == "{}" and props["author"] == "team"
    assert "onnxforge.job_id" not in props  # no job id given: the stale one is gone
    assert props["onnxforge.preset"] == "fast" and props["onnxforge.source_sha256"] == "ab" * 32
    assert [p["name"] for p in json.loads(props["onnxforge.passes"])] == ["test_drop_relu_chain", "test_idle"]


def test_write_side_files_removes_stale_suffixes_when_rewriting_a_stage(tmp_path: Path) -> None:
    # setup
    stage = tmp_path / "stage.onnx"
    artifacts.write_side_files(stage, {".onnx_adapter": b"old", ".extra": b"gone"})
    # execute
    artifacts.write_side_files(stage, {".onnx_adapter": b"new"}, stale={".onnx_adapter", ".extra"})
    # assert
    assert artifacts.read_side_files(stage, [".onnx_adapter", ".extra"]) == {".onnx_adapter": b"new"}


def test_place_copies_artifact_and_side_files_when_the_optimized_model_is_returned(
    tmp_path: Path, mlp_path: Path
) -> None:
    # setup
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (out / "model.onnx_adapter").write_bytes(b"from an earlier attempt")
    provenance = artifacts.Provenance("0" * 64, None, "job")
    artifact = artifacts.write_stamped(
        _model(mlp_path), [], provenance, work / "artifact.onnx", {".onnx_adapter": b"A"}
    )
    # execute
    final, external, side = artifacts.place(
        use_original=False,
        artifact=artifact,
        source=mlp_path,
        source_external=[],
        output_dir=out,
        side_suffixes=[".onnx_adapter"],
    )
    # assert
    assert final == out / "model.onnx" and final.read_bytes() == artifact.read_bytes()
    assert external == [] and side == [out / "model.onnx_adapter"] and side[0].read_bytes() == b"A"
    assert not list(out.glob(".*.tmp"))  # copied under a temporary name, then renamed


def test_place_hands_back_external_weights_as_model_onnx_data_when_the_artifact_is_over_the_threshold(
    tmp_path: Path, mlp_path: Path, monkeypatch
) -> None:
    """A model over the protobuf limit is written as artifact.onnx + artifact.onnx.data and handed back as
    model.onnx + model.onnx.data: the returned model must name the file it is handed back with."""
    # setup
    monkeypatch.setattr(model_files, "PROTOBUF_SAFE_BYTES", 0)
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    provenance = artifacts.Provenance("0" * 64, None, "job")
    artifact = artifacts.write_stamped(_model(mlp_path), [], provenance, work / "artifact.onnx", {})
    assert (work / "artifact.onnx.data").exists()
    # execute
    final, external, _side = artifacts.place(
        use_original=False,
        artifact=artifact,
        source=mlp_path,
        source_external=[],
        output_dir=out,
        side_suffixes=[],
    )
    # assert
    assert external == [out / "model.onnx.data"] and artifacts.external_files(final) == ["model.onnx.data"]
    returned, original = onnx.load(str(final)), onnx.load(str(mlp_path))
    assert [onnx.numpy_helper.to_array(t).tolist() for t in returned.graph.initializer] == [
        onnx.numpy_helper.to_array(t).tolist() for t in original.graph.initializer
    ]
    assert not list(out.glob(".*.tmp"))


def test_place_returns_the_upload_byte_for_byte_and_drops_side_files_when_the_original_is_used(
    tmp_path: Path, mlp_path: Path
) -> None:
    # setup
    source = tmp_path / "in" / "net.onnx"
    source.parent.mkdir()
    onnx.save(onnx.load(str(mlp_path)), str(source), save_as_external_data=True, location="net.bin", size_threshold=0)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx_adapter").write_bytes(b"left over")
    # execute
    final, external, side = artifacts.place(
        use_original=True,
        artifact=source,
        source=source,
        source_external=artifacts.external_files(source),
        output_dir=out,
        side_suffixes=[".onnx_adapter"],
    )
    # assert
    assert final.read_bytes() == source.read_bytes() and side == []
    assert external == [out / "net.bin"] and external[0].read_bytes() == (source.parent / "net.bin").read_bytes()
    assert not (out / "model.onnx_adapter").exists()


def test_lost_axes_names_each_axis_when_a_model_freezes_a_dynamic_one(tmp_path: Path, mlp_path: Path) -> None:
    # setup
    expected = artifacts.dynamic_axes(mlp_path)
    model = _model(mlp_path)
    value = model.graph.inputs[0]
    assert value.shape is not None
    value.shape = ir.Shape([3 if not isinstance(d, int) else d for d in value.shape])
    frozen = tmp_path / "frozen.onnx"
    artifacts.save_ir(model, frozen)
    # execute
    lost = artifacts.lost_axes(expected, frozen)
    # assert
    key = f"input:{value.name}"
    assert lost == [f"{key} axis {axis}" for axis in sorted(expected[key])]
    assert artifacts.lost_axes(expected, mlp_path) == []
