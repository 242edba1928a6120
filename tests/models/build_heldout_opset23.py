"""Build torch's opset-23 exports under ``tests/models/heldout/`` (``tests/passes/test_opset23_exports.py``).

Run ``python -m tests.models.build_heldout_opset23`` (needs torch and transformers); the .onnx files are
committed so the tests need neither. At opset 23, torch's dynamo exporter writes ONNX's own ``Attention``,
``RMSNormalization``, ``RotaryEmbedding`` and ``Gelu`` ops for what it decomposes at opset 18:

* ``bert_op23_dynamo.onnx``: ``BertModel`` (2 layers, hidden 32, 2 heads, SDPA), ``input_ids`` and
  ``attention_mask`` -> ``last_hidden_state``.
* ``llama_op23_dynamo.onnx``: ``LlamaForCausalLM`` without a cache (2 layers, hidden 32, 4 heads / 2 KV heads,
  SDPA), ids and mask -> logits. It runs at batch 1 only under ONNX Runtime: the rotary cos/sin caches keep the
  example's batch of 1, which ONNX's ``RotaryEmbedding`` must match to its input's batch (checked below).
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
VOCAB = 96


def feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(3, VOCAB, (batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, seq), np.int64),
    }


def build() -> list[Path]:
    import onnxruntime as ort
    import torch
    import transformers as tf

    from bench.heldout_detection import _perturb

    torch.manual_seed(0)

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = tf.BertModel(tf.BertConfig(
                vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=128, attn_implementation="sdpa",
            ))  # fmt: skip

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = tf.LlamaForCausalLM(tf.LlamaConfig(
                vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, max_position_embeddings=128, attn_implementation="sdpa",
            ))  # fmt: skip

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("sequence", min=1, max=128)
    paths = []
    for stem, module, batches in (("bert", Encoder(), (1, 3)), ("llama", Decoder(), (1,))):
        _perturb(module)
        module.eval()
        example = tuple(torch.from_numpy(v) for v in feeds(2, 9).values())
        path = DIR / f"{stem}_op23_dynamo.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(module, example, dynamo=True, opset_version=23,
                                        input_names=["input_ids", "attention_mask"], output_names=["out"],
                                        dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))  # fmt: skip
        onnx.save(_strip(program.model_proto, {"source": "tests/models/build_heldout_opset23.py"}), str(path))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for rows in batches:
            feed = feeds(rows, 7, seed=rows)
            with torch.no_grad():
                want = module(*(torch.from_numpy(v) for v in feed.values())).numpy()
            np.testing.assert_allclose(session.run(None, feed)[0], want, rtol=1e-4, atol=1e-5, err_msg=str(path))
        paths.append(path)
    return paths


if __name__ == "__main__":
    for built in build():
        print(built, built.stat().st_size, "bytes")
