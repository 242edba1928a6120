"""prepost through the real pipeline: the registry, the ledger, the child process's job.json, the CLI.

The pass's own numerics are tested in tests/passes/test_prepost.py; here the question is whether a job that
asks for raw input gets it: the ledger accepts the pass on its own verification (the generic check cannot feed
the original PNG bytes), later passes are verified against the prepost'ed model, the artifact keeps the
metadata that says how to load it, raw samples load from samples.npz, and the service resolves a tokenizer
path inside the upload only. References are independent of the pass: Pillow + numpy and the Hugging Face
tokenizer, with sessions opened here.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import onnxruntime_extensions as ortx
import pytest
from PIL import Image

from core.config import JobConfig
from core.errors import InvalidInputError, InvalidModelError, PassError
from core.inputs import load_raw_samples
from core.settings import PipelineSettings
from passes._infra import Pass, PassContext, PassResult
from passes.prepost.prepost import Prepost
from tests.models.build_prepost import MINILM_TOKENIZER, image_classifier, tiny_bert
from tests.workers.conftest import AddReluChain, resolver
from workers.archive import extract_archive
from workers.child import run as run_child
from workers.pipeline import PipelineRequest, run_pipeline
from workers.sessions import make_session, needs_extensions
from workers.validate import validate_model_dir

ROOT = Path(__file__).resolve().parents[2]
MEAN, STD, SIZE = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225], 32
IMAGE_PREPOST = {
    "name": "prepost",
    "options": {"pre": {"kind": "image", "mean": MEAN, "std": STD, "channels": "RGB"}, "post": ["softmax"]},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def _png(seed: int = 3) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(SIZE, SIZE, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _pil_numpy(data: bytes) -> np.ndarray:
    arr = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32)
    return ((arr / 255.0 - np.array(MEAN, np.float32)) / np.array(STD, np.float32)).transpose(2, 0, 1)[None]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _session(path: Path, extensions: bool = False) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if extensions:
        options.register_custom_ops_library(ortx.get_library_path())
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _run(model: Path, out: Path, settings: PipelineSettings, samples: Path | None = None, **config: object):
    request = PipelineRequest(
        model_path=model,
        output_dir=out,
        config=JobConfig.parse(dict(config)),
        settings=settings,
        samples_path=samples,
    )
    return run_pipeline(request)


@pytest.fixture
def classifier(tmp_path: Path) -> Path:
    path = tmp_path / "in" / "classifier.onnx"
    path.parent.mkdir()
    onnx.save(image_classifier(SIZE), str(path))
    return path


# ------------------------------------------------------------------------------------------- pipeline


def test_pipeline_artifact_takes_png_bytes_when_job_asks_for_image_prepost(
    classifier: Path, tmp_path: Path, fast_settings: PipelineSettings
):
    data = _png()
    samples = tmp_path / "samples.npz"
    np.savez(samples, image=np.frombuffer(data, np.uint8))

    result = _run(classifier, tmp_path / "out", fast_settings, samples, passes=[IMAGE_PREPOST], rollback_slower=False)

    (record,) = result.report["passes"]
    assert record["status"] == "applied", record["reason"]
    assert record["verification"]["by"] == "prepost" and "verified by the pass itself" in record["reason"]
    assert record["notes"]["samples_origin"] == "samples"  # the raw sample of samples.npz reached the pass
    assert result.report["decision"]["result"] == "optimized"
    assert result.report["decision"]["gate"]["inputs_changed_by"] == "prepost"
    props = result.report["artifact"]["metadata_props"]
    assert props["onnxforge.requires"] == "onnxruntime-extensions"
    assert "get_library_path()" in props["onnxforge.register"]
    got = _session(result.model_path, extensions=True).run(None, {"image": np.frombuffer(data, np.uint8)})[0]
    logits = _session(classifier).run(None, {"pixel_values": _pil_numpy(data)})[0]
    assert np.max(np.abs(got - _softmax(logits))) < 1e-4


def test_pipeline_verifies_later_passes_against_prepost_model_when_a_pass_follows_it(
    classifier: Path, tmp_path: Path, fast_settings: PipelineSettings
):
    config = {"passes": [IMAGE_PREPOST, "shape_inference", "dead_node_elimination"], "rollback_slower": False}
    result = _run(classifier, tmp_path / "out", fast_settings, **config)

    records = {r["name"]: r for r in result.report["passes"]}
    assert records["prepost"]["status"] == "applied"
    inference = records["shape_inference"]
    # Verified by the generic check, on the raw inputs the pass verified (a PNG and a JPEG it synthesized).
    assert inference["status"] == "applied", inference["reason"]
    assert inference["verification"]["ok"] and "by" not in inference["verification"]
    assert result.report["verification"]["ok"]
    sets = [s["name"] for s in result.report["input_sets"]]
    assert any(name.startswith("raw") for name in sets), sets
    meta = json.loads(result.report["artifact"]["metadata_props"]["onnxforge.passes"])
    assert [p["name"] for p in meta] == ["prepost", "shape_inference"]


class NegateDenseBias(Pass):
    """TEST ONLY, WRONG: negates the classifier's dense bias (still there after prepost)."""

    name = "test_negate_dense_bias"
    summary = "test only: computes something else"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        value = model.graph.initializers["dense_b"]
        assert value.const_value is not None
        value.const_value = ir.tensor(-value.const_value.numpy(), name="dense_b")
        return PassResult(model, True, counts={"initializers_changed": 1})


