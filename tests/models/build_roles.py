"""Build the three exports whose inputs cannot be guessed from names alone (issue 17), as users export them.

Run ``python -m tests.models.build_roles`` (needs the ``dev`` extra: torch, transformers). It writes

* ``roles_gpt2_past.onnx``: ``GPT2LMHeadModel`` with a key/value cache: ``input_ids [batch, sequence]``,
  ``attention_mask [batch, past_sequence + sequence]`` (it spans past and new tokens),
  ``past_key_values.{i}.key/value [batch, 2, past_sequence, 8]``; outputs ``logits`` and the ``present``
  tensors.
* ``roles_wav2vec2.onnx``: ``Wav2Vec2Model`` on raw audio ``input_values [batch, samples]``: its feature
  encoder (kernels 10,3,3,3,3,2,2, strides 5,2,2,2,2,2,2) needs at least 400 samples.
* ``roles_bart_cls.onnx``: ``BartForSequenceClassification``: ``input_ids, attention_mask [batch, sequence]``;
  its head gathers the hidden state at each row's EOS token (id 2), so ids without one fail.

Each comes from a ``transformers`` config object with tiny sizes (nothing is downloaded), ``torch.manual_seed(0)``
and every parameter perturbed by ``0.02 * randn`` (as in ``build_hf``), exported with the TorchScript exporter
(``dynamo=False``, opset 17, transformers' default attention), the path issue 17's failing jobs took, and
checked against torch in ONNX Runtime on inputs shaped other than the export example; a mismatch raises
and deletes the file. The tests load the committed files and never need torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
OPSET = 17
ATOL = 1e-4
LAYERS, HIDDEN, HEADS, KV_DIM = 2, 16, 2, 8
BART_EOS = 2


def _perturb(model: Any) -> Any:
    import torch

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=gen))
    return model.eval()


def _gpt2() -> tuple[Any, Callable[..., tuple[Any, ...]], dict[str, Any]]:
    import torch
    from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=96,
        n_positions=64,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_inner=32,
        use_cache=True,
        bos_token_id=95,
        eos_token_id=95,
    )
    inner = _perturb(GPT2LMHeadModel(config))

    class WithPast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any, *past: Any) -> tuple[Any, ...]:
            cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(LAYERS)])
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache)
            presents = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (out.logits, *presents)

    past_names = [f"past_key_values.{i}.{kind}" for i in range(LAYERS) for kind in ("key", "value")]
    present_names = [f"present.{i}.{kind}" for i in range(LAYERS) for kind in ("key", "value")]
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "past_sequence + sequence"},
        "logits": {0: "batch", 1: "sequence"},
    }
    axes.update({name: {0: "batch", 2: "past_sequence"} for name in past_names})
    axes.update({name: {0: "batch", 2: "past_sequence + sequence"} for name in present_names})

    def example(batch: int, seq: int, past: int) -> tuple[Any, ...]:
        gen = torch.Generator().manual_seed(batch * 100 + seq)
        ids = torch.randint(0, 96, (batch, seq), generator=gen)
        mask = torch.ones(batch, past + seq, dtype=torch.int64)
        kv = [torch.randn(batch, HEADS, past, KV_DIM, generator=gen) for _ in past_names]
        return (ids, mask, *kv)

    names = {"input_names": ["input_ids", "attention_mask", *past_names], "output_names": ["logits", *present_names]}
    return WithPast().eval(), example, {**names, "dynamic_axes": axes, "shapes": [(2, 4, 3), (1, 5, 7), (3, 2, 1)]}


def _wav2vec2() -> tuple[Any, Callable[..., tuple[Any, ...]], dict[str, Any]]:
    import torch
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=32,
        conv_dim=(8,) * 7,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        mask_time_prob=0.0,
    )
    inner = _perturb(Wav2Vec2Model(config))

    class Audio(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_values: Any) -> Any:
            return self.inner(input_values=input_values).last_hidden_state

    def example(batch: int, samples: int) -> tuple[Any, ...]:
        gen = torch.Generator().manual_seed(batch * 1000 + samples)
        return (torch.randn(batch, samples, generator=gen),)

    return (
        Audio().eval(),
        example,
        {
            "input_names": ["input_values"],
            "output_names": ["last_hidden_state"],
            "dynamic_axes": {
                "input_values": {0: "batch", 1: "samples"},
                "last_hidden_state": {0: "batch", 1: "frames"},
            },
            "shapes": [(1, 1600), (2, 800), (1, 3000)],
        },
    )


def _bart_cls() -> tuple[Any, Callable[..., tuple[Any, ...]], dict[str, Any]]:
    import torch
    from transformers import BartConfig, BartForSequenceClassification

    config = BartConfig(
        vocab_size=96,
        d_model=HIDDEN,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        num_labels=3,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=BART_EOS,
        decoder_start_token_id=BART_EOS,
    )
    inner = _perturb(BartForSequenceClassification(config))

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).logits

    def example(batch: int, seq: int) -> tuple[Any, ...]:
        gen = torch.Generator().manual_seed(batch * 100 + seq)
        ids = torch.randint(3, 96, (batch, seq), generator=gen)
        ids[:, -1] = BART_EOS  # what a tokenizer gives: one </s> per row
        return ids, torch.ones(batch, seq, dtype=torch.int64)

    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    return (
        Classifier().eval(),
        example,
        {
            "input_names": ["input_ids", "attention_mask"],
            "output_names": ["logits"],
            "dynamic_axes": {**axes, "logits": {0: "batch"}},
            "shapes": [(2, 5), (1, 9), (3, 3)],
        },
    )


BUILDERS: dict[str, Callable[[], tuple[Any, Callable[..., tuple[Any, ...]], dict[str, Any]]]] = {
    "gpt2_past": _gpt2,
    "wav2vec2": _wav2vec2,
    "bart_cls": _bart_cls,
}
EXPORT_SHAPES = {"gpt2_past": (1, 3, 4), "wav2vec2": (1, 1200), "bart_cls": (2, 7)}


def build(name: str, out_dir: Path = HERE) -> Path:
    import onnxruntime as ort
    import torch
    import transformers

    torch.manual_seed(0)
    module, example, info = BUILDERS[name]()
    shapes = info.pop("shapes")
    path = out_dir / f"roles_{name}.onnx"
    with torch.no_grad():
        torch.onnx.export(module, example(*EXPORT_SHAPES[name]), str(path), opset_version=OPSET, dynamo=False, **info)
    model = onnx.load(str(path))
    for node in model.graph.node:  # the exporter's per-node doc strings carry local paths
        node.doc_string = ""
    model.doc_string = ""
    onnx.helper.set_model_props(
        model,
        {
            "onnxforge.builder": f"python -m tests.models.build_roles --only {name}",
            "onnxforge.versions": f"torch {torch.__version__}, transformers {transformers.__version__}",
        },
    )
    onnx.save(model, str(path))
    try:
        onnx.checker.check_model(str(path), full_check=True)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        for shape in shapes:
            args = example(*shape)
            with torch.no_grad():
                want = module(*args)
            want = [want] if isinstance(want, torch.Tensor) else list(want)
            got = session.run(None, {n: a.numpy() for n, a in zip(info["input_names"], args, strict=True)})
            for w, g in zip(want, got, strict=True):
                np.testing.assert_allclose(g, w.numpy(), atol=ATOL, rtol=ATOL, err_msg=f"{name} at {shape}")
    except Exception:
        path.unlink(missing_ok=True)
        raise
    print(f"{path.name}: {path.stat().st_size // 1024} KB, {len(model.graph.node)} nodes")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(BUILDERS), action="append")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    for name in args.only or list(BUILDERS):
        build(name, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
