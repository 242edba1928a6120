"""workers/verify.py: input generation by role, samples validation, per-output comparison."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from core.config import Tolerance
from core.errors import InvalidInputError, UnavailableError
from core.inputs import IGNORE_INDEX, generate_input_sets, graph_inputs, index_ranges, load_samples, make_input_sets
from tests.workers.conftest import make_bert_like
from workers.verify import Verifier, compare_output

TOL = Tolerance()


def test_index_ranges_finds_embedding_size_when_ids_feed_a_gather_on_an_initializer() -> None:
    assert index_ranges(make_bert_like(vocab=37)) == {"input_ids": 37, "token_type_ids": 2}


def test_generate_input_sets_gives_in_range_ids_and_right_padded_masks_when_graph_is_bert_like() -> None:
    model = make_bert_like(vocab=50)
    sets = generate_input_sets(model, 3, seed=1)
    assert [s.feeds["input_ids"].shape for s in sets] == [(1, 8), (2, 16), (4, 32)]
    for s in sets:
        ids, mask, types = s.feeds["input_ids"], s.feeds["attention_mask"], s.feeds["token_type_ids"]
        assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 50
        assert mask.shape == ids.shape == types.shape  # one binding per symbolic dim
        assert set(np.unique(types)) <= {0, 1}
        for row in mask:
            valid = int(row.sum())
            assert valid >= 1
            assert row[:valid].all() and not row[valid:].any()  # ones, then zeros: right padding
        assert mask[0].all()
    # The generated inputs actually run on the original.
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess.run(None, sets[2].feeds)


def test_generate_input_sets_is_deterministic_when_seed_is_fixed() -> None:
    model = make_bert_like()
    a, b = generate_input_sets(model, 2, seed=7), generate_input_sets(model, 2, seed=7)
    for x, y in zip(a, b, strict=True):
        assert all(np.array_equal(x.feeds[k], y.feeds[k]) for k in x.feeds)


def test_generate_input_sets_gives_labels_with_ignore_index_when_graph_has_labels_input() -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["labels"], ["out"])],
        "labels",
        [helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("out", TensorProto.INT64, ["batch", "sequence"])],
    )
    labels = generate_input_sets(helper.make_model(graph), 3)[2].feeds["labels"]
    assert (labels == IGNORE_INDEX).any()
    assert labels[labels != IGNORE_INDEX].min() >= 0


def test_make_input_sets_uses_config_shapes_when_given(mlp_path: Path) -> None:
    model = onnx.load(str(mlp_path))
    sets = make_input_sets(model, count=3, shapes=[{"x": [5, 16]}, {"x": [7, 16]}])
    assert [s.feeds["x"].shape for s in sets] == [(5, 16), (7, 16)]


def test_make_input_sets_raises_shapes_invalid_when_rank_or_static_dim_is_wrong(mlp_path: Path) -> None:
    model = onnx.load(str(mlp_path))
    for bad in ({"x": [5]}, {"x": [5, 3]}, {"nope": [1, 16]}):
        with pytest.raises(InvalidInputError) as info:
            make_input_sets(model, count=1, shapes=[bad])
        assert info.value.code == "SHAPES_INVALID"


def test_load_samples_returns_the_arrays_when_they_match_the_graph(tmp_path: Path, mlp_path: Path) -> None:
    path = tmp_path / "samples.npz"
    x = np.ones((3, 16), np.float32)
    np.savez(path, x=x)
    loaded = load_samples(path, onnx.load(str(mlp_path)))
    assert loaded.name == "samples" and np.array_equal(loaded.feeds["x"], x)


@pytest.mark.parametrize(
    "arrays",
    [
        {"x": np.ones((3, 16), np.float64)},  # dtype
        {"x": np.ones((3, 16, 1), np.float32)},  # rank
        {"x": np.ones((3, 15), np.float32)},  # static dim
        {"y": np.ones((3, 16), np.float32)},  # name
        {"x": np.ones((3, 16), np.float32), "extra": np.ones(1)},
    ],
)
def test_load_samples_raises_samples_invalid_when_names_dtypes_or_ranks_differ(
    tmp_path: Path, mlp_path: Path, arrays: dict[str, np.ndarray]
) -> None:
    path = tmp_path / "samples.npz"
    np.savez(path, **arrays)
    with pytest.raises(InvalidInputError) as info:
        load_samples(path, onnx.load(str(mlp_path)))
    assert info.value.code == "SAMPLES_INVALID"


def test_load_samples_raises_samples_invalid_when_file_is_not_an_npz(tmp_path: Path, mlp_path: Path) -> None:
    path = tmp_path / "samples.npz"
    path.write_bytes(b"not a zip")
    with pytest.raises(InvalidInputError) as info:
        load_samples(path, onnx.load(str(mlp_path)))
    assert info.value.code == "SAMPLES_INVALID"


def test_compare_output_counts_mismatches_when_values_drift() -> None:
    ref = np.linspace(-1, 1, 100, dtype=np.float32)
    got = ref.copy()
    got[:3] += 0.5
    stats = compare_output("s", "y", ref, got, TOL)
    assert not stats.ok and stats.mismatches == 3
    assert stats.max_abs == pytest.approx(0.5, rel=1e-6)
    assert "3/100" in (stats.reason or "")


def test_compare_output_compares_string_labels_by_equality() -> None:
    # A scikit-learn classifier fitted on string classes outputs its labels as strings: the comparison raised
    # "could not convert string to float" and failed the job.
    ref = np.array(["low", "mid", "high", "mid"], dtype=object)
    assert compare_output("s", "label", ref, ref.copy(), TOL).ok
    got = ref.copy()
    got[1] = "low"
    stats = compare_output("s", "label", ref, got, TOL)
    assert not stats.ok and stats.mismatches == 1 and "1/4 elements differ" in (stats.reason or "")


def test_compare_output_passes_when_mismatch_ratio_is_allowed() -> None:
    ref = np.linspace(1, 2, 100, dtype=np.float32)
    got = ref.copy()
    got[0] += 0.01
    assert compare_output("s", "y", ref, got, Tolerance(max_mismatch_ratio=0.05)).ok


def test_compare_output_fails_when_shape_dtype_or_nan_count_differs() -> None:
    ref = np.ones((2, 3), np.float32)
    assert "shape" in (compare_output("s", "y", ref, np.ones((3, 2), np.float32), TOL).reason or "")
    assert "dtype" in (compare_output("s", "y", ref, ref.astype(np.float16), TOL).reason or "")
    got = ref.copy()
    got[0, 0] = np.nan
    stats = compare_output("s", "y", ref, got, TOL)
    assert not stats.ok and stats.nan_got == 1 and stats.nan_ref == 0


def test_compare_output_accepts_matching_nans_when_reference_has_them() -> None:
    ref = np.array([1.0, np.nan, np.inf], np.float32)
    stats = compare_output("s", "y", ref, ref.copy(), TOL)
    assert stats.ok and stats.nan_ref == stats.nan_got == 1 and stats.inf_ref == 1


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def test_verifier_check_is_exact_when_candidate_is_the_original(mlp_path: Path) -> None:
    sets = generate_input_sets(onnx.load(str(mlp_path)), 2)
    result = Verifier(mlp_path, sets, TOL).check(mlp_path)
    assert result.ok and len(result.outputs) == 2
    assert all(o.max_abs == 0.0 and o.cosine == pytest.approx(1.0) for o in result.outputs)


def test_verifier_check_names_the_output_when_candidate_computes_something_else(tmp_path: Path, mlp_path: Path) -> None:
    model = onnx.load(str(mlp_path))
    for init in model.graph.initializer:
        if init.name == "W2":
            arr = onnx.numpy_helper.to_array(init)
            init.CopyFrom(onnx.numpy_helper.from_array(arr * 1.01, "W2"))
    wrong = _save(model, tmp_path / "wrong.onnx")
    result = Verifier(mlp_path, generate_input_sets(model, 1), TOL).check(wrong)
    assert not result.ok and "'y'" in (result.reason or "")
    assert result.outputs[0].mismatches > 0


def test_verifier_check_fails_when_candidate_does_not_load(tmp_path: Path, mlp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    result = Verifier(mlp_path, generate_input_sets(onnx.load(str(mlp_path)), 1), TOL).check(bad)
    assert not result.ok and "cannot load" in (result.reason or "")


def test_verifier_raises_target_unavailable_when_ep_is_missing(mlp_path: Path) -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here")
    with pytest.raises(UnavailableError) as info:
        Verifier(mlp_path, generate_input_sets(onnx.load(str(mlp_path)), 1), TOL, target="cuda")
    assert info.value.code == "TARGET_UNAVAILABLE"


def test_graph_inputs_skips_initializers_when_they_are_listed_as_inputs(mlp_path: Path) -> None:
    model = onnx.load(str(mlp_path))
    model.graph.input.append(helper.make_tensor_value_info("W1", TensorProto.FLOAT, [16, 32]))
    assert [s.name for s in graph_inputs(model)] == ["x"]


def test_verifier_check_builds_no_session_when_candidate_holds_the_original_bytes(
    tmp_path: Path, mlp_path: Path
) -> None:
    # setup: the upload handed back is a copy of the original's bytes; a re-saved model is another file
    sets = generate_input_sets(onnx.load(str(mlp_path)), 2)
    verifier = Verifier(mlp_path, sets, TOL)
    copy = tmp_path / "copy.onnx"
    copy.write_bytes(mlp_path.read_bytes())
    model = onnx.load(str(mlp_path))
    model.doc_string = "same graph, other bytes"
    resaved = _save(model, tmp_path / "resaved.onnx")
    # execute
    from_reference = verifier.check(copy)
    built_for_copy = verifier.sessions_built
    from_session = verifier.check(resaved)
    # assert: the copy is compared from the reference itself, exactly, on every set; the other file runs
    assert built_for_copy == 0 and verifier.sessions_built == 1
    assert from_reference.ok and len(from_reference.outputs) == len(from_session.outputs) == 2
    assert all(o.max_abs == 0.0 and o.mismatches == 0 for o in from_reference.outputs)
    assert [o.to_dict() for o in from_reference.outputs] == [o.to_dict() for o in from_session.outputs]