def _run_with(model: Path, out: Path, settings: PipelineSettings, *passes: Pass, **config: object):
    request = PipelineRequest(
        model_path=model,
        output_dir=out,
        config=JobConfig.parse(dict(config)),
        settings=settings,
        pass_resolver=resolver(*passes),
    )
    return run_pipeline(request)


def test_pipeline_rolls_back_wrong_pass_after_prepost_when_it_breaks_the_prepost_model(
    classifier: Path, tmp_path: Path, fast_settings: PipelineSettings
):
    prepost = Prepost(IMAGE_PREPOST["options"])
    result = _run_with(classifier, tmp_path / "out", fast_settings, prepost, NegateDenseBias(), rollback_slower=False)

    records = {r["name"]: r for r in result.report["passes"]}
    assert records["prepost"]["status"] == "applied"
    wrong = records["test_negate_dense_bias"]
    assert wrong["status"] == "rolled_back" and "broke tolerance" in wrong["reason"], wrong["reason"]
    assert "probabilities" in wrong["reason"]  # compared with the prepost model's output, on raw input
    assert [i.name for i in onnx.load(str(result.model_path)).graph.input] == ["image"]


def test_pipeline_returns_prepost_model_not_upload_when_gate_finds_later_pass_slower(
    classifier: Path, tmp_path: Path, fast_settings: PipelineSettings
):
    prepost = Prepost(IMAGE_PREPOST["options"])
    result = _run_with(classifier, tmp_path / "out", fast_settings, prepost, AddReluChain(), rollback_slower=False)

    records = {r["name"]: r for r in result.report["passes"]}
    assert records["prepost"]["status"] == "applied"
    decision = result.report["decision"]
    assert decision["gate"]["slower"] is True, decision
    assert decision["result"] == "optimized" and not result.used_original
    assert "right after prepost is returned" in decision["reason"]
    assert records["test_add_relu_chain"]["status"] == "rolled_back"
    artifact = onnx.load(str(result.model_path))
    assert [i.name for i in artifact.graph.input] == ["image"]
    assert sum(n.op_type == "Relu" for n in artifact.graph.node) == 1  # the upload's own Relu only
    meta = json.loads(result.report["artifact"]["metadata_props"]["onnxforge.passes"])
    assert [p["name"] for p in meta] == ["prepost"]


def test_pipeline_fails_with_decode_code_when_sample_image_does_not_decode(
    classifier: Path, tmp_path: Path, fast_settings: PipelineSettings
):
    samples = tmp_path / "samples.npz"
    np.savez(samples, image=np.frombuffer(b"GIF89a but not really an image", np.uint8))
    with pytest.raises(PassError) as info:
        _run(classifier, tmp_path / "out", fast_settings, samples, passes=[IMAGE_PREPOST])
    assert info.value.code == "PREPOST_IMAGE_DECODE_FAILED"
    assert info.value.kind == "invalid_input" and info.value.pass_name == "prepost"
    assert not (tmp_path / "out" / "model.onnx").exists()  # no artifact with the wrong interface


