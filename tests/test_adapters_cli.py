"""``onnxforge optimize --passes extract_adapters`` and ``onnxforge adapters convert``, end to end.

Fixtures: tests/models/lora/ (built by tests.models.build_lora). The second peft adapter (``adapter_two``:
r=8, alpha=4, against r=4 in the export) converted for the extracted model must match the peft model with
that adapter; refusals exit 2 with an ADAPTER_* code and write nothing.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from safetensors.numpy import load_file, save_file

from core.adapters import ADAPTER_SUFFIX, read_adapter, run_options
from onnxforge.cli import main
from passes._infra import PassContext
from passes.prepost.extract_adapters import ExtractAdapters

LORA = Path(__file__).resolve().parent / "models" / "lora"
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
ATOL = 1e-4
FAST_ENV = {
    "ONNXFORGE_PIPELINE__VERIFY_SHAPE_SETS": "2",
    "ONNXFORGE_PIPELINE__BENCHMARK_WARMUP": "2",
    "ONNXFORGE_PIPELINE__BENCHMARK_MIN_RUNS": "15",
    "ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS": "0.2",
    "ONNXFORGE_PIPELINE__LEDGER_RUNS": "9",
    "ONNXFORGE_PIPELINE__INTRA_OP_THREADS": "1",
}

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    with np.load(LORA / "expected.npz") as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dynamo export after extract_adapters (pass only; the pipeline run is tested separately)."""
    out = tmp_path_factory.mktemp("extracted") / "bert.onnx"
    model = ir.load(LORA / "bert_lora.onnx")
    ctx = PassContext()
    assert ExtractAdapters()(model, ctx).modified
    ir.save(model, out)
    out.with_suffix(ADAPTER_SUFFIX).write_bytes(ctx.side_files[ADAPTER_SUFFIX])
    return out


