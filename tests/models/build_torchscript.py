"""Build the TorchScript-exporter graphs the fusion tests read: ``ts_<arch>_<attention>.onnx``.

Run ``python -m tests.models.build_torchscript``. The committed ``hf_*.onnx`` files come from the dynamo
exporter; users still export mostly with ``torch.onnx.export(dynamo=False)``, whose graphs differ where the
fusions look: heads split by ``view(*shape, -1, head_dim)`` (a runtime shape holding -1), and with
``attn_implementation="sdpa"`` the scale applied to q and k apart, a boolean mask through ``Where`` and a NaN
guard after the Softmax. Each model is built from a transformers config (no hub), seeded, its parameters
perturbed (so biases are not zero), exported at batch 2 / sequence 16 with dynamic batch and sequence
(opset 17), and checked against torch in ONNX Runtime on other shapes; any failure raises.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ATTENTION = ("eager", "sdpa")
VOCAB = 256


def build(arch: str, attention: str, out: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    if arch == "bert":
        config = transformers.BertConfig(
            hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB
        )
        model = transformers.BertModel(config, add_pooling_layer=False)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    config._attn_implementation = attention
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    model.eval()

    class Hidden(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]

    wrapper = Hidden(model).eval()
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
    args = parser.parse_args()
    for attention in ATTENTION:
        print(build("bert", attention, args.out))


if __name__ == "__main__":
    main()