def test_pipeline_feeds_raw_sentences_from_samples_npz_when_job_asks_for_text_prepost(
    tmp_path: Path, fast_settings: PipelineSettings
):
    model = tmp_path / "in" / "encoder.onnx"
    model.parent.mkdir()
    onnx.save(tiny_bert(), str(model))
    samples = tmp_path / "samples.npz"
    np.savez(samples, text=np.array(["A plain sample sentence.", "Another one, with a comma."]))
    options = {"pre": {"kind": "text", "tokenizer": str(MINILM_TOKENIZER)}, "post": [{"pool": "mean"}, "l2norm"]}

    result = _run(model, tmp_path / "out", fast_settings, samples, passes=[{"name": "prepost", "options": options}])

    (record,) = result.report["passes"]
    assert record["status"] == "applied" and record["notes"]["samples_origin"] == "samples+builtin"
    checked = {c["sample"]: c for c in record["notes"]["samples_checked"]}
    assert checked["Another one, with a comma."]["source"] == "sample" and checked["Another one, with a comma."]["ok"]
    origins = {s["name"]: s["origin"] for s in result.report["input_sets"]}
    assert {k: v for k, v in origins.items() if k.startswith("raw")} == {
        "raw text 0": "samples",
        "raw text 1": "samples",
    }
    assert any(v == "generated" for v in origins.values())  # the original's sets, which the baseline timed

    # A sentence of the user's own that the graph tokenizer splits differently fails the job, with its code.
    np.savez(samples, text=np.array(["Un café très naïf."]))
    with pytest.raises(PassError) as info:
        _run(model, tmp_path / "out2", fast_settings, samples, passes=[{"name": "prepost", "options": options}])
    assert info.value.code == "PREPOST_TOKENIZER_MISMATCH"


def test_load_raw_samples_refuses_with_samples_code_when_raw_arrays_are_malformed(tmp_path: Path):
    samples = tmp_path / "samples.npz"
    np.savez(samples, image=np.zeros((2, 3), np.float32))
    with pytest.raises(InvalidInputError) as info:
        load_raw_samples(samples, {"image": "uint8"})
    assert info.value.code == "SAMPLES_INVALID" and "uint8[n]" in info.value.message
    np.savez(samples, text=np.array(["a", None], dtype=object))  # object arrays need pickle: refused
    with pytest.raises(InvalidInputError) as info:
        load_raw_samples(samples, {"text": "string"})
    assert info.value.code == "SAMPLES_INVALID"
    np.savez(samples, pixel_values=np.zeros((1, 3, 2, 2), np.float32))  # the original's tensors: not raw
    assert load_raw_samples(samples, {"image": "uint8"}) is None


def test_make_session_registers_extensions_only_when_model_uses_their_domain(
    classifier: Path, tmp_path: Path, fast_settings: PipelineSettings
):
    result = _run(classifier, tmp_path / "out", fast_settings, passes=[IMAGE_PREPOST], rollback_slower=False)
    assert needs_extensions(result.model_path) and not needs_extensions(classifier)
    session = make_session(result.model_path)  # would fail on DecodeImage without the library
    (scores,) = session.run(None, {"image": np.frombuffer(_png(), np.uint8)})
    assert scores.shape == (1, 10)


# ----------------------------------------------------------------------- the service's child process


def _text_job(tmp_path: Path, fast_settings: PipelineSettings, tokenizer: str) -> tuple[Path, Path]:
    """An attempt directory as the runner lays it out: a zip upload (model + tokenizer files, flat, as
    workers/archive.py requires) extracted into input/, and job.json."""
    upload = tmp_path / "upload.zip"
    with zipfile.ZipFile(upload, "w") as zf:
        zf.writestr("model.onnx", tiny_bert().SerializeToString())
        for name in TOKENIZER_FILES:
            zf.write(MINILM_TOKENIZER / name, name)
    base = tmp_path / "attempt-1"
    (base / "input").mkdir(parents=True)
    model = extract_archive(upload, base / "input", "zip", max_total_bytes=50 << 20)
    options = {"pre": {"kind": "text", "tokenizer": tokenizer}, "post": [{"pool": "mean"}]}
    config = {"passes": [{"name": "prepost", "options": options}], "rollback_slower": False}
    job = {
        "model_path": str(model),
        "output_dir": str(base / "output"),
        "config": config,
        "pipeline": fast_settings.model_dump(mode="json"),
        "samples_path": None,
        "job_id": "job-prepost",
    }
    (base / "job.json").write_text(json.dumps(job))
    return base, model


