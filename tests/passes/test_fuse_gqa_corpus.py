"""fuse_gqa on the coverage corpus's own exports (tests/models/corpus), whose attention comes from torch's SDPA
decomposition under the dynamo exporter: the probabilities pass a NaN guard ``Where(IsNaN(p), 0, p)`` and the
keys are transposed batched (``Reshape(Transpose(0,2,1)(Reshape(k, [B*H, S, D])))``). Both forms fused, exactly
(ORT, graph optimizations off, prompts of other lengths and batches than the export's); an encoder whose
inputs a decoder probe cannot feed is declined before any run."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_gqa import FuseGqa
from tests.passes._util import MODELS
from tests.passes.test_fuse_gqa import ATOL, run, session

CORPUS = MODELS / "corpus"


def feeds(model: ir.Model, vocab: int, batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * 100 + seq)
    out: dict[str, np.ndarray] = {}
    for value in model.graph.inputs:
        if "mask" in value.name:
            out[value.name] = np.ones((batch, seq), np.int64)
        elif "position" in value.name:
            out[value.name] = np.broadcast_to(np.arange(seq), (batch, seq)).astype(np.int64)
        else:
            out[value.name] = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
    return out


@pytest.mark.parametrize("name", ["llama_dynamo", "gpt2_dynamo", "clip_text_dynamo", "llama_ts_eager"])
def test_fuse_gqa_fuses_sdpa_decomposition_exactly_when_nan_guard_and_batched_key_transpose(name):
    # setup
    dims = json.loads((CORPUS / f"{name}.json").read_text())["dims"]
    original = session(str(CORPUS / f"{name}.onnx"))
    model = ir.load(CORPUS / f"{name}.onnx")
    assert "IsNaN" in op_histogram(model) or name.endswith("ts_eager")
    # execute
    result = FuseGqa()(model, PassContext())
    # assert
    ops = op_histogram(result.model)
    assert result.modified and not result.non_matches
    assert result.counts["fused_gqa"] + result.counts["fused_mha"] == dims["layers"]
    assert "Softmax" not in ops and "IsNaN" not in ops
    fused = session(result.model)
    for batch, seq in ((1, 5), (2, 13), (1, 40)):
        feed = feeds(model, dims["vocab"], batch, seq)
        want, got = run(original, feed), run(fused, feed)
        for key, expected in want.items():
            np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=f"{key} at {batch}x{seq}")


def test_fuse_gqa_declines_before_any_run_when_an_input_is_not_a_decoders():
    # setup: BERT takes token types, which no decoder LLM does
    model = ir.load(CORPUS / "bert_ts_eager.onnx")
    before = op_histogram(model)
    # execute
    result = FuseGqa()(model, PassContext())
    # assert
    assert not result.modified and op_histogram(result.model) == before
    assert any("token_type_ids" in m.reason and "cannot feed" in m.reason for m in result.non_matches)
