"""Inkling 2's attention, every layer left with its reason and the rest of fuse_transformer's candidate kept (issue
17, held-out decoder round 10).

Two kinds of attention, neither a kernel takes: the token attention's scores take a sink column computed per token
(``sink_proj(hidden)``: GroupQueryAttention's ``head_sink`` is one logit per head), and the block attention
residuals attend, at each token, over the stacked states of earlier blocks, an SDPA whose heads axis is the
input's sequence. onnxscript's SDPA rule fused the latter and nothing could lower it, so the onnxscript candidate
was refused whole ("ops outside stock ORT"); ORT's candidate crashed in its own simplified LayerNorm fusion, and
the report said only "'NodeProto' object is not subscriptable".

``tests/models/heldout/inkling2_{ts_eager,dynamo}.onnx``: ``python -m tests.models.build_heldout_probe
heldout_dec_round10 inkling2`` (2 layers, hidden 32, 4 heads of 8, 2 kv heads, no cache).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from passes._infra import PassContext
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import session

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "heldout"


@pytest.fixture(scope="module", params=["ts_eager", "dynamo"])
def fused(request):
    path = HELDOUT / f"inkling2_{request.param}.onnx"
    before, _ = fast_upto(path, through="fuse_gqa")
    return path, FuseTransformer()(before, PassContext())


def test_each_attention_is_named_with_why_no_kernel_takes_it(fused) -> None:
    _, result = fused
    reasons = [m.reason for m in result.non_matches]
    assert not any("candidate onnxscript rejected" in r for r in reasons), reasons
    per_layer = [r for r in reasons if r.startswith("attention: attention layer")]
    assert len(per_layer) == 6
    assert sum("attention sink as a softmax column computed per token" in r for r in per_layer) == 2
    assert sum("heads axis is the input's 'sequence' axis" in r for r in per_layer) == 4
    ort = [r for r in reasons if r.startswith("candidate ort rejected: TypeError")]
    assert all("(raised at " in r for r in ort)  # ORT's own crash, located


def test_the_candidate_computes_what_the_export_does(fused) -> None:
    path, result = fused
    reference, candidate = session(path), session(result.model, optimized=True)
    rng = np.random.default_rng(0)
    for batch, seq in ((1, 3), (2, 17), (3, 40)):
        mask = np.ones((batch, seq), np.int64)
        mask[-1, seq // 2 :] = 0 if batch > 1 else 1
        feeds = {"input_ids": rng.integers(5, 250, (batch, seq)).astype(np.int64), "attention_mask": mask}
        np.testing.assert_allclose(
            candidate.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-5, err_msg=f"{batch}x{seq}"
        )
