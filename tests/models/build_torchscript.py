"""Build the exporter graphs the fusion tests read: ``ts_<arch>_<attention>.onnx`` and ``dynamo_<arch>.onnx``.

Run ``python -m tests.models.build_torchscript``. The committed ``hf_*.onnx`` files come from the dynamo
exporter; users still export mostly with ``torch.onnx.export(dynamo=False)``, whose graphs differ where the
fusions look: heads split by ``view(*shape, -1, head_dim)`` (a runtime shape holding -1), and with
``attn_implementation="sdpa"`` the scale applied to q and k apart, a boolean mask through ``Where`` and a NaN
guard after the Softmax. Each model is built from a transformers config (no hub), seeded, its parameters
perturbed (so biases are not zero), exported at batch 2 / sequence 16 with dynamic batch and sequence
(opset 17), and checked against torch in ONNX Runtime on other shapes; any failure raises.

``dynamo_<arch>.onnx`` come from ``torch.onnx.export(dynamo=True)`` (opset 18, eager attention), the keyword
tensors passed to the HF model inside a wrapper whose forward spells out the inputs (torch.export reads the
graph's inputs off that signature). DistilBERT's is the graph ``padding_elimination`` unpads and whose
attention ``fast`` then failed to fuse; Llama's adds RMS norms, rotary embeddings and a causal mask.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ATTENTION = ("eager", "sdpa")
VOCAB = 256
# What main() builds: (arch, exporter); exporter "eager"/"sdpa" is TorchScript with that attention.
BUILDS = (
    ("bert", "eager"),
    ("bert", "sdpa"),
    ("distilbert", "dynamo"),
    ("llama", "dynamo"),
    ("gpt2", "eager"),
    ("gpt2", "sdpa"),
    ("gpt2", "dynamo"),
    ("llama", "eager"),
    ("llama", "sdpa"),
    ("t5enc", "eager"),
    ("bartenc", "eager"),
    ("bartenc", "sdpa"),
)
# The decoders are exported without a cache (use_cache=False): their attention is the causal self-attention
# fuse_transformer targets; decoders with a cache are their own issue.
_NO_CACHE = ("llama", "gpt2")


def _model(arch: str, attention: str, width: int = 32):
    """A tiny transformers model of ``arch`` with every parameter perturbed, in eval mode. ``width`` (hidden size;
    4 heads, feed-forward twice as wide) is for bench/fusions.py: the committed exports are 32 wide."""
    import torch
    import transformers

    torch.manual_seed(0)
    positions = max(128, 2 * width)  # the benchmark's widths time sequences up to 256
    small = {"vocab_size": VOCAB, "max_position_embeddings": positions, "attn_implementation": attention}
    if arch == "bert":  # the committed ts_bert_* were built with BERT's default 512 positions
        config = transformers.BertConfig(
            hidden_size=32,
            num_attention_heads=4,
            num_hidden_layers=2,
            intermediate_size=64,
            vocab_size=VOCAB,
            attn_implementation=attention,
        )
        model = transformers.BertModel(config, add_pooling_layer=False)
    elif arch == "distilbert":
        config = transformers.DistilBertConfig(dim=32, n_heads=4, n_layers=2, hidden_dim=64, **small)
        model = transformers.DistilBertModel(config)
    elif arch == "llama":
        config = transformers.LlamaConfig(
            hidden_size=width,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_hidden_layers=2,
            intermediate_size=2 * width,
            use_cache=False,
            **small,
        )
        model = transformers.LlamaModel(config)
    elif arch == "gpt2":  # tanh GELU (gelu_new), Conv1D projections, causal mask
        config = transformers.GPT2Config(
            n_embd=width,
            n_head=4,
            n_layer=2,
            n_inner=2 * width,
            n_positions=positions,
            vocab_size=VOCAB,
            use_cache=False,
            attn_implementation=attention,
        )
        model = transformers.GPT2Model(config)
    elif arch == "t5enc":  # RMS norms, no scaling, relative position bias added to the scores
        config = transformers.T5Config(
            d_model=width,
            d_kv=width // 4,
            num_heads=4,
            num_layers=2,
            d_ff=2 * width,
            vocab_size=VOCAB,
            use_cache=False,
            attn_implementation=attention,
        )
        model = transformers.T5EncoderModel(config)
    elif arch == "bartenc":  # post-norm, learned positions with offset 2, LayerNorm on the embeddings
        config = transformers.BartConfig(
            d_model=width,
            encoder_attention_heads=4,
            encoder_layers=2,
            encoder_ffn_dim=2 * width,
            decoder_layers=1,
            decoder_attention_heads=4,
            decoder_ffn_dim=2 * width,
            max_position_embeddings=positions,
            vocab_size=VOCAB,
            use_cache=False,
            attn_implementation=attention,
        )
        model = transformers.BartModel(config).get_encoder()
    else:
        raise ValueError(f"unknown arch {arch!r}")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    model.eval()

    class Hidden(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            extra = {"use_cache": False} if arch in _NO_CACHE else {}
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, return_dict=False, **extra)[0]

    return Hidden(model).eval()


def build_dynamo(arch: str, out: Path, width: int = 32) -> Path:
    import torch

    wrapper = _model(arch, "eager", width)
    ids, mask = inputs(2, 16, seed=0)
    path = out / f"dynamo_{arch}.onnx"
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    program = torch.onnx.export(
        wrapper,
        (torch.from_numpy(ids), torch.from_numpy(mask)),
        dynamo=True,
        opset_version=18,
        input_names=["input_ids", "attention_mask"],
        output_names=["last_hidden_state"],
        dynamic_shapes={"input_ids": {0: batch, 1: sequence}, "attention_mask": {0: batch, 1: sequence}},
    )
    program.save(str(path))
    _strip_metadata(path)
    _check(path, wrapper)
    return path


def build(arch: str, attention: str, out: Path, width: int = 32) -> Path:
    import torch

    if attention == "dynamo":
        return build_dynamo(arch, out, width)
    wrapper = _model(arch, attention, width)
    ids, mask = inputs(2, 16, seed=0)
    path = out / f"ts_{arch}_{attention}.onnx"
    axes = {"batch": 0, "sequence": 1}
    torch.onnx.export(
        wrapper,
        (torch.from_numpy(ids), torch.from_numpy(mask)),
        str(path),
        dynamo=False,
        opset_version=17,
        input_names=["input_ids", "attention_mask"],
        output_names=["last_hidden_state"],
        dynamic_axes={
            "input_ids": {v: k for k, v in axes.items()},
            "attention_mask": {v: k for k, v in axes.items()},
            "last_hidden_state": {0: "batch", 1: "sequence"},
        },
    )
    _check(path, wrapper)
    return path


def inputs(batch: int, seq: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and a right-padded mask (every row keeps at least one token; the last row is half padding)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, VOCAB, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    mask[-1, max(1, seq // 2) :] = 0
    return ids, mask


def _strip_metadata(path: Path) -> None:
    """Drop the dynamo exporter's per-node stack traces (local paths, several times the weights' size)."""
    import onnx

    model = onnx.load(str(path))
    for item in [model, model.graph, *model.graph.node, *model.graph.value_info]:
        if hasattr(item, "metadata_props"):
            del item.metadata_props[:]
        item.doc_string = ""
    onnx.save(model, str(path))


def _check(path: Path, wrapper) -> None:
    import onnx
    import onnxruntime as ort
    import torch

    onnx.checker.check_model(str(path), full_check=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, seq in ((1, 5), (3, 37)):
        ids, mask = inputs(batch, seq, seed=seq)
        with torch.no_grad():
            want = wrapper(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        got = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{path.name} at {batch}x{seq}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--only", help="build only this arch (bert, distilbert, llama, gpt2, t5enc, bartenc)")
    args = parser.parse_args()
    for arch, exporter in BUILDS:
        if args.only in (None, arch):
            print(build(arch, exporter, args.out))


if __name__ == "__main__":
    main()
