"""Build a multimodal-rope decoder's language model under ``tests/models/heldout/`` (``tests/passes/
test_heldout_mrope_positions.py``).

Run ``python -m tests.models.build_heldout_mrope [STEM ...]`` (needs torch and transformers; every family by
default); the .onnx files are committed so the tests need neither. ``qwen25vl_text_{ts,dynamo}.onnx``: transformers'
``Qwen2_5_VLTextModel`` (2 layers, hidden 32, 4 heads of 8, 2 KV heads, M-RoPE sections 1/2/1) with a bias-free LM
head, ``(input_ids [batch, sequence], attention_mask [batch, sequence], position_ids [3, batch, sequence]) ->
logits``, as Qwen2.5-VL's language model takes them (one row of positions per rope section: time, height, width);
``qwen3vl_text_{ts,dynamo}.onnx``: the same shape of ``Qwen3VLTextModel``, whose sections interleave across the
frequencies; ``glm4v_text_dynamo.onnx``: ``Glm4vTextModel``, pairs rotated over half the head with sections 1/1/0
(dynamo only: torch cannot export it by TorchScript). Exported by the TorchScript exporter (opset 17) and dynamo
(opset 18), weights perturbed, checked against torch at other shapes with positions that differ per section.
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
NAMES = ("input_ids", "attention_mask", "position_ids")
VOCAB = 256


def mrope_feeds(
    batch: int, seq: int, seed: int = 0, vocab: int = VOCAB, *, grid: bool = False
) -> dict[str, np.ndarray]:
    """Ids, a full mask and positions whose height and width rows run ahead of the time row (an image's patches);
    with ``grid``, height and width drawn per token instead (a shift of a whole row leaves a rope's relative
    angles, and so the outputs, as they were: only positions that differ per token tell the sections apart)."""
    rng = np.random.default_rng(seed)
    positions = np.broadcast_to(np.arange(seq), (3, batch, seq)).copy()
    positions[1] += 1
    positions[2] += 2
    if grid:
        positions[1:] = rng.integers(0, 2 * seq, (2, batch, seq))
    return {
        "input_ids": rng.integers(3, vocab, (batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, seq), np.int64),
        "position_ids": positions.astype(np.int64),
    }


# stem: (config class, model class, config settings). Qwen3-VL interleaves the sections across the frequencies.
FAMILIES = {
    "qwen25vl_text": (
        "Qwen2_5_VLTextConfig", "Qwen2_5_VLTextModel", {"rope_scaling": {"type": "mrope", "mrope_section": [1, 2, 1]}}
    ),
    "qwen3vl_text": (
        "Qwen3VLTextConfig", "Qwen3VLTextModel",
        {"head_dim": 8, "rope_scaling": {"rope_type": "default", "mrope_section": [1, 2, 1]}},
    ),
    # pairs rotated (interleaved) over half the head; torch's TorchScript export of it fails ("All tensors must
    # have the same rank"), so dynamo only
    "glm4v_text": (
        "Glm4vTextConfig", "Glm4vTextModel",
        {"partial_rotary_factor": 0.5, "rope_scaling": {"type": "default", "mrope_section": [1, 1, 0]}},
    ),
}  # fmt: skip
EXPORTERS = {"glm4v_text": ("dynamo",)}


def build() -> list[Path]:
    return [path for stem in FAMILIES for path in build_family(stem)]


def build_family(stem: str) -> list[Path]:
    import onnxruntime as ort
    import torch
    import transformers as tf

    from bench.heldout_detection import _perturb

    torch.manual_seed(0)
    config_class, model_class, settings = FAMILIES[stem]
    config = getattr(tf, config_class)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, **settings,
    )  # fmt: skip

    class LanguageModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = getattr(tf, model_class)(config)
            self.head = torch.nn.Linear(32, VOCAB, bias=False)

        def forward(self, input_ids, attention_mask, position_ids):
            hidden = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
            return self.head(hidden.last_hidden_state)

    module = LanguageModel()
    _perturb(module)
    module.eval()
    example = tuple(torch.from_numpy(v) for v in mrope_feeds(2, 7).values())
    paths = []
    for tag in EXPORTERS.get(stem, ("ts", "dynamo")):
        path = DIR / f"{stem}_{tag}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if tag == "ts":
                axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
                        "position_ids": {1: "batch", 2: "sequence"}, "logits": {0: "batch", 1: "sequence"}}  # fmt: skip
                torch.onnx.export(module, example, str(path), opset_version=17, dynamo=False, input_names=list(NAMES),
                                  output_names=["logits"], dynamic_axes=axes)  # fmt: skip
                proto = onnx.load(str(path))
            else:
                batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("sequence", min=2, max=256)
                shapes = ({0: batch, 1: seq}, {0: batch, 1: seq}, {1: batch, 2: seq})
                program = torch.onnx.export(module, example, dynamo=True, opset_version=18, input_names=list(NAMES),
                                            output_names=["logits"], dynamic_shapes=shapes)  # fmt: skip
                proto = program.model_proto
        onnx.save(_strip(proto, {"source": "tests/models/build_heldout_mrope.py"}), str(path))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for batch, seq in ((1, 5), (3, 11)):
            feeds = mrope_feeds(batch, seq, seed=batch, grid=True)
            with torch.no_grad():
                want = module(*(torch.from_numpy(v) for v in feeds.values())).numpy()
            np.testing.assert_allclose(session.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5, err_msg=str(path))
        paths.append(path)
    return paths


if __name__ == "__main__":
    for built in [path for stem in sys.argv[1:] for path in build_family(stem)] if sys.argv[1:] else build():
        print(built, built.stat().st_size, "bytes")
