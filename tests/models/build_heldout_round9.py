"""Copy held-out probe round 9's exports the regression tests read into ``tests/models/heldout/``.

Run ``python -m tests.models.build_heldout_round9 [NAME ...]`` (needs torch and transformers): each model is made
and exported as ``bench/heldout_round9.py`` makes it (TorchScript opset 17 and dynamo opset 18, weights perturbed,
checked against torch at two other batches), its per-node metadata stripped; the .onnx files are committed so the
tests need neither. Default: ``conditional_detr`` (``tests/passes/test_heldout_conditional_detr.py``).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import onnx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.models.corpus import _strip  # noqa: E402

DIR = Path(__file__).resolve().parent / "heldout"
DEFAULT = ("conditional_detr",)


def build(names: tuple[str, ...] = DEFAULT) -> list[Path]:
    from bench._torch_export import build_models
    from bench.heldout_round4 import built
    from bench.heldout_round9 import _models

    paths = []
    with tempfile.TemporaryDirectory() as tmp:
        build_models(built(_models(), list(names)), Path(tmp), list(names))
        for exported in sorted(Path(tmp).glob("*.onnx")):
            path = DIR / exported.name
            meta = {"source": f"tests/models/build_heldout_round9.py ({exported.stem}, bench/heldout_round9.py)"}
            onnx.save(_strip(onnx.load(str(exported)), meta), str(path))
            paths.append(path)
    return paths


if __name__ == "__main__":
    for made in build(tuple(sys.argv[1:]) or DEFAULT):
        print(made, made.stat().st_size, "bytes")
