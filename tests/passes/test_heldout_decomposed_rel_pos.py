"""ViTDet's attention fuses (issue 17, held-out probe round 7: 0/2 under both exporters).

ViTDet, like SAM's image encoder, cuts q, k and v from a folded qkv (``qkv.reshape(3, B*h, S, d).unbind(0)``),
scales q before the product, adds its decomposed relative positions on a 5-D view of the folded scores
(``Reshape(Add(Add(Reshape(s, [B*h, qh, qw, kh, kw]), Unsqueeze(rh, -1)), Unsqueeze(rw, -2)), [B*h, S, S])``)
and views ``probs @ v`` as ``[B, h, H, W, d]``. Now the two terms are one bias of the scores' shape
(``_softmax_forms.decomposed_rel_pos``), the fold follows the cut (``_batched_heads.fold_after_cut``), and the
folded-heads unfold takes a biased product and a 5-D view (``_batched_heads``): MultiHeadAttention with the
relative positions as its bias, in the window block and the global one.

``tests/models/heldout/vitdet_{ts,dynamo}.onnx``: ``python -m bench.heldout_round7 build vitdet`` (2 blocks,
hidden 32, 2 heads, 32 x 32 images in 4 x 4 patches, a window of 4 on block 0; TorchScript cuts with a Split,
dynamo with Slices). Compared with the original under ORT, graph optimizations off, at batches other than the
export's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import PassContext, op_histogram
from passes.fusion import _softmax_forms
from passes.fusion.fuse_transformer import FuseTransformer
from tests.numerics import assert_equivalent
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import parse, session

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "heldout"


def _images(batch: int, seed: int) -> dict[str, np.ndarray]:
    return {"pixel_values": np.random.default_rng(seed).standard_normal((batch, 3, 32, 32)).astype(np.float32)}


@pytest.mark.parametrize("stem", ["vitdet_ts", "vitdet_dynamo"])
def test_both_blocks_fuse_with_their_relative_positions_as_bias(stem: str) -> None:
    path = HELDOUT / f"{stem}.onnx"
    model, _ = fast_upto(path)
    samples = [_images(batch, batch) for batch in (1, 2)]
    result = FuseTransformer({"engines": ["onnxscript"]})(model, PassContext(samples=samples))
    ops = op_histogram(result.model)
    assert result.counts["fused_attention"] == 2 and ops["com.microsoft::MultiHeadAttention"] == 2
    assert "Softmax" not in ops and "attention" not in result.notes.get("missing", {})
    for node in result.model.graph:
        if node.op_type == "MultiHeadAttention":
            assert len(node.inputs) > 5 and node.inputs[5] is not None  # attention_bias: the relative positions
    shapes = [{"pixel_values": (batch, 3, 32, 32)} for batch in (1, 3)]
    assert_equivalent(path, result.model, shapes, rtol=1e-4, atol=1e-5, n_random=0)


REL_POS = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[N, 16, 16] s, float[N, 4, 4, 4] rh, float[N, 4, 4, 4] rw) => (float[N, 16, 16] p)
  <int64[5] view = {-1, 4, 4, 4, 4}, int64[3] back = {-1, 16, 16}, int64[1] h_axis = {%d}, int64[1] w_axis = {%d}> {
    v = Reshape(s, view)
    h = Unsqueeze(rh, h_axis)
    w = Unsqueeze(rw, w_axis)
    a = Add(v, h)
    b = Add(a, w)
    f = Reshape(b, back)
    p = Softmax <axis = -1> (f)
}
"""


@pytest.mark.parametrize(("h_axis", "w_axis", "rewritten"), [(4, 3, 1), (-1, -2, 1), (3, 4, 1), (2, 3, 0)])
def test_the_terms_become_one_bias_only_when_they_are_a_height_and_a_width_term(h_axis, w_axis, rewritten) -> None:
    model = ir.serde.deserialize_model(parse(REL_POS % (h_axis, w_axis)))
    feeds = {
        "s": np.random.default_rng(0).standard_normal((3, 16, 16)).astype(np.float32),
        "rh": np.random.default_rng(1).standard_normal((3, 4, 4, 4)).astype(np.float32),
        "rw": np.random.default_rng(2).standard_normal((3, 4, 4, 4)).astype(np.float32),
    }
    want = session(model).run(None, feeds)[0]
    # (3, 4): the terms in the other order, the same sum; (2, 3): a term broadcast over the query rows, not keys
    assert _softmax_forms.decomposed_rel_pos(model) == rewritten
    if rewritten:
        assert [n.op_type for n in model.graph].count("Reshape") == 1  # the scores' 5-D view is gone
    np.testing.assert_allclose(session(model).run(None, feeds)[0], want, rtol=1e-5, atol=1e-6)
