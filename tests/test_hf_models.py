"""The committed tiny Hugging Face models (tests/models/hf_*.onnx, built by tests/models/build_hf.py).

Only the .onnx files, onnx and onnxruntime are used: torch and transformers are a dev-only extra. Besides
loading and running each model at two (batch, sequence) shapes, the pattern tests pin the graph forms that
passes target (README.md next to the models), so that a rebuild with another exporter or transformers
version that changes them fails here rather than silently in a pass test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from tests.models import build_hf

MODELS_DIR = Path(__file__).parent / "models"
HIDDEN = 32
VOCAB = 256

# name -> {output: expected dims}; inputs are all int64[batch, sequence].
EXPECTED = {
    "roberta_cls": {"logits": ["batch", 2]},
    "bert_mlm_loss": {"loss": [], "logits": ["batch", "sequence", VOCAB]},
    "bert_encoder": {"last_hidden_state": ["batch", "sequence", HIDDEN]},
    "xlnet": {"last_hidden_state": ["batch", "sequence", HIDDEN]},
    "gpt2": {"logits": ["batch", "sequence", VOCAB]},
}
SHAPES = [(1, 7, 0.0), (3, 16, 0.25)]


def _dims(value: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def _load(name: str) -> onnx.ModelProto:
    return onnx.load(MODELS_DIR / build_hf.filename(name, "tiny"))


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in model.graph.node for out in node.output}


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def test_tiny_set_matches_builder() -> None:
    tiny = {n for n, s in build_hf.SPECS.items() if "tiny" in s.dims}
    assert tiny == set(EXPECTED)
    on_disk = {p.name for p in MODELS_DIR.glob("hf_*.onnx")}
    assert on_disk == {build_hf.filename(n, "tiny") for n in tiny}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_signature(name: str) -> None:
    model = _load(name)
    onnx.checker.check_model(model, full_check=True)
    spec = build_hf.SPECS[name]
    assert [i.name for i in model.graph.input] == list(spec.inputs)
    for value in model.graph.input:
        assert value.type.tensor_type.elem_type == onnx.TensorProto.INT64, value.name
        assert _dims(value) == ["batch", "sequence"], value.name
    assert {o.name: _dims(o) for o in model.graph.output} == EXPECTED[name]
    assert [o.name for o in model.graph.output] == list(spec.outputs)
    assert all(o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for o in model.graph.output)
    # plain ONNX: default domain only, opset >= 17, no local functions
    assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
    assert not model.functions
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
    assert model.graph.name == f"hf_{name}"
    assert model.graph.initializer, "weights are stored inline (no external data)"
    assert (MODELS_DIR / build_hf.filename(name, "tiny")).stat().st_size < 1_000_000


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_runs_at_two_shapes(name: str) -> None:
    session = ort.InferenceSession(
        str(MODELS_DIR / build_hf.filename(name, "tiny")), providers=["CPUExecutionProvider"]
    )
    spec = build_hf.SPECS[name]
    results = []
    for batch, seq, pad in SHAPES:
        feeds = build_hf.make_inputs(name, batch, seq, pad_fraction=pad, valid_label_fraction=0.3, size="tiny")
        outputs = dict(zip(spec.outputs, session.run(None, feeds), strict=True))
        for out_name, dims in EXPECTED[name].items():
            concrete = [{"batch": batch, "sequence": seq}.get(d, d) for d in dims]
            assert list(outputs[out_name].shape) == concrete, (out_name, batch, seq)
            assert np.isfinite(outputs[out_name]).all(), (out_name, batch, seq)
        results.append(outputs)
    # random weights still give input-dependent outputs: the rows of the batch differ
    main = next(k for k, dims in EXPECTED[name].items() if dims)
    batched = results[-1][main]
    assert np.ptp(batched, axis=0).max() > 1e-6


def test_roberta_cls_head_gathers_first_token() -> None:
    """<s>-token pooling: Gather(axis=1, scalar index 0) on the last LayerNorm -> Gemm -> Tanh -> Gemm."""
    model = _load("roberta_cls")
    prod = _producers(model)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    logits = prod["logits"]
    assert logits.op_type == "Gemm"
    tanh = prod[logits.input[0]]
    dense = prod[tanh.input[0]]
    gather = prod[dense.input[0]]
    assert (tanh.op_type, dense.op_type, gather.op_type) == ("Tanh", "Gemm", "Gather")
    assert _attr(gather, "axis") == 1
    index = inits[gather.input[1]]
    assert index.shape == () and index.item() == 0
    assert prod[gather.input[0]].op_type == "LayerNormalization"


def test_bert_mlm_loss_is_softmax_cross_entropy() -> None:
    """The loss is one SoftmaxCrossEntropyLoss(ignore_index=-100, mean) over Reshape(logits, [-1, V]) and
    Reshape(labels, [-1]); the graph's logits output is the 3-D tensor before that Reshape."""
    model = _load("bert_mlm_loss")
    prod = _producers(model)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    ops = {n.op_type for n in model.graph.node}
    assert "NegativeLogLikelihoodLoss" not in ops and "LogSoftmax" not in ops
    loss = prod["loss"]
    assert loss.op_type == "SoftmaxCrossEntropyLoss"
    assert _attr(loss, "ignore_index") == -100
    assert _attr(loss, "reduction") == b"mean"
    scores, labels = (prod[i] for i in loss.input[:2])
    assert scores.op_type == "Reshape" and scores.input[0] == "logits"
    assert inits[scores.input[1]].tolist() == [-1, VOCAB]
    assert labels.op_type == "Reshape" and labels.input[0] == "labels"
    assert inits[labels.input[1]].tolist() == [-1]


