"""Build ``tests/models/heldout/torch_encoder_{post,pre}_dynamo.onnx`` (``tests/passes/test_fuse_torch_encoder.py``).

Run ``python -m tests.models.build_heldout_torch_encoder`` (needs torch); the .onnx files are committed. A model
a team writes without transformers: token embedding plus a learned position table (64 rows), torch's own
``nn.TransformerEncoder`` (2 layers of ``nn.TransformerEncoderLayer(32, 4 heads, 64, GELU, batch_first)``,
post-norm and ``norm_first``), the padding mask as ``src_key_padding_mask``, a linear head on the first token:
``(input_ids, attention_mask) -> logits [B, 3]``. Dynamo exporter at opset 18, batch and sequence dynamic. (The
TorchScript exporter writes nn.MultiheadAttention's key length as a constant: its export runs at the example's
length only, so none is kept.) ``nn.TransformerEncoder`` clones one layer, so both layers start with equal
weights, which the exporter stores once: every projection is read by both layers.
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
        onnx.save(_strip(program.model_proto, {"source": "tests/models/build_heldout_torch_encoder.py"}), str(path))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for b, s in ((1, 5), (3, 17)):
            x = feeds(b, s, seed=s)
            with torch.no_grad():
                want = module(*(torch.from_numpy(v) for v in x.values())).numpy()
            np.testing.assert_allclose(session.run(None, x)[0], want, rtol=1e-4, atol=1e-5)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for built in build():
        print(built, built.stat().st_size, "bytes")
