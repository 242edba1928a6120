"""Build a half-precision GPT-OSS under ``tests/models/heldout/`` (``tests/passes/test_heldout_fp16_sinks.py``).

Run ``python -m tests.models.build_heldout_fp16_sinks`` (needs torch and transformers); the .onnx file is committed
so the tests need neither. ``gpt_oss_fp16_ts.onnx``: transformers' ``GptOssForCausalLM`` (2 layers, hidden 32, 4
heads of 16, 2 KV heads, a 64-key window on layer 1 then global attention, 4 experts top-2 with ``batched_mm``,
vocabulary 128), ``model.half()``, ``(input_ids, attention_mask) -> logits`` without a cache, exported by the
TorchScript exporter (opset 17), weights perturbed, checked against torch at other shapes.
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

PATH = Path(__file__).resolve().parent / "heldout" / "gpt_oss_fp16_ts.onnx"
NAMES = ("input_ids", "attention_mask")
VOCAB = 128


def feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(3, VOCAB, (batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, seq), np.int64),
    }


def build() -> Path:
    import onnxruntime as ort
    import torch
    import transformers as tf

    from bench.heldout_detection import _perturb

    torch.manual_seed(0)
    config = tf.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        experts_implementation="batched_mm", layer_types=["sliding_attention", "full_attention"], sliding_window=64,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False,
    )  # fmt: skip

    class LanguageModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = tf.GptOssForCausalLM(config)

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).logits

    module = LanguageModel()
    _perturb(module)
    module = module.half().eval()
    example = tuple(torch.from_numpy(v) for v in feeds(2, 7).values())
    axes = {name: {0: "batch", 1: "sequence"} for name in (*NAMES, "logits")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, example, str(PATH), opset_version=17, dynamo=False, input_names=list(NAMES),
                          output_names=["logits"], dynamic_axes=axes)  # fmt: skip
    onnx.save(_strip(onnx.load(str(PATH)), {"source": "tests/models/build_heldout_fp16_sinks.py"}), str(PATH))
    session = ort.InferenceSession(str(PATH), providers=["CPUExecutionProvider"])
    for batch, seq in ((1, 5), (3, 11)):
        feed = feeds(batch, seq, seed=batch)
        with torch.no_grad():
            want = module(*(torch.from_numpy(v) for v in feed.values())).float().numpy()
        got = session.run(None, feed)[0].astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2, err_msg=str(PATH))
    return PATH


if __name__ == "__main__":
    built = build()
    print(built, built.stat().st_size, "bytes")
