"""core.runtime: the ``onnxforge.session`` recipe is applied, whitelisted, and read without the weights."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from core import recipe, runtime

MODELS = Path(__file__).resolve().parent / "models"
ENCODER = MODELS / "hf_bert_encoder.onnx"  # inputs [batch, sequence] int64, position table 128


def with_metadata(tmp_path: Path, value: str | None, name: str = "model.onnx", **extra: str) -> Path:
    model = onnx.load(str(ENCODER))
    props = dict(extra)
    if value is not None:
        props[recipe.RECIPE_KEY] = value
    onnx.helper.set_model_props(model, props)
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def recipe_json(**parts) -> str:
    return json.dumps(parts)


def test_load_applies_session_options_and_config_when_the_recipe_sets_them(tmp_path):
    path = with_metadata(
        tmp_path,
        recipe_json(
            session_options={"enable_mem_pattern": False, "enable_cpu_mem_arena": False},
            session_config={"session.use_device_allocator_for_initializers": "1"},
            provider_options={},
            warmup=[{"input_ids": [2, 16], "attention_mask": [2, 16], "token_type_ids": [2, 16]}],
        ),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", recipe.RecipeWarning)  # a valid recipe warns about nothing
        session = runtime.load(path)
    options = session.get_session_options()
    assert options.enable_mem_pattern is False
    assert options.enable_cpu_mem_arena is False
    assert options.get_session_config_entry("session.use_device_allocator_for_initializers") == "1"
    assert session.get_providers() == ["CPUExecutionProvider"]
    feeds = {"input_ids": np.ones((1, 5), np.int64), "attention_mask": np.ones((1, 5), np.int64),
             "token_type_ids": np.zeros((1, 5), np.int64)}  # fmt: skip
    reference = ort.InferenceSession(str(ENCODER), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_array_equal(session.run(None, feeds)[0], reference)


def test_load_uses_ort_defaults_when_the_model_has_no_recipe(tmp_path):
    path = with_metadata(tmp_path, None, other="kept")
    with warnings.catch_warnings():
        warnings.simplefilter("error", recipe.RecipeWarning)
        session = runtime.load(path)
    defaults = ort.SessionOptions()
    options = session.get_session_options()
    assert options.enable_mem_pattern == defaults.enable_mem_pattern
    assert options.enable_cpu_mem_arena == defaults.enable_cpu_mem_arena
    assert recipe.read_recipe(path) is None


def test_load_refuses_hostile_session_options_and_writes_no_file(tmp_path):
    target = tmp_path / "x.onnx"
    profile = tmp_path / "profile"
    path = with_metadata(
        tmp_path,
        recipe_json(
            session_options={
                "optimized_model_filepath": str(target),
                "enable_profiling": True,
                "profile_file_prefix": str(profile),
                "register_custom_ops_library": "/tmp/evil.so",
            },
            session_config={
                "session.save_model_format": "ORT",
                "session.optimized_model_external_initializers_file_name": str(tmp_path / "w.bin"),
            },
            provider_options={"TensorrtExecutionProvider": {"trt_engine_cache_path": str(tmp_path)}},
            extra_key={"anything": 1},
        ),
    )
    with pytest.warns(recipe.RecipeWarning) as caught:
        session = runtime.load(path)
    session.run(None, runtime.warmup_feeds(session, {"input_ids": [1, 8]}))
    messages = " ".join(str(w.message) for w in caught)
    for name in ("optimized_model_filepath", "enable_profiling", "session.save_model_format", "extra_key"):
        assert name in messages
    options = session.get_session_options()
    assert options.optimized_model_filepath == ""
    assert options.enable_profiling is False
    assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


@pytest.mark.parametrize(
    "value",
    [
        "not json {",
        "[1, 2]",
        recipe_json(session_options={"enable_mem_pattern": "no", "intra_op_num_threads": 10**9}),
        recipe_json(session_config={"session.use_device_allocator_for_initializers": "yes"}),
        recipe_json(warmup=[{"input_ids": [8192, 8192]}]),  # above MAX_WARMUP_ELEMENTS: never allocated
        recipe_json(warmup=[{"input_ids": [2, 4096]}]),  # beyond the position table: the run fails, load does not
        recipe_json(warmup=[{"nope": [1, 8]}, "x", {"input_ids": [1, 8, 3]}]),
    ],
)
def test_load_ignores_invalid_recipe_values_with_a_warning(tmp_path, value):
    path = with_metadata(tmp_path, value)
    with pytest.warns(recipe.RecipeWarning):
        session = runtime.load(path)
    options = session.get_session_options()
    assert options.enable_mem_pattern is True
    assert options.intra_op_num_threads == ort.SessionOptions().intra_op_num_threads


def test_warmup_feeds_bind_missing_inputs_from_shared_dims_and_refuse_huge_shapes():
    session = ort.InferenceSession(str(ENCODER), providers=["CPUExecutionProvider"])
    feeds = runtime.warmup_feeds(session, {"input_ids": [3, 20]})
    assert {k: (v.shape, v.dtype) for k, v in feeds.items()} == {
        "input_ids": ((3, 20), np.int64),
        "attention_mask": ((3, 20), np.int64),
        "token_type_ids": ((3, 20), np.int64),
    }
    assert feeds["attention_mask"].all() and not feeds["input_ids"].any()
    with pytest.warns(recipe.RecipeWarning, match="elements"):
        assert runtime.warmup_feeds(session, {"input_ids": [1 << 13, 1 << 13]}) is None


def test_read_metadata_props_matches_onnx_without_loading_the_graph(tmp_path):
    path = with_metadata(tmp_path, recipe_json(warmup=[]), a="1", b="x" * 300)
    expected = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert recipe.read_metadata_props(path) == expected
    assert recipe.read_metadata_props(ENCODER) == {p.key: p.value for p in onnx.load(str(ENCODER)).metadata_props}
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x0b\x00\x00")  # wire type 3 (group) at top level: not an ONNX model
    with pytest.raises(ValueError):
        recipe.read_metadata_props(bad)


def test_overrides_win_over_the_recipe_and_unknown_overrides_raise(tmp_path):
    path = with_metadata(tmp_path, recipe_json(session_options={"intra_op_num_threads": 2}))
    assert runtime.load(path).get_session_options().intra_op_num_threads == 2
    assert runtime.load(path, intra_op_num_threads=1).get_session_options().intra_op_num_threads == 1
    with pytest.raises(TypeError, match="optimized_model_filepath"):
        runtime.load(path, optimized_model_filepath=str(tmp_path / "y.onnx"))
    assert not (tmp_path / "y.onnx").exists()


def test_provider_options_merge_into_matching_providers_and_the_callers_own_win():
    sanitized = recipe.sanitize_recipe(
        {
            "provider_options": {
                "CUDAExecutionProvider": {"gpu_mem_limit": 1 << 30, "arena_extend_strategy": "kSameAsRequested"}
            }
        }
    )
    merged = runtime._providers(
        sanitized, [("CUDAExecutionProvider", {"gpu_mem_limit": "2147483648"}), "CPUExecutionProvider"]
    )
    assert merged == [
        ("CUDAExecutionProvider", {"gpu_mem_limit": "2147483648", "arena_extend_strategy": "kSameAsRequested"}),
        "CPUExecutionProvider",
    ]
    with pytest.warns(recipe.RecipeWarning):
        bad = recipe.sanitize_recipe(
            {"provider_options": {"CUDAExecutionProvider": {"gpu_mem_limit": -1, "device_id": 3}}}
        )
    assert bad["provider_options"] == {}


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(), reason="needs the CUDA EP")
def test_load_applies_cuda_provider_options_on_a_gpu(tmp_path):
    path = with_metadata(
        tmp_path,
        recipe_json(provider_options={"CUDAExecutionProvider": {"arena_extend_strategy": "kSameAsRequested",
                                                                "gpu_mem_limit": str(2 << 30)}}),
    )  # fmt: skip
    session = runtime.load(path)
    options = session.get_provider_options()["CUDAExecutionProvider"]
    assert options["arena_extend_strategy"] == "kSameAsRequested"
    assert options["gpu_mem_limit"] == str(2 << 30)


def test_sanitize_keeps_cuda_graph_flag_only_when_it_is_zero_or_one():
    with warnings.catch_warnings():
        warnings.simplefilter("error", recipe.RecipeWarning)
        good = recipe.sanitize_recipe({"provider_options": {"CUDAExecutionProvider": {"enable_cuda_graph": "1"}}})
    assert runtime.cuda_graph_enabled(good)
    with pytest.warns(recipe.RecipeWarning, match="enable_cuda_graph"):
        bad = recipe.sanitize_recipe({"provider_options": {"CUDAExecutionProvider": {"enable_cuda_graph": "yes"}}})
    assert not runtime.cuda_graph_enabled(bad)


def test_load_skips_warmup_calls_when_the_recipe_enables_cuda_graphs(tmp_path):
    warmup = [{"input_ids": [2, 16], "attention_mask": [2, 16], "token_type_ids": [2, 16]}]
    graph = with_metadata(
        tmp_path,
        recipe_json(provider_options={"CUDAExecutionProvider": {"enable_cuda_graph": "1"}}, warmup=warmup),
        name="graph.onnx",
    )
    with pytest.warns(recipe.RecipeWarning, match="warm-up calls are skipped"):
        session = runtime.load(graph, ["CPUExecutionProvider"])
    plain = with_metadata(tmp_path, recipe_json(warmup=warmup), name="plain.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("error", recipe.RecipeWarning)  # the same warm-up runs without a graph
        runtime.load(plain)
    feeds = {"input_ids": np.ones((1, 5), np.int64), "attention_mask": np.ones((1, 5), np.int64),
             "token_type_ids": np.zeros((1, 5), np.int64)}  # fmt: skip
    bound = runtime.BoundRun(session, feeds)
    bound.run()
    np.testing.assert_array_equal(bound.outputs()[0], session.run(None, feeds)[0])