def test_child_builds_text_artifact_when_tokenizer_lies_in_the_uploaded_archive(
    tmp_path: Path, fast_settings: PipelineSettings
):
    base, _ = _text_job(tmp_path, fast_settings, ".")

    assert run_child(base / "job.json") == 0, (base / "error.json").read_text()

    artifact = base / "output" / "model.onnx"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MINILM_TOKENIZER), local_files_only=True)
    sentence = "The quick brown fox jumps over the lazy dog."
    enc = tok(sentence, return_tensors="np")
    feeds = {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    (hidden,) = ort.InferenceSession(tiny_bert().SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )
    expected = hidden.mean(axis=1)  # no padding: every token counts
    (got,) = _session(artifact, extensions=True).run(None, {"text": np.array([sentence], dtype=object)})
    assert np.max(np.abs(got - expected)) < 1e-4
    report = json.loads((base / "output" / "report.json").read_text())
    notes = report["passes"][0]["notes"]
    assert notes["pre"]["tokenizer_op"] == "BertTokenizer" and notes["tokenizer_differences_plain_english"] == 0
    assert str(base) not in json.dumps(report["config"])  # the user's path, not the server's


@pytest.mark.parametrize("tokenizer", ["/etc", "../..", "sub/../../x"])
def test_child_refuses_tokenizer_path_with_clear_code_when_it_leaves_the_upload(
    tmp_path: Path, fast_settings: PipelineSettings, tokenizer: str
):
    base, _ = _text_job(tmp_path, fast_settings, tokenizer)

    assert run_child(base / "job.json") == 1

    error = json.loads((base / "error.json").read_text())
    assert error["code"] == "PREPOST_TOKENIZER_PATH_INVALID" and error["pass"] == "prepost", error
    assert not (base / "output" / "model.onnx").exists()


def test_child_refuses_tokenizer_symlink_when_it_points_outside_the_upload(
    tmp_path: Path, fast_settings: PipelineSettings
):
    base, model = _text_job(tmp_path, fast_settings, "tok")
    outside = tmp_path / "outside-tokenizer"
    shutil.copytree(MINILM_TOKENIZER, outside)
    (model.parent / "tok").symlink_to(outside, target_is_directory=True)

    assert run_child(base / "job.json") == 1

    assert json.loads((base / "error.json").read_text())["code"] == "PREPOST_TOKENIZER_PATH_INVALID"


def test_validator_refuses_upload_when_it_uses_the_extensions_op_domain(
    classifier: Path, tmp_path: Path, fast_settings: PipelineSettings
):
    """The artifact needs ai.onnx.contrib ops; an UPLOAD with that domain is refused (no custom-op library
    is ever registered for an upload's sake: security.md T9)."""
    result = _run(classifier, tmp_path / "out", fast_settings, passes=[IMAGE_PREPOST], rollback_slower=False)
    reupload = tmp_path / "job" / "model.onnx"
    reupload.parent.mkdir()
    shutil.copyfile(result.model_path, reupload)
    with pytest.raises(InvalidModelError) as info:
        validate_model_dir(reupload, reupload.parent)
    assert info.value.code == "UNSUPPORTED_OP_DOMAIN"
    assert "com.microsoft.extensions" in info.value.message  # DecodeImage's domain; the tokenizer's is ai.onnx.contrib


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_optimize_writes_png_artifact_when_config_file_asks_for_prepost(classifier: Path, tmp_path: Path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"passes": [IMAGE_PREPOST], "rollback_slower": False}))
    out = tmp_path / "model.onnx"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONNXFORGE_")} | {
        "ONNXFORGE_PIPELINE__BENCHMARK_WARMUP": "1",
        "ONNXFORGE_PIPELINE__BENCHMARK_MIN_RUNS": "3",
        "ONNXFORGE_PIPELINE__BENCHMARK_MAX_SECONDS": "0.3",
        "ONNXFORGE_PIPELINE__LEDGER_RUNS": "2",
    }
    done = subprocess.run(
        [sys.executable, "-m", "onnxforge.cli", "optimize", str(classifier), "-o", str(out), "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (raw,) = onnx.load(str(out)).graph.input
    assert raw.name == "image" and raw.type.tensor_type.elem_type == onnx.TensorProto.UINT8
    data = _png(seed=11)
    got = _session(out, extensions=True).run(None, {"image": np.frombuffer(data, np.uint8)})[0]
    logits = _session(classifier).run(None, {"pixel_values": _pil_numpy(data)})[0]
    assert np.max(np.abs(got - _softmax(logits))) < 1e-4
