"""extract_adapters on torch exports of a peft LoRA BERT (tests/models/lora/, built by tests.models.build_lora).

Numerics compare with the torch outputs saved in expected.npz, so no torch is needed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from core.adapters import ADAPTER_SUFFIX, SLOTS_KEY, read_adapter, read_slots, run_options
from core.config import EXACT_TOLERANCE, JobConfig
from core.errors import InvalidPassOptionsError
from core.inputs import InputSet
from core.settings import PipelineSettings
from passes._infra import PassContext
from passes.prepost.extract_adapters import ExtractAdapters
from passes.registry import get_pass_class
from workers.pipeline import PipelineRequest, run_pipeline
from workers.verify import Verifier

MODELS = Path(__file__).resolve().parents[1] / "models"
LORA = MODELS / "lora"
DYNAMO, LEGACY = LORA / "bert_lora.onnx", LORA / "bert_lora_legacy.onnx"
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
MODULES = [f"encoder.layer.{i}.attention.self.{m}" for i in (0, 1) for m in ("query", "value")]
ATOL = 1e-4

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    with np.load(LORA / "expected.npz") as data:
        return {k: data[k] for k in data.files}


def _feeds(expected: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    return {k: expected[f"set{i}.{k}"] for k in INPUTS}


def _extract(model: ir.Model, **options: object):
    ctx = PassContext()
    result = ExtractAdapters(options)(model, ctx)
    return result, ctx


def _save(tmp_path: Path, model: ir.Model, ctx: PassContext) -> tuple[Path, Path]:
    path = tmp_path / "model.onnx"
    ir.save(model, path)
    adapter = path.with_suffix(ADAPTER_SUFFIX)
    adapter.write_bytes(ctx.side_files[ADAPTER_SUFFIX])
    onnx.checker.check_model(str(path), full_check=True)
    return path, adapter


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _assert_numerics(path: Path, adapter: Path, expected: dict[str, np.ndarray], name: str = "one") -> None:
    session = _session(path)
    options, _active = run_options(adapter)
    for i in (0, 1):
        feeds = _feeds(expected, i)
        np.testing.assert_allclose(session.run(None, feeds)[0], expected[f"set{i}.base"], atol=ATOL, rtol=ATOL)
        with_adapter = session.run(None, feeds, options)[0]
        np.testing.assert_allclose(with_adapter, expected[f"set{i}.{name}"], atol=ATOL, rtol=ATOL)
        assert np.abs(expected[f"set{i}.{name}"] - expected[f"set{i}.base"]).max() > 1e-2  # the adapter matters


def _strip_names(model: ir.Model) -> None:
    """What an export that kept no names looks like: anonymous nodes, values and initializers, no metadata."""
    for i, node in enumerate(model.graph):
        node.name = f"n{i}"
        node.metadata_props.clear()
        for j, out in enumerate(node.outputs):
            if not out.is_graph_output():
                out.name = f"t{i}_{j}"
    for i, value in enumerate(list(model.graph.initializers.values())):
        del model.graph.initializers[value.name]
        value.name = f"w{i}"
        model.graph.register_initializer(value)


# --------------------------------------------------------------------------------------------- structure


@pytest.mark.parametrize("fixture", [DYNAMO, LEGACY], ids=["dynamo", "torchscript"])
def test_pairs_are_found_mapped_and_scale_folded_when_peft_export_given(fixture, tmp_path, expected):
    model = ir.load(fixture)
    muls = sum(n.op_type == "Mul" for n in model.graph)
    result, ctx = _extract(model)
    assert result.modified and result.counts == {"lora_pairs": 4}
    pairs = result.notes["pairs"]
    assert [p["module"] for p in pairs] == MODULES
    for p in pairs:
        assert p["module_known"] and p["rank"] == 4 and p["scale"] == pytest.approx(2.0)  # alpha 8 / r 4
        assert p["a_shape"] == [32, 4] and p["b_shape"] == [4, 32] and p["bytes"] == 2 * 32 * 4 * 4
    assert result.notes["verify_with_adapter"] == ADAPTER_SUFFIX
    assert sum(n.op_type == "Mul" for n in model.graph) == muls - 4  # the scale Muls are gone (folded into B)

    path, adapter = _save(tmp_path, model, ctx)
    proto = onnx.load(str(path))
    inits = {t.name: list(t.dims) for t in proto.graph.initializer}
    inputs = {v.name: v for v in proto.graph.input}
    for module in MODULES:
        a, b = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
        assert inits[a] == [32, 0] and inits[b] == [0, 32]  # empty defaults: the base model
        a_dims = [d.dim_param or d.dim_value for d in inputs[a].type.tensor_type.shape.dim]
        b_dims = [d.dim_param or d.dim_value for d in inputs[b].type.tensor_type.shape.dim]
        assert a_dims == [32, f"{module}.rank"] and b_dims == [f"{module}.rank", 32]  # any rank fits
    params = read_adapter(adapter)
    assert sorted(params) == sorted(f"{m}.lora_{w}.weight" for m in MODULES for w in "AB")
    assert all(params[f"{m}.lora_A.weight"].shape == (32, 4) for m in MODULES)
    assert [s.module for s in read_slots(path)] == MODULES
    _assert_numerics(path, adapter, expected)


def test_pairs_are_found_by_structure_when_every_name_is_stripped(tmp_path, expected):
    model = ir.load(DYNAMO)
    _strip_names(model)
    result, ctx = _extract(model)
    assert result.counts == {"lora_pairs": 4}
    assert [p["module"] for p in result.notes["pairs"]] == ["lora0", "lora1", "lora2", "lora3"]
    assert not any(p["module_known"] for p in result.notes["pairs"])
    assert result.notes["modules_unknown"] == ["lora0", "lora1", "lora2", "lora3"]
    path, adapter = _save(tmp_path, model, ctx)
    _assert_numerics(path, adapter, expected)


def test_module_paths_come_from_weight_names_when_export_metadata_is_dropped():
    model = ir.load(DYNAMO)
    for node in model.graph:
        node.metadata_props.clear()  # left: the base layers' bias names (...query.base_layer.bias)
    result, _ = _extract(model)
    assert [p["module"] for p in result.notes["pairs"]] == MODULES


def test_model_metadata_lists_every_slot_when_extracted():
    model = ir.load(LEGACY)
    _extract(model)
    slots = json.loads(model.metadata_props[SLOTS_KEY])
    assert [(s["module"], s["in_features"], s["out_features"], s["rank"]) for s in slots] == [
        (m, 32, 32, 4) for m in MODULES
    ]


# ------------------------------------------------------------------------------------------- refusals


def test_nothing_changes_and_code_is_no_lora_pair_when_model_has_no_lora():
    model = ir.load(MODELS / "hf_bert_encoder.onnx")
    nodes = len(list(model.graph))
    result, ctx = _extract(model)
    assert not result.modified and result.counts == {"lora_pairs": 0}
    assert result.notes["code"] == "NO_LORA_PAIR"
    assert ctx.side_files == {} and len(list(model.graph)) == nodes


def test_pairs_above_max_rank_are_declined_with_reason():
    model = ir.load(DYNAMO)
    result, _ = _extract(model, max_rank=2)
    assert not result.modified
    assert len(result.non_matches) == 4
    assert all("not a small LoRA rank" in m.reason for m in result.non_matches)


@pytest.mark.parametrize("options", [{"max_rank": 0}, {"max_rank": "x"}, {"rank": 4}])
def test_invalid_pass_options_when_options_are_bad(options):
    with pytest.raises(InvalidPassOptionsError) as info:
        ExtractAdapters(options)
    assert info.value.code == "INVALID_PASS_OPTIONS"


def test_pass_is_registered():
    assert get_pass_class("extract_adapters") is ExtractAdapters


# ------------------------------------------------------------------------------------- pipeline + verify


def test_verifier_matches_original_only_with_adapter_active(tmp_path, expected):
    model = ir.load(DYNAMO)
    _, ctx = _extract(model)
    path, adapter = _save(tmp_path, model, ctx)
    sets = [InputSet(f"set{i}", _feeds(expected, i)) for i in (0, 1)]
    verifier = Verifier(DYNAMO, sets, EXACT_TOLERANCE)
    assert verifier.check(path, adapter=adapter).ok
    assert not verifier.check(path).ok  # without the adapter it is the base model


def test_pipeline_writes_adapter_next_to_artifact_when_pass_applied(tmp_path, expected):
    settings = PipelineSettings(
        verify_shape_sets=2,
        benchmark_warmup=2,
        benchmark_min_runs=15,
        benchmark_max_seconds=0.2,
        ledger_runs=9,
        intra_op_threads=1,
    )
    out = tmp_path / "out"
    result = run_pipeline(
        PipelineRequest(
            model_path=DYNAMO,
            output_dir=out,
            config=JobConfig.parse({"passes": ["extract_adapters", "dead_node_elimination"]}),
            settings=settings,
        )
    )
    record = result.report["passes"][0]
    assert record["status"] == "applied", record["reason"]
    assert not result.used_original
    assert result.side_files == [out / "model.onnx_adapter"]
    assert result.report["artifact"]["side_files"] == ["model.onnx_adapter"]
    assert result.report["verification"]["ok"]
    _assert_numerics(result.model_path, result.side_files[0], expected)


# ------------------------------------------------------------------------------- standard peft setups

# name -> (inputs, the modules peft adapted); built with HF's initial weights, as from a config (zero biases)
STANDARD = {
    "bert_cls_lora": (
        INPUTS,
        [f"bert.encoder.layer.{i}.attention.self.{m}" for i in (0, 1) for m in ("query", "value")],
    ),
    "gpt2_lora": (INPUTS[:2], [f"h.{i}.attn.c_attn" for i in (0, 1)]),
}


@pytest.fixture(scope="module")
def expected_standard() -> dict[str, np.ndarray]:
    with np.load(LORA / "expected_standard.npz") as data:
        return {k: data[k] for k in data.files}


def _bias_reader(model: ir.Model, node_suffix: str) -> str:
    """The op that produces the bias input of the base layer named ``.../<node_suffix>``."""
    (base,) = [n for n in model.graph if n.name.endswith(node_suffix)]
    bias = next(v for v in base.inputs if v is not None and v.name.endswith("base_layer.bias"))
    return bias.producer().op_type if bias.producer() is not None else "initializer"


@pytest.mark.parametrize("exporter", ["", "_legacy"], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("name", sorted(STANDARD))
def test_pairs_are_extracted_when_the_base_linear_has_a_bias(name, exporter, tmp_path, expected_standard):
    """peft's sequence-classification setup on BERT (biased query/value beside the LoRA branch) and LoRA on
    GPT-2's biased Conv1D (Reshape -> Gemm(W, bias) -> Reshape): every pair is found by both exporters'
    forms, and the artifact computes the base without the adapter and the LoRA model with it."""
    inputs, modules = STANDARD[name]
    model = ir.load(LORA / f"{name}{exporter}.onnx")
    result, ctx = _extract(model)
    assert result.modified, [m.reason for m in result.non_matches]
    assert [p["module"] for p in result.notes["pairs"]] == modules
    assert all(p["module_known"] and p["rank"] == 4 and p["scale"] == pytest.approx(2.0) for p in result.notes["pairs"])
    path, adapter = _save(tmp_path, model, ctx)
    session = _session(path)
    options, _active = run_options(adapter)
    for i in (0, 1):
        feeds = {k: expected_standard[f"{name}.set{i}.{k}"] for k in inputs}
        base, lora = expected_standard[f"{name}.set{i}.base"], expected_standard[f"{name}.set{i}.lora"]
        assert np.abs(lora - base).max() > 1e-2  # the adapter matters
        np.testing.assert_allclose(session.run(None, feeds)[0], base, atol=ATOL, rtol=ATOL)
        np.testing.assert_allclose(session.run(None, feeds, options)[0], lora, atol=ATOL, rtol=ATOL)


def test_fixtures_hold_the_forms_that_hid_the_pairs_when_exported_by_torchscript():
    """What the matcher must see through: the TorchScript exporter shares the equal (zero) biases through
    Identity nodes, and GPT-2's Conv1D is a Gemm on Reshape'd rows."""
    bert = ir.load(LORA / "bert_cls_lora_legacy.onnx")
    assert _bias_reader(bert, "layer.1/attention/self/query/base_layer/Add") == "Identity"
    gpt2 = ir.load(LORA / "gpt2_lora_legacy.onnx")
    (gemm,) = [n for n in gpt2.graph if n.name.endswith("h.0/attn/c_attn/base_layer/Gemm")]
    assert gemm.inputs[0].producer().op_type == "Reshape" and gemm.outputs[0].uses()[0].node.op_type == "Reshape"
