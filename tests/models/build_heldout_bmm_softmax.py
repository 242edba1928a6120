"""Build the transformers-4.x-style ``bmm`` attention exports under ``tests/models/heldout/``
(``tests/passes/test_fuse_softmax_on_folded_heads.py``).

Run ``python -m tests.models.build_heldout_bmm_softmax`` (needs torch); the .onnx files are committed so the
tests need neither. A 2-layer text encoder (vocabulary 64, hidden 32, 4 heads of 8, GELU FFN, post-norm
residuals, every parameter random) whose attention is written as BART, Marian, M2M100 and Whisper wrote it
in transformers 4.x (and XGLM still does): q scaled after its projection, heads folded into the batch
(``[B*h, S, d]``), ``torch.bmm``, the Softmax on the folded ``[B*h, S, T]`` scores:

* ``bmm_mask_{ts,dynamo}.onnx``: ``(input_ids, attention_mask) -> hidden``; the additive padding mask
  (``(1 - mask) * finfo.min``) added on the 4-D view of the scores, which is folded back before the Softmax;
* ``bmm_nomask_{ts,dynamo}.onnx``: ``input_ids -> hidden``; no mask, so no 4-D view at all (Whisper's encoder).

TorchScript exporter at opset 17 and the dynamo exporter at 18, batch and sequence dynamic.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import onnx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.models.corpus import _strip  # noqa: E402

DIR = Path(__file__).resolve().parent / "heldout"
VOCAB, HIDDEN, HEADS, LAYERS = 64, 32, 4, 2


def _modules():
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head_dim = HIDDEN // HEADS
            self.scaling = self.head_dim**-0.5
            self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

        def _shape(self, tensor: torch.Tensor, seq: int, bsz: int) -> torch.Tensor:
            return tensor.view(bsz, seq, HEADS, self.head_dim).transpose(1, 2).contiguous()

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
            bsz, tgt, _ = x.size()
            query = self.q_proj(x) * self.scaling
            key = self._shape(self.k_proj(x), -1, bsz)
            value = self._shape(self.v_proj(x), -1, bsz)
            proj_shape = (bsz * HEADS, -1, self.head_dim)
            query = self._shape(query, tgt, bsz).view(*proj_shape)
            key, value = key.view(*proj_shape), value.view(*proj_shape)
            src = key.size(1)
            weights = torch.bmm(query, key.transpose(1, 2))
            if mask is not None:
                weights = weights.view(bsz, HEADS, tgt, src) + mask
                weights = weights.view(bsz * HEADS, tgt, src)
            weights = nn.functional.softmax(weights, dim=-1)
            out = torch.bmm(weights, value)
            out = out.view(bsz, HEADS, tgt, self.head_dim).transpose(1, 2).reshape(bsz, tgt, HIDDEN)
            return self.out_proj(out)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = Attention()
            self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
            self.fc1, self.fc2 = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
            x = self.norm1(x + self.attention(x, mask))
            return self.norm2(x + self.fc2(nn.functional.gelu(self.fc1(x))))

    class Encoder(nn.Module):
        def __init__(self, masked: bool) -> None:
            super().__init__()
            self.masked = masked
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in self.parameters():  # away from torch's zero biases and unit norms
                    p.add_(torch.randn(p.shape, generator=gen) * 0.1)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
            x = self.embed(input_ids)
            mask = None
            if attention_mask is not None:
                keep = attention_mask[:, None, None, :].to(x.dtype)
                mask = (1.0 - keep) * torch.finfo(x.dtype).min
            for layer in self.layers:
                x = layer(x, mask)
            return x

    return Encoder


def _feeds(masked: bool, batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int64)}
    if masked:
        mask = np.ones((batch, seq), np.int64)
        mask[1:, seq // 2 :] = 0  # padded rows after the first
        feeds["attention_mask"] = mask
    return feeds


def build() -> list[Path]:
    import torch

    encoder = _modules()
    paths = []
    for masked in (True, False):
        torch.manual_seed(0)
        module = encoder(masked).eval()
        example = {k: torch.from_numpy(v) for k, v in _feeds(masked, 2, 7, 0).items()}
        names = list(example)
        args = tuple(example.values())
        for tag in ("ts", "dynamo"):
            path = DIR / f"bmm_{'mask' if masked else 'nomask'}_{tag}.onnx"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if tag == "ts":
                    axes = {name: {0: "batch", 1: "sequence"} for name in [*names, "hidden"]}
                    torch.onnx.export(
                        module, args, str(path), input_names=names, output_names=["hidden"],
                        dynamic_axes=axes, opset_version=17, dynamo=False,
                    )  # fmt: skip
                    proto = onnx.load(str(path))
                else:
                    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
                    shapes = tuple({0: batch, 1: seq} for _ in names)
                    program = torch.onnx.export(
                        module, args, input_names=names, output_names=["hidden"], dynamic_shapes=shapes,
                        opset_version=18, dynamo=True, optimize=True, verbose=False,
                    )  # fmt: skip
                    proto = program.model_proto
            onnx.save(_strip(proto, {"source": "tests/models/build_heldout_bmm_softmax.py"}), str(path))
            _check(module, path, masked)
            paths.append(path)
    return paths


def _check(module, path: Path, masked: bool) -> None:
    """ORT against torch on shapes other than the export example's."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, seq in ((1, 3), (3, 11)):
        feeds = _feeds(masked, batch, seq, seq)
        with torch.no_grad():
            want = module(*(torch.from_numpy(v) for v in feeds.values())).numpy()
        got = session.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    for built in build():
        print(built, built.stat().st_size, "bytes")
