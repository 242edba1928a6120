"""DeBERTa (v1)'s disentangled attention fuses (issue 17: held-out probe round 2 found it 0/2 under both exporters).

DeBERTa v1 scales the query once and reads it twice, in the scores and in the content-to-position term added to
them; onnxscript's SDPA rule refused to replace a scaling another product reads, so no layer fused.
``passes/fusion/_shared_scale.py`` gives the scores a copy of the scaling, right before the SDPA rule; the
relative terms and the mask become the attention bias. The exports are the corpus's committed tiny
``deberta`` (``tests/models/corpus.py``: microsoft/deberta-base's attention at 2 layers). Compared with the
original under ORT with graph optimizations off, on shapes other than the export's, padded rows included.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from passes.fusion import _shared_scale as shared_scale
from passes.fusion.fuse_transformer import FuseTransformer
from tests.models import corpus
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import parse, session

LAYERS = 2


@pytest.mark.parametrize("exporter", ["ts_eager", "dynamo"])
def test_deberta_v1_attention_fuses_and_computes_the_same(exporter: str) -> None:
    path = corpus.committed_path("deberta", exporter)
    model, _ = fast_upto(path, through="fuse_gqa")  # the TorchScript scale is folded to a constant by then
    result = FuseTransformer({"engines": ["onnxscript"], "pack_qkv": True})(model)
    ops = op_histogram(result.model)
    assert result.notes["candidates"]["onnxscript"]["onnxscript_counts"]["scores_scale_copied"] == LAYERS
    assert result.counts["fused_attention"] == LAYERS and ops["com.microsoft::MultiHeadAttention"] == LAYERS
    assert "Softmax" not in ops and "attention" not in result.notes.get("missing", {})
    reference, fused = session(ir.load(path)), session(result.model)
    for batch, seq in ((1, 5), (2, 19), (3, 40)):
        feeds = corpus.feeds("deberta", "tiny", batch, seq, seed=seq, pad=True)
        for want, got in zip(reference.run(None, feeds), fused.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{exporter} {batch}x{seq}")


def test_the_scores_get_their_own_copy_of_a_scaling_another_product_reads() -> None:
    model = ir.serde.deserialize_model(
        parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[1,2,4,8] q, float[1,2,8,4] kt, float[1,2,8,4] pos, float[1,2,4,8] v) => (float[1,2,4,8] out) {
            scale = Constant <value = float {2.0}> ()
            qs = Div (q, scale)
            scores = MatMul (qs, kt)
            c2p = MatMul (qs, pos)
            biased = Add (scores, c2p)
            probs = Softmax <axis = -1> (biased)
            out = MatMul (probs, v)
        }
        """)
    )
    before = session(model)
    feeds = {name: np.random.default_rng(i).standard_normal(shape).astype(np.float32)
             for i, (name, shape) in enumerate({"q": (1, 2, 4, 8), "kt": (1, 2, 8, 4), "pos": (1, 2, 8, 4),
                                                "v": (1, 2, 4, 8)}.items())}  # fmt: skip
    want = before.run(None, feeds)[0]
    assert shared_scale.give_scores_their_own_scale(model) == 1
    divs = [n for n in model.graph if n.op_type == "Div"]
    assert len(divs) == 2 and all(len(d.outputs[0].uses()) == 1 for d in divs)  # one per product
    assert shared_scale.give_scores_their_own_scale(model) == 0  # nothing shared any more
    np.testing.assert_array_equal(session(model).run(None, feeds)[0], want)
