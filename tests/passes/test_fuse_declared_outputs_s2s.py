"""fuse_transformer and constant_folding keep the outputs a seq2seq decoder declares (issue 19 item 1).

TorchScript declares Whisper's ``decoder_model.onnx`` presents as [batch_size, Concatpresent.0.decoder.key_dim_1,
decoder_sequence_length, Concatpresent.0.decoder.key_dim_3]: its placeholder names for the head count and head
size it did not infer. ONNX's shape inference, run on each candidate after its declarations were restored,
resolved them to 4 and 8, and the job's ledger rolled fuse_transformer back for making declared axes static: 0
of 4 attentions fused on the corpus Whisper TorchScript decoder under ``fast`` (found by
``python -m bench.heldout_s2s_past --only whisper --exporters ts``). onnxscript's constant folder, whose shape
propagation writes onto the graph's outputs, did the same, and constant_folding was rolled back on every job.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from passes import registry
from passes._infra import PassContext, op_histogram
from tests.models.build_seq2seq import ARCHS, seq2seq_feeds
from tests.passes._util import session

MODEL = Path(__file__).resolve().parent.parent / "models" / "seq2seq" / "whisper" / "decoder_model.onnx"


def _dims(values) -> dict[str, list]:
    return {v.name: list(v.shape) if v.shape is not None else None for v in values}


@pytest.fixture(scope="module")
def fused() -> ir.Model:
    (spec,) = [s for s in registry.PRESETS["fast"].specs if s.name == "fuse_transformer"]
    (fuse,) = registry.build_passes([spec])
    return fuse(ir.load(MODEL), PassContext()).model


def test_attention_fuses_and_every_declared_output_dim_is_kept(fused) -> None:
    upload = ir.load(MODEL)
    assert any(isinstance(d, ir.SymbolicDim) and "_dim_1" in str(d) for d in upload.graph.outputs[1].shape)
    assert _dims(fused.graph.outputs) == _dims(upload.graph.outputs)
    assert op_histogram(fused)["com.microsoft::MultiHeadAttention"] == 2 * ARCHS["whisper"].layers
    onnx.checker.check_model(ir.serde.serialize_model(fused), full_check=True)


def test_fused_decoder_computes_what_the_export_does(fused) -> None:
    reference, candidate = session(MODEL), session(fused, optimized=True)
    names = [o.name for o in reference.get_outputs()]
    for seed, (batch, dec, enc) in enumerate(((1, 1, 7), (3, 5, 11)), start=1):
        feeds = seq2seq_feeds(ARCHS["whisper"], "decoder", batch, dec=dec, enc=enc, seed=seed)
        for name, want, got in zip(names, reference.run(names, feeds), candidate.run(names, feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{name} at {batch}x{dec}x{enc}")


def test_constant_folding_keeps_every_declared_output_dim() -> None:
    specs = registry.PRESETS["fast"].specs
    upto = specs[: [s.name for s in specs].index("constant_folding") + 1]  # shape_inference annotates first
    upload, model, counts = ir.load(MODEL), ir.load(MODEL), {}
    for p in registry.build_passes(upto):
        result = p(model, PassContext())
        model, counts = result.model, result.counts
    assert counts["nodes_removed"] > 0
    assert _dims(model.graph.outputs) == _dims(upload.graph.outputs)
    assert counts.get("io_declarations_restored", 0) > 0  # the folder had resolved them
    assert _dims(model.graph.inputs) == _dims(upload.graph.inputs)