def test_xlnet_has_range_gather_index_select() -> None:
    """rel_shift_bnij's index_select(x, 3, arange(klen)): Gather(axis=3) whose indices are
    Reshape(Range(0, sequence, 1), [-1]), once per layer, all sharing one Range."""
    model = _load("xlnet")
    prod = _producers(model)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    gathers = [n for n in model.graph.node if n.op_type == "Gather" and _attr(n, "axis") == 3]
    assert len(gathers) == 2  # one per layer
    ranges = set()
    for gather in gathers:
        reshape = prod[gather.input[1]]
        assert reshape.op_type == "Reshape"
        assert inits[reshape.input[1]].tolist() == [-1]
        rng = prod[reshape.input[0]]
        assert rng.op_type == "Range"
        assert inits[rng.input[0]].item() == 0 and inits[rng.input[2]].item() == 1
        limit = prod[rng.input[1]]
        assert limit.op_type == "Squeeze"
        shape = prod[limit.input[0]]
        assert shape.op_type == "Shape" and shape.input[0] == "attention_mask"
        assert (_attr(shape, "start"), _attr(shape, "end")) == (1, 2)  # the sequence length
        ranges.add(rng.name)
    assert len(ranges) == 1


def test_make_inputs_padding_and_labels() -> None:
    feeds = build_hf.make_inputs("bert_mlm_loss", 8, 32, pad_fraction=0.25, valid_label_fraction=0.15, seed=3)
    mask, ids, labels = feeds["attention_mask"], feeds["input_ids"], feeds["labels"]
    assert all(a.dtype == np.int64 and a.shape == (8, 32) for a in feeds.values())
    assert (mask == 0).sum() == round(0.25 * 8 * 32)
    assert (mask[:, 0] == 1).all()
    assert (np.diff(mask, axis=1) <= 0).all()  # right padding
    assert (ids[mask == 0] == 0).all()  # [PAD]
    valid = labels != -100
    assert valid.sum() == round(0.15 * mask.sum())
    assert (mask[valid] == 1).all()
    assert (labels[valid] == ids[valid]).all()
    again = build_hf.make_inputs("bert_mlm_loss", 8, 32, pad_fraction=0.25, valid_label_fraction=0.15, seed=3)
    assert all(np.array_equal(feeds[k], again[k]) for k in feeds)
    tiny = build_hf.make_inputs("gpt2", 2, 8, size="tiny")
    assert tiny["input_ids"].max() < VOCAB


def test_builder_and_bench_models_import_without_torch() -> None:
    code = (
        "import sys, tests.models.build_hf, bench.models; "
        "bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad"
    )
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
