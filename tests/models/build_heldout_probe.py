"""Copy a held-out probe's exports the regression tests read into ``tests/models/heldout/``.

Run ``python -m tests.models.build_heldout_probe ROUND NAME [NAME ...]`` (needs torch and transformers), ROUND
the probe module under ``bench/`` (``heldout_round11``): each model is made and exported as that probe makes it
(TorchScript opset 17 and dynamo opset 18, weights perturbed, checked against torch at two other batches), its
per-node metadata stripped; the .onnx files are committed so the tests need neither. Made so far:

* ``heldout_round9 conditional_detr`` (``tests/passes/test_heldout_conditional_detr.py``);
* ``heldout_round11 fsmt`` (``tests/passes/test_fuse_3d_heads.py``: fairseq's attention);
* ``heldout_round16 timesfm`` and ``timesfm2_5`` (``tests/passes/test_fuse_query_scale.py``: a query scaled per head
  dimension, before and after its rope; ``tests/workers/test_heldout_timesfm2_5.py``: rotary positions below 0);
* ``heldout_dec_round9 openai_privacy_filter`` (``tests/passes/test_fuse_rotary_stacked_pairs.py``): a decoder
  round's model without a cache, at hidden 32 with heads of 8 and the no-cache probe's vocabulary (its cached
  form at these dims is the round's own ``--tiny``);
* ``heldout_round19 sam`` (``tests/passes/test_heldout_sam_prompts.py``; its TorchScript export only);
* ``heldout_round18 musicgen`` (``tests/workers/test_heldout_musicgen.py``): ids of several codebooks in one input;
* ``heldout_dec_round10 inkling2`` (``tests/passes/test_heldout_inkling_attention.py``): per-token sinks and
  attention over the layer blocks.
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

import onnx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.models.corpus import _strip  # noqa: E402

DIR = Path(__file__).resolve().parent / "heldout"


def _decoders(probe: str, names: tuple[str, ...], out: Path) -> None:
    import dataclasses

    from bench import heldout_dec_nocache as nocache
    from bench.heldout_dec_round2 import SPECS

    importlib.import_module(f"bench.{probe}")  # registers its models
    tiny = {"hidden_size": 32, "intermediate_size": 64, "vocab_size": nocache.VOCAB, "head_dim": 8}
    specs = {n: dataclasses.replace(SPECS[n], kwargs={**SPECS[n].kwargs, **tiny}) for n in names}
    for name in names:
        for exporter in ("ts_eager", "dynamo"):
            info = nocache.build(name, exporter, out, specs, f"bench.{probe}")
            if not info.get("ok"):
                sys.exit(f"{name} {exporter}: {info.get('error')}")


def build(probe: str, names: tuple[str, ...]) -> list[Path]:
    paths = []
    with tempfile.TemporaryDirectory() as tmp:
        if probe.startswith("heldout_dec_"):
            _decoders(probe, names, Path(tmp))
        else:
            from bench._torch_export import build_models
            from bench.heldout_round4 import built

            models = importlib.import_module(f"bench.{probe}")._models
            build_models(built(models(), list(names)), Path(tmp), list(names))
        for exported in sorted(Path(tmp).glob("*.onnx")):
            path = DIR / exported.name
            meta = {"source": f"tests/models/build_heldout_probe.py ({exported.stem}, bench/{probe}.py)"}
            onnx.save(_strip(onnx.load(str(exported)), meta), str(path))
            paths.append(path)
    return paths


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python -m tests.models.build_heldout_probe ROUND NAME [NAME ...]")
    for made in build(sys.argv[1], tuple(sys.argv[2:])):
        print(made, made.stat().st_size, "bytes")
