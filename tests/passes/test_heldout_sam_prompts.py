"""SAM end to end, prompted by points, exported by TorchScript: every attention fuses (issue 17, held-out round 19:
4/6 before).

The image encoder's windowed attention computes its SDPA scale from the query's run-time head size,
``sqrt(1 / sqrt(Shape(q)[-1:]))`` on q and on k^T, the query reshaped by ``Concat(windows, 4, 4, -1)``: ONNX's
inference leaves that head size unknown, the constant folding before the pass had nothing to fold, and the SDPA
rule refused the computed scale ("query_scale is not a scalar"). fuse_transformer folds the sizes its symbolic
shape inference knows (``_batched_heads.fold_static_sizes``) in every model now, not only after unfolding
batched heads.

``tests/models/heldout/sam_ts.onnx``: ``python -m tests.models.build_heldout_probe heldout_round19 sam`` (a 64-pixel
image in 16-pixel patches, windows of 2 x 2 patches and a global block, a mask decoder of 1 layer; inputs
``pixel_values``, ``input_points [batch, 1, 2, 2]`` and ``input_labels [batch, 1, 2]``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import session

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "heldout"


def test_sams_windowed_attention_fuses_once_its_computed_scale_is_folded() -> None:
    path = HELDOUT / "sam_ts.onnx"
    before, _ = fast_upto(path, through="fuse_gqa")
    result = FuseTransformer()(before, PassContext())
    assert result.counts["fused_attention"] == 6, result.non_matches
    assert result.notes["candidates"]["onnxscript"]["static_sizes"] > 0
    assert op_histogram(result.model)["Softmax"] == 0
    reference, candidate = session(path), session(result.model, optimized=True)
    rng = np.random.default_rng(0)
    for batch in (1, 3):
        feeds = {
            "pixel_values": rng.standard_normal((batch, 3, 64, 64)).astype(np.float32),
            "input_points": (rng.random((batch, 1, 2, 2)) * 64).astype(np.float32),
            "input_labels": rng.integers(0, 2, (batch, 1, 2)).astype(np.int64),
        }
        np.testing.assert_allclose(
            candidate.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-5, err_msg=str(batch)
        )
