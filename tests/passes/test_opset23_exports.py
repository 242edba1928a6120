"""torch's opset-23 exports go through ``fast`` (issue 17: exports as users make them today).

At opset 23 torch writes ONNX's own ``Attention``, ``RMSNormalization`` and ``RotaryEmbedding``. Before: the
Llama export failed before any pass ("the original model fails on input set ...": ONNX Runtime runs it at batch 1
only, its rotary caches keeping the example's batch), and ``fuse_transformer`` read no family in it ("no
LayerNormalization: not a LayerNorm transformer") and expected no attention in either export. Now the input
sets fall back to one row, the exporter's ``Attention`` ops count as attention fused, and the residual norms
left unfused are named as the ``RMSNormalization`` ops onnxscript's skip-norm rule does not read. Exports from
``tests/models/build_heldout_opset23.py``; compared with the original under ORT, optimizations off.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from core.config import Tolerance
from core.inputs import generate_input_sets
from passes._infra import PassContext
from passes.fusion import _fusion_families as fam
from passes.fusion.fuse_transformer import FuseTransformer
from tests.models.build_heldout_opset23 import feeds
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import session
from workers.verify import Verifier

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "heldout"
LAYERS = 2


def test_the_llama_export_is_verified_on_one_row_per_set() -> None:
    path = HELDOUT / "llama_op23_dynamo.onnx"
    sets = generate_input_sets(onnx.load(str(path)), 3)
    Verifier(path, sets, Tolerance())
    assert [s.feeds["input_ids"].shape[0] for s in sets] == [1, 1, 1]
    assert len({s.feeds["input_ids"].shape[1] for s in sets}) == 3
    assert "RotaryEmbedding" in sets[1].provenance["attempts"][0]["error"]


def test_the_exporters_attention_counts_as_fused_and_its_rms_norms_are_named() -> None:
    path = HELDOUT / "llama_op23_dynamo.onnx"
    model, _ = fast_upto(path)
    assert fam.detect_family(model)[0] == "llama"
    samples = [feeds(1, n, seed=n) for n in (5, 9)]  # one row: the engine's sets after its fallback
    result = FuseTransformer({"engines": ["onnxscript"]})(model, PassContext(samples=samples))
    notes = result.notes
    assert notes["expected"]["attention"] == LAYERS and notes["achieved"]["attention"] == LAYERS
    assert "attention" not in notes["missing"]
    assert "ONNX RMSNormalization ops (opset 23" in notes["missing"]["skip_layer_norm"]
    reference, fused = session(ir.load(path)), session(result.model)
    for n in (3, 17):
        feed = feeds(1, n, seed=n)
        np.testing.assert_allclose(fused.run(None, feed)[0], reference.run(None, feed)[0], rtol=1e-4, atol=1e-4)


def test_the_bert_export_expects_and_finds_its_attention() -> None:
    path = HELDOUT / "bert_op23_dynamo.onnx"
    model, _ = fast_upto(path)
    result = FuseTransformer({"engines": ["onnxscript"]})(model)
    assert result.notes["expected"]["attention"] == LAYERS == result.notes["achieved"]["attention"]
    assert "attention" not in result.notes["missing"]
    reference, fused = session(ir.load(path)), session(result.model)
    for batch, n in ((1, 4), (3, 21)):
        feed = feeds(batch, n, seed=n)
        np.testing.assert_allclose(fused.run(None, feed)[0], reference.run(None, feed)[0], rtol=1e-4, atol=1e-4)