def _outputs(model: Path, adapter: Path | None, expected: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    run, _active = run_options(adapter)
    return [session.run(None, {k: expected[f"set{i}.{k}"] for k in INPUTS}, run)[0] for i in (0, 1)]


def _assert_matches(got: list[np.ndarray], expected: dict[str, np.ndarray], name: str) -> None:
    for i, value in enumerate(got):
        np.testing.assert_allclose(value, expected[f"set{i}.{name}"], atol=ATOL, rtol=ATOL, err_msg=f"{name} set{i}")


def _peft_copy(tmp_path: Path, source: str = "adapter_two") -> Path:
    target = tmp_path / source
    shutil.copytree(LORA / source, target)
    return target


def _edit_config(peft_dir: Path, **changes: object) -> None:
    path = peft_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_weights(peft_dir: Path, edit) -> None:
    path = peft_dir / "adapter_model.safetensors"
    save_file(edit(load_file(str(path))), str(path))


def _convert(capsys, peft_dir: Path, model: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    code = main(["adapters", "convert", str(peft_dir), "--model", str(model), "-o", str(out), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------------------------------- optimize


def test_optimize_writes_model_and_adapter_side_by_side_when_extract_adapters_runs(
    tmp_path, monkeypatch, expected, capsys
):
    for key, value in FAST_ENV.items():
        monkeypatch.setenv(key, value)
    from core.settings import get_settings

    get_settings.cache_clear()
    out, report = tmp_path / "bert.opt.onnx", tmp_path / "report.json"
    argv = ["optimize", str(LORA / "bert_lora.onnx"), "-o", str(out), "--passes", "extract_adapters"]
    try:
        assert main([*argv, "--report", str(report)]) == 0
        bundle = tmp_path / "bert.zip"
        assert main(["optimize", str(LORA / "bert_lora.onnx"), "-o", str(bundle), "--passes", "extract_adapters"]) == 0
    finally:
        get_settings.cache_clear()  # the next test reads its own environment
    adapter = tmp_path / "bert.opt.onnx_adapter"
    assert adapter.is_file()
    record = json.loads(report.read_text())["passes"][0]
    assert record["status"] == "applied"
    assert record["notes"]["pairs"][0]["module"] == "encoder.layer.0.attention.self.query"
    _assert_matches(_outputs(out, adapter, expected), expected, "one")  # the uploaded model's output
    _assert_matches(_outputs(out, None, expected), expected, "base")  # without the adapter: the base

    with zipfile.ZipFile(bundle) as zf:
        assert sorted(zf.namelist()) == ["model.onnx", "model.onnx_adapter"]
    capsys.readouterr()


# -------------------------------------------------------------------------------------------- convert


def test_second_peft_adapter_converts_and_matches_peft_model(tmp_path, extracted, expected, capsys):
    out = tmp_path / "two.onnx_adapter"
    code, stdout, stderr = _convert(capsys, LORA / "adapter_two", extracted, out)
    assert code == 0, stderr
    assert "encoder.layer.0.attention.self.query  rank 8" in stdout
    _assert_matches(_outputs(extracted, out, expected), expected, "two")
    _assert_matches(_outputs(extracted, None, expected), expected, "base")


def test_converted_first_adapter_equals_extracted_one(tmp_path, extracted, expected, capsys):
    out = tmp_path / "one.onnx_adapter"
    code, stdout, _ = _convert(capsys, LORA / "adapter_one", extracted, out, "--json")
    assert code == 0
    report = json.loads(stdout)
    first = report["pairs"][0]
    assert (first["module"], first["rank"], first["a_shape"], first["b_shape"]) == (
        "encoder.layer.0.attention.self.query",
        4,
        [32, 4],
        [4, 32],
    )
    assert report["slots_at_base"] == []
    converted, extracted_params = read_adapter(out), read_adapter(extracted.with_suffix(ADAPTER_SUFFIX))
    assert sorted(converted) == sorted(extracted_params)
    for name, value in converted.items():
        np.testing.assert_allclose(value, extracted_params[name], atol=1e-6)
    _assert_matches(_outputs(extracted, out, expected), expected, "one")


def test_adapter_for_subset_of_modules_leaves_others_at_base(tmp_path, extracted, capsys):
    peft_dir = _peft_copy(tmp_path)
    _edit_config(peft_dir, target_modules=["query"])
    _edit_weights(peft_dir, lambda w: {k: v for k, v in w.items() if ".query." in k})
    code, stdout, _ = _convert(capsys, peft_dir, extracted, tmp_path / "q.onnx_adapter", "--json")
    assert code == 0
    assert json.loads(stdout)["slots_at_base"] == [
        "encoder.layer.0.attention.self.value",
        "encoder.layer.1.attention.self.value",
    ]


def _rename_to_key(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k.replace(".value.", ".key."): v for k, v in weights.items()}


def _widen(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # a base with hidden size 48
    return {k: np.zeros((8, 48) if ".lora_A." in k else (48, 8), v.dtype) for k, v in weights.items()}


def _bad_rank(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: (v[:6] if ".lora_A." in k else v) for k, v in weights.items()}


@pytest.mark.parametrize(
    ("config", "weights", "code", "words"),
    [
        ({"target_modules": ["query", "key"]}, _rename_to_key, "ADAPTER_TARGET_MISSING", "no slot for target module"),
        ({}, _widen, "ADAPTER_BASE_MISMATCH", "another base model"),
        ({}, _bad_rank, "ADAPTER_RANK_MISMATCH", "ranks disagree"),
        ({"r": 16}, None, "ADAPTER_RANK_MISMATCH", "the config says 16"),
        ({"use_dora": True}, None, "ADAPTER_UNSUPPORTED", "DoRA"),
        ({"bias": "all"}, None, "ADAPTER_UNSUPPORTED", "bias"),
        ({"modules_to_save": ["classifier"]}, None, "ADAPTER_UNSUPPORTED", "modules_to_save"),
        ({"peft_type": "IA3"}, None, "ADAPTER_UNSUPPORTED", "not LoRA"),
    ],
    ids=["other-targets", "other-base", "rank-a-b", "rank-config", "dora", "bias", "modules-to-save", "ia3"],
)
def test_convert_refuses_with_code_when_model_has_no_slot(tmp_path, extracted, capsys, config, weights, code, words):
    peft_dir = _peft_copy(tmp_path)
    if config:
        _edit_config(peft_dir, **config)
    if weights is not None:
        _edit_weights(peft_dir, weights)
    out = tmp_path / "x.onnx_adapter"
    status, _, stderr = _convert(capsys, peft_dir, extracted, out)
    assert status == 2
    assert f"error: {code}:" in stderr and words in stderr
    assert not out.exists()  # nothing written, nothing lost


def test_convert_refuses_model_without_slots(tmp_path, capsys):
    status, _, stderr = _convert(capsys, LORA / "adapter_two", LORA / "bert_lora.onnx", tmp_path / "x.onnx_adapter")
    assert status == 2 and "error: NO_LORA_SLOTS:" in stderr and "extract_adapters" in stderr


@pytest.mark.parametrize(
    ("case", "code"),
    [("missing-dir", "ADAPTER_INVALID"), ("bin-only", "ADAPTER_INVALID"), ("bad-json", "ADAPTER_INVALID")],
)
def test_convert_refuses_unreadable_adapter_dir(tmp_path, extracted, capsys, case, code):
    peft_dir = tmp_path / "peft"
    if case != "missing-dir":
        peft_dir.mkdir()
    if case == "bin-only":
        (peft_dir / "adapter_config.json").write_text("{}")
        (peft_dir / "adapter_model.bin").write_bytes(b"pickle")
    if case == "bad-json":
        shutil.copy(LORA / "adapter_two" / "adapter_model.safetensors", peft_dir)
        (peft_dir / "adapter_config.json").write_text("{not json")
    status, _, stderr = _convert(capsys, peft_dir, extracted, tmp_path / "x.onnx_adapter")
    assert status == 2 and f"error: {code}:" in stderr


def test_convert_bad_options_exit_2(tmp_path, extracted, capsys):
    status, _, stderr = _convert(capsys, LORA / "adapter_two", extracted, tmp_path / "x.bin")
    assert status == 2 and "error: INVALID_ARGUMENT:" in stderr
    status, _, stderr = _convert(capsys, LORA / "adapter_two", tmp_path / "none.onnx", tmp_path / "x.onnx_adapter")
    assert status == 2 and "error: INVALID_MODEL:" in stderr
    assert main(["adapters", "convert", str(LORA / "adapter_two")]) == 2  # --model and -o are required
    assert main(["adapters"]) == 2
    capsys.readouterr()
