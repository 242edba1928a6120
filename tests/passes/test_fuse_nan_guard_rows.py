"""Fully masked attention rows stay zero when fuse_transformer fuses a NaN-guarded SDPA (issue 17, held-out probe).

TorchScript's ``scaled_dot_product_attention`` masks with ``Where(mask, 0, -inf)`` and zeroes a NaN Softmax row
(``Where(IsNaN(p), 0, p)``); onnxscript's SDPA rule drops that guard, and ``MultiHeadAttention`` returns NaN for
a query whose every key is masked. ModernBERT's local layers do that for every padded query outside the valid
tokens' windows, and the NaN reached every token of the next layer through ``probs @ V``: its attention was
refused on verification (bench/heldout_text.py). BERT did the same on a row whose mask is all zeros. The
guard is now put back on the fused output. ``heldout_modernbert_ts_sdpa.onnx`` is ``python -m
bench.heldout_text --only modernbert --exporters ts_sdpa`` (2 layers, hidden 32, one global layer and one with
an 8-token window). Compared with the original under ORT with graph optimizations off.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, session

LAYERS = 2


def _feeds(batch: int, seq: int, valid: list[int], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, 256, size=(batch, seq), dtype=np.int64)
    mask = np.zeros((batch, seq), np.int64)
    for row, n in enumerate(valid):
        mask[row, :n] = 1
        ids[row, n:] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _fuse(name: str) -> tuple[ir.Model, dict]:
    result = FuseTransformer({"engines": ["onnxscript"]})(ir.load(MODELS / f"{name}.onnx"))
    return result.model, result.notes


def _assert_same(name: str, fused: ir.Model, cases: list[dict[str, np.ndarray]]) -> None:
    reference, candidate = session(str(MODELS / f"{name}.onnx")), session(fused)
    names = {i.name for i in reference.get_inputs()}
    for case in cases:
        feeds = {k: v for k, v in case.items() if k in names}
        want, got = reference.run(None, feeds)[0], candidate.run(None, feeds)[0]
        assert not np.isnan(want).any()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=str({k: v.shape for k, v in feeds.items()}))


def test_modernbert_sliding_window_attention_fuses_with_padded_queries_zeroed():
    name = "heldout_modernbert_ts_sdpa"
    fused, notes = _fuse(name)
    ops = op_histogram(fused)
    candidate = notes["candidates"]["onnxscript"]
    assert candidate["verified"] is True, candidate.get("error")
    assert notes["achieved"]["attention"] == LAYERS and ops["com.microsoft::MultiHeadAttention"] == LAYERS
    assert "Softmax" not in ops
    assert candidate["nan_guards"] == LAYERS and candidate["nan_guards_restored"] == LAYERS
    assert ops["IsNaN"] == LAYERS
    for node in fused.graph:  # each guard reads a fused attention's output
        if node.op_type == "IsNaN":
            assert node.inputs[0].producer().op_type == "MultiHeadAttention"
    # valid lengths far shorter than the sequence: the padded queries past length + window see no valid key
    cases = [_feeds(3, 23, [23, 16, 11], 1), _feeds(1, 5, [5], 2), _feeds(2, 40, [40, 3], 3), _feeds(2, 9, [9, 0], 4)]
    _assert_same(name, fused, cases)


def test_bert_sdpa_row_with_no_valid_token_stays_zero_after_fusion():
    name = "ts_bert_sdpa"
    fused, notes = _fuse(name)
    assert notes["achieved"]["attention"] == LAYERS
    assert notes["candidates"]["onnxscript"]["nan_guards_restored"] == LAYERS
    _assert_same(name, fused, [_feeds(3, 17, [17, 0, 6], 5), _feeds(2, 33, [0, 0], 6)])


@pytest.mark.parametrize("name", ["ts_bert_eager", "hf_bert_encoder"])
def test_no_guard_where_no_softmax_was_guarded(name):
    """Eager masks add a finite ``finfo.min`` and have no guard: nothing to restore, no op added."""
    fused, notes = _fuse(name)
    assert notes["achieved"]["attention"] == LAYERS
    assert notes["candidates"]["onnxscript"]["nan_guards_restored"] == 0
    assert "IsNaN" not in op_histogram(fused)
