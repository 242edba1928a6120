"""Build the folded-heads attention exports under ``tests/models/heldout/`` (``tests/passes/test_fuse_3d_heads.py``).

Run ``python -m tests.models.build_heldout_3d_heads`` (needs torch and transformers); the .onnx files are
committed so the tests need neither. Each is ``F.multi_head_attention_forward``'s ``need_weights=True`` path
(``[B*heads, S, d]`` bmm on a sequence-first projection), every axis dynamic:

* ``wavlm_3d_{dynamo,ts}.onnx``: transformers' ``WavLMModel`` (2 layers, hidden 16, 2 heads, 8-channel feature
  encoder), every parameter perturbed, raw audio ``[batch, samples]`` -> ``last_hidden_state``: a gated
  relative position bias ``[B*heads, S, S]`` computed from the hidden states on the scores.
* ``mha_kpm_bf{1,0}_dynamo.onnx``: ``torch.nn.MultiheadAttention(32, 4)`` called as users call it (``need_weights``
  left at True), batch first or sequence first, ``(x, key_padding_mask bool [B, S]) -> y``: the packed
  in-projection and the padding mask merged to ``[B*heads, 1, S]`` with -inf. (The TorchScript exporter writes
  this module's key length as a constant, so that export runs at its example's length only: none kept.)
* ``mha_seq_first_dynamo.onnx``: the same module sequence first, called with ``need_weights=False`` (CLIP's and
  BridgeTower's image towers): its SDPA path, ``x [S, B, 32] -> y [S, B, 32]``, the output unflattened from the
  out-projection's 2-D Gemm.
"""

from __future__ import annotations

import dataclasses
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
WAVLM = {
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "conv_dim": (8,) * 7,
    "num_conv_pos_embeddings": 8,
    "num_conv_pos_embedding_groups": 2,
    "num_buckets": 16,
    "max_bucket_distance": 32,
    "mask_time_prob": 0.0,
}


def _meta() -> dict[str, str]:
    return {"source": "tests/models/build_heldout_3d_heads.py"}


def build_wavlm() -> list[Path]:
    from bench.heldout_vision_audio import SPECS, _export, _model, _wrapper, feeds

    spec = dataclasses.replace(SPECS["wavlm"], kwargs=WAVLM)
    paths = []
    for exporter, tag in (("dynamo", "dynamo"), ("ts_eager", "ts")):
        path = DIR / f"wavlm_3d_{tag}.onnx"
        wrapper = _wrapper(spec, _model(spec, "eager"))
        proto = _export(wrapper, spec, exporter, feeds(spec, 2, 20), path)
        onnx.save(_strip(proto, _meta()), str(path))
        paths.append(path)
    return paths


def build_mha() -> list[Path]:
    import torch

    class Attend(torch.nn.Module):
        def __init__(self, batch_first: bool) -> None:
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(32, 4, batch_first=batch_first)
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in self.mha.parameters():  # biases away from torch's zero init
                    p.add_(torch.randn(p.shape, generator=gen) * 0.1)

        def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
            return self.mha(x, x, x, key_padding_mask=key_padding_mask)[0]

    paths = []
    for batch_first in (True, False):
        torch.manual_seed(0)
        module = Attend(batch_first).eval()
        x = torch.randn(2, 5, 32) if batch_first else torch.randn(5, 2, 32)
        mask = torch.zeros(2, 5, dtype=torch.bool)
        mask[1, 3:] = True
        axes = ({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},) * 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module,
                (x, mask),
                input_names=["x", "key_padding_mask"],
                output_names=["y"],
                dynamic_shapes=axes,
                opset_version=18,
                dynamo=True,
                optimize=True,
                verbose=False,
            )
        path = DIR / f"mha_kpm_bf{int(batch_first)}_dynamo.onnx"
        onnx.save(_strip(program.model_proto, _meta()), str(path))
        _check(module, path, batch_first)
        paths.append(path)
    return paths


def build_mha_no_weights() -> Path:
    import torch

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4)
    with torch.no_grad():
        for p in mha.parameters():
            p.add_(torch.randn(p.shape) * 0.1)

    class Attend(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = mha

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mha(x, x, x, need_weights=False)[0]

    module = Attend().eval()
    axes = ({0: torch.export.Dim("sequence", min=2, max=512), 1: torch.export.Dim("batch", min=2, max=64)},)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (torch.randn(5, 2, 32),), input_names=["x"], output_names=["y"],
                                    dynamic_shapes=axes, opset_version=18, dynamo=True)  # fmt: skip
    path = DIR / "mha_seq_first_dynamo.onnx"
    onnx.save(_strip(program.model_proto, _meta()), str(path))
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for seq, batch in ((3, 1), (9, 3)):
        x = np.random.default_rng(seq).standard_normal((seq, batch, 32)).astype(np.float32)
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(session.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-5)
    return path


def _check(module, path: Path, batch_first: bool) -> None:
    """ORT against torch on shapes other than the export example's."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for batch, seq in ((1, 3), (3, 9)):
        x = rng.standard_normal((batch, seq, 32) if batch_first else (seq, batch, 32)).astype(np.float32)
        mask = np.zeros((batch, seq), bool)
        mask[0, seq - 1 :] = True
        with torch.no_grad():
            want = module(torch.from_numpy(x), torch.from_numpy(mask)).numpy()
        got = session.run(None, {"x": x, "key_padding_mask": mask})[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    for built in [*build_wavlm(), *build_mha(), build_mha_no_weights()]:
        print(built, built.stat().st_size, "bytes")
