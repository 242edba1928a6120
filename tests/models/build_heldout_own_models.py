"""Build the models a team writes without transformers under ``tests/models/heldout/`` (dynamo exporter at
opset 18, batch and sequence dynamic; ``tests/passes/test_fuse_torch_encoder.py``, ``test_fuse_rotary_own.py``).

Run ``python -m tests.models.build_heldout_own_models`` (needs torch); the .onnx files are committed.

* ``torch_encoder_{post,pre}_dynamo.onnx``: token embedding plus a learned position table (64 rows), torch's
  own ``nn.TransformerEncoder`` (2 layers of ``nn.TransformerEncoderLayer(32, 4 heads, 64, GELU,
  batch_first)``, post-norm and ``norm_first``), the padding mask as ``src_key_padding_mask``, a linear head on
  the first token: ``(input_ids, attention_mask) -> logits [B, 3]``. (The TorchScript exporter writes
  nn.MultiheadAttention's key length as a constant: its export runs at the example's length only, so none is
  kept.) ``nn.TransformerEncoder`` clones one layer, so both layers start with equal weights, which the exporter
  stores once: every projection is read by both layers.
* ``own_llama_dynamo.onnx``: a Llama-style decoder without a cache as people write one (2 layers, hidden 32,
  4 heads / 2 KV heads, ``nn.RMSNorm``, SiLU-gated MLP, ``repeat_interleave`` for GQA, causal
  ``F.scaled_dot_product_attention``): ``input_ids -> logits``; rotary from ``cos``/``sin`` buffers
  ``[1, 1, 128, 8]`` cut to the sequence (``self.cos[:, :, :T]``), no position_ids anywhere. (TorchScript
  cannot export ``nn.RMSNorm`` at opset 17.)
* ``own_vit_dynamo.onnx``: a timm-style ViT (2 blocks, hidden 32, 4 heads, 8-pixel patches of a 32 px image: 16
  patches and a CLS token; ``qkv(x).reshape(B, N, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)``, eager attention
  with q scaled first, a linear head on the CLS token): ``pixel_values -> logits [B, 10]``.
* ``own_subtracted_mask_{ts,dynamo}.onnx``: a BERT-style encoder written by hand (2 post-norm layers, hidden 32,
  4 heads, GELU MLP), its padding mask subtracted from the scaled scores (``scores - 10000 * (1 - mask)``):
  ``(input_ids, attention_mask) -> hidden [B, S, 32]``; TorchScript opset 17 and dynamo opset 18.
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
VOCAB, HIDDEN, POSITIONS = 100, 32, 64


def feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[1:, seq // 2 :] = 0
    return {"input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int64), "attention_mask": mask}


def build() -> list[Path]:
    import onnxruntime as ort
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self, norm_first: bool) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.positions = nn.Parameter(torch.randn(1, POSITIONS, HIDDEN) * 0.1)
            layer = nn.TransformerEncoderLayer(
                HIDDEN, 4, 2 * HIDDEN, dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first
            )
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(HIDDEN, 3)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            x = self.embed(input_ids) + self.positions[:, : input_ids.shape[1]]
            x = self.encoder(x, src_key_padding_mask=attention_mask == 0)
            return self.head(x[:, 0])

    paths = []
    for norm_first in (False, True):
        torch.manual_seed(0)
        module = Encoder(norm_first).eval()
        args = tuple(torch.from_numpy(v) for v in feeds(2, 10).values())
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence", max=POSITIONS)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module, args, input_names=["input_ids", "attention_mask"], output_names=["logits"],
                dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}), opset_version=18, dynamo=True,
                optimize=True, verbose=False,
            )  # fmt: skip
        path = DIR / f"torch_encoder_{'pre' if norm_first else 'post'}_dynamo.onnx"
        onnx.save(_strip(program.model_proto, {"source": "tests/models/build_heldout_own_models.py"}), str(path))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for b, s in ((1, 5), (3, 17)):
            x = feeds(b, s, seed=s)
            with torch.no_grad():
                want = module(*(torch.from_numpy(v) for v in x.values())).numpy()
            np.testing.assert_allclose(session.run(None, x)[0], want, rtol=1e-4, atol=1e-5)
        paths.append(path)
    return paths


LLAMA_VOCAB, LLAMA_HIDDEN, LLAMA_HEADS, LLAMA_KV, LLAMA_TABLE = 128, 32, 4, 2, 128


def llama_feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, LLAMA_VOCAB, (batch, seq)).astype(np.int64)}


def build_llama() -> Path:
    import onnxruntime as ort
    import torch
    from torch import nn
    from torch.nn import functional as F

    head = LLAMA_HIDDEN // LLAMA_HEADS

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : head // 2], x[..., head // 2 :]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq = nn.Linear(LLAMA_HIDDEN, LLAMA_HIDDEN, bias=False)
            self.wk = nn.Linear(LLAMA_HIDDEN, LLAMA_KV * head, bias=False)
            self.wv = nn.Linear(LLAMA_HIDDEN, LLAMA_KV * head, bias=False)
            self.wo = nn.Linear(LLAMA_HIDDEN, LLAMA_HIDDEN, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q = self.wq(x).view(b, t, LLAMA_HEADS, head).transpose(1, 2)
            k = self.wk(x).view(b, t, LLAMA_KV, head).transpose(1, 2)
            v = self.wv(x).view(b, t, LLAMA_KV, head).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k, v = (z.repeat_interleave(LLAMA_HEADS // LLAMA_KV, dim=1) for z in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(y.transpose(1, 2).reshape(b, t, LLAMA_HIDDEN))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(LLAMA_HIDDEN, eps=1e-6), nn.RMSNorm(LLAMA_HIDDEN, eps=1e-6)
            self.attention = Attention()
            self.w1, self.w3 = (nn.Linear(LLAMA_HIDDEN, 2 * LLAMA_HIDDEN, bias=False) for _ in range(2))
            self.w2 = nn.Linear(2 * LLAMA_HIDDEN, LLAMA_HIDDEN, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            x = x + self.attention(self.norm1(x), cos, sin)
            h = self.norm2(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(LLAMA_VOCAB, LLAMA_HIDDEN)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.norm = nn.RMSNorm(LLAMA_HIDDEN, eps=1e-6)
            self.out = nn.Linear(LLAMA_HIDDEN, LLAMA_VOCAB, bias=False)
            inv = 1.0 / (10000 ** (torch.arange(0, head, 2).float() / head))
            angles = torch.outer(torch.arange(LLAMA_TABLE).float(), inv)
            angles = torch.cat((angles, angles), dim=-1)
            self.register_buffer("cos", angles.cos()[None, None])
            self.register_buffer("sin", angles.sin()[None, None])
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in self.parameters():  # away from torch's unit norms
                    p.add_(torch.randn(p.shape, generator=gen) * 0.02)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            t = input_ids.shape[1]
            x, cos, sin = self.embed(input_ids), self.cos[:, :, :t], self.sin[:, :, :t]
            for block in self.blocks:
                x = block(x, cos, sin)
            return self.out(self.norm(x))

    torch.manual_seed(0)
    module = Decoder().eval()
    args = (torch.from_numpy(llama_feeds(2, 10)["input_ids"]),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, input_names=["input_ids"], output_names=["logits"],
            dynamic_shapes=({0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence", max=LLAMA_TABLE)},),
            opset_version=18, dynamo=True, optimize=True, verbose=False,
        )  # fmt: skip
    path = DIR / "own_llama_dynamo.onnx"
    onnx.save(_strip(program.model_proto, {"source": "tests/models/build_heldout_own_models.py"}), str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b, s in ((1, 5), (3, 17)):
        x = llama_feeds(b, s, seed=s)
        with torch.no_grad():
            want = module(torch.from_numpy(x["input_ids"])).numpy()
        np.testing.assert_allclose(session.run(None, x)[0], want, rtol=1e-4, atol=1e-5)
    return path


def vit_feeds(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"pixel_values": np.random.default_rng(seed).standard_normal((batch, 3, 32, 32)).astype(np.float32)}


def build_vit() -> Path:
    import onnxruntime as ort
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads, self.head = 4, 8
            self.qkv, self.proj = nn.Linear(32, 96), nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, c = x.shape
            q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, self.head).permute(2, 0, 3, 1, 4).unbind(0)
            attention = ((q * self.head**-0.5) @ k.transpose(-2, -1)).softmax(dim=-1)
            return self.proj((attention @ v).transpose(1, 2).reshape(b, n, c))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(32, eps=1e-6), nn.LayerNorm(32, eps=1e-6)
            self.attention = Attention()
            self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attention(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class ViT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch = nn.Conv2d(3, 32, 8, 8)
            self.cls = nn.Parameter(torch.randn(1, 1, 32) * 0.02)
            self.positions = nn.Parameter(torch.randn(1, 17, 32) * 0.02)
            self.blocks = nn.Sequential(Block(), Block())
            self.norm, self.head = nn.LayerNorm(32, eps=1e-6), nn.Linear(32, 10)

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            x = self.patch(pixel_values).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.positions
            return self.head(self.norm(self.blocks(x))[:, 0])

    torch.manual_seed(0)
    module = ViT().eval()
    args = (torch.from_numpy(vit_feeds(2)["pixel_values"]),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, input_names=["pixel_values"], output_names=["logits"],
            dynamic_shapes=({0: torch.export.Dim("batch")},), opset_version=18, dynamo=True, optimize=True,
            verbose=False,
        )  # fmt: skip
    path = DIR / "own_vit_dynamo.onnx"
    onnx.save(_strip(program.model_proto, {"source": "tests/models/build_heldout_own_models.py"}), str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b in (1, 3):
        x = vit_feeds(b, seed=b)
        with torch.no_grad():
            want = module(torch.from_numpy(x["pixel_values"])).numpy()
        np.testing.assert_allclose(session.run(None, x)[0], want, rtol=1e-4, atol=1e-5)
    return path


def build_subtracted_mask() -> list[Path]:
    """A BERT-style encoder written by hand: its padding mask subtracted from the scores."""
    import math

    import onnxruntime as ort
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self, heads: int = 4) -> None:
            super().__init__()
            self.heads = heads
            self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
            self.layers = torch.nn.ModuleList(
                torch.nn.ModuleDict(
                    {
                        "q": torch.nn.Linear(HIDDEN, HIDDEN),
                        "k": torch.nn.Linear(HIDDEN, HIDDEN),
                        "v": torch.nn.Linear(HIDDEN, HIDDEN),
                        "o": torch.nn.Linear(HIDDEN, HIDDEN),
                        "up": torch.nn.Linear(HIDDEN, 2 * HIDDEN),
                        "down": torch.nn.Linear(2 * HIDDEN, HIDDEN),
                        "norm1": torch.nn.LayerNorm(HIDDEN),
                        "norm2": torch.nn.LayerNorm(HIDDEN),
                    }
                )
                for _ in range(2)
            )

        def _heads(self, x: torch.Tensor) -> torch.Tensor:
            batch, seq, _ = x.shape
            return x.view(batch, seq, self.heads, HIDDEN // self.heads).transpose(1, 2)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            x = self.embed(input_ids)
            dropped = 1.0 - attention_mask[:, None, None, :].float()
            for layer in self.layers:
                q, k, v = (self._heads(layer[name](x)) for name in ("q", "k", "v"))
                scores = q @ k.transpose(-1, -2) / math.sqrt(HIDDEN // self.heads)
                scores = scores - 10000.0 * dropped
                context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape)
                x = layer["norm1"](x + layer["o"](context))
                x = layer["norm2"](x + layer["down"](torch.nn.functional.gelu(layer["up"](x))))
            return x

    torch.manual_seed(0)
    module = Encoder().eval()
    example = feeds(2, 9)
    args = tuple(torch.from_numpy(example[n]) for n in ("input_ids", "attention_mask"))
    names = ["input_ids", "attention_mask"]
    paths = []
    for exporter in ("ts", "dynamo"):
        path = DIR / f"own_subtracted_mask_{exporter}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if exporter == "ts":
                axes = {n: {0: "batch", 1: "sequence"} for n in names}
                torch.onnx.export(module, args, str(path), input_names=names, output_names=["hidden"],
                                  dynamic_axes=axes, opset_version=17, dynamo=False)  # fmt: skip
                proto = onnx.load(str(path))
            else:
                dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence", min=2, max=POSITIONS)}
                proto = torch.onnx.export(
                    module, args, input_names=names, output_names=["hidden"], dynamic_shapes=(dims, dims),
                    opset_version=18, dynamo=True, optimize=True, verbose=False,
                ).model_proto  # fmt: skip
        onnx.save(_strip(proto, {"source": "tests/models/build_heldout_own_models.py"}), str(path))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for b, t in ((1, 5), (3, 12)):
            x = feeds(b, t, seed=t)
            with torch.no_grad():
                want = module(*(torch.from_numpy(x[n]) for n in names)).numpy()
            np.testing.assert_allclose(session.run(None, x)[0], want, rtol=1e-4, atol=1e-5)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for built in [*build(), build_llama(), build_vit(), *build_subtracted_mask()]:
        print(built, built.stat().st_size, "bytes")
