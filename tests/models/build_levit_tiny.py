"""Build ``tests/models/levit_tiny_dynamo.onnx``: the held-out LeViT (bench/heldout_vision_audio.py) narrowed to
its smallest exportable form, dynamo opset 18, dynamic batch.

Run ``python -m tests.models.build_levit_tiny`` (needs torch and transformers); the .onnx is committed so
the tests that read it need neither. LeViT needs three stages (two subsampling attentions between them);
each is one block of hidden 16/24/32, key_dim 4, on a 32-pixel image: 5 attentions, as in the probe's.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import onnx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.heldout_vision_audio import SPECS, _export, _model, _wrapper, feeds  # noqa: E402
from tests.models.corpus import _strip  # noqa: E402

PATH = Path(__file__).resolve().parent / "levit_tiny_dynamo.onnx"
KWARGS = {
    "image_size": 32,
    "hidden_sizes": [16, 24, 32],
    "num_attention_heads": [2, 2, 2],
    "depths": [1, 1, 1],
    "key_dim": [4, 4, 4],
    "mlp_ratio": [2, 2, 2],
    "attention_ratio": [2, 2, 2],
}


def build(path: Path = PATH) -> onnx.ModelProto:
    spec = dataclasses.replace(SPECS["levit"], kwargs=KWARGS, image=32)
    wrapper = _wrapper(spec, _model(spec, "eager"))
    proto = _export(wrapper, spec, "dynamo", feeds(spec, 2, 0), path)
    proto = _strip(proto, {"source": "tests/models/build_levit_tiny.py"})
    onnx.save(proto, str(path))
    return proto


if __name__ == "__main__":
    model = build()
    print(PATH, PATH.stat().st_size, "bytes,", len(model.graph.node), "nodes")
