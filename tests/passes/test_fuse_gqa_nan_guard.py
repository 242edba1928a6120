"""A batch row whose attention mask is all zeros: fuse_gqa's fused model neither fails nor returns NaN.

TorchScript's SDPA export writes ``Where(IsNaN(p), 0, p)`` after the Softmax, so a query whose every key is
masked with -inf gives 0, not NaN. ``_gqa_match`` reads the probabilities through that guard; ORT's
MultiHeadAttention returns NaN for such a query, and the next layer's ``probs @ V`` spread it to the row's
every output (CLIP's text tower under `fast`, found by bench/mha_padding_mask.py): the fused layer's output
now gets the guard back. GroupQueryAttention refused the whole batch instead (``seqlens_k[1] = -1 is out of
range``): the row's length is now clamped at 0, so it attends to its first key. Such a row's values mean
nothing (the export's own differ by exporter: 0 under SDPA, an average of every key under eager attention),
so it is checked finite; every other row equal to the original under ORT, optimizations off. CLIP's text
tower (causal self-attention with padding) fuses as GroupQueryAttention without samples and as
MultiHeadAttention with the job's padded input sets.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from core.inputs import generate_input_sets
from passes._infra import PassContext, op_histogram
from passes.fusion import _nan_guard as nan_guard
from passes.fusion.fuse_gqa import FuseGqa
from tests.passes._util import MODELS, session

CORPUS = MODELS / "corpus"
VOCAB = 384  # tests/models/_corpus_specs.py, tiny


def _feeds(batch: int, seq: int, valid: list[int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    mask = (np.arange(seq)[None, :] < np.array(valid)[:, None]).astype(np.int64)
    ids = rng.integers(5, VOCAB, size=(batch, seq)).astype(np.int64)
    for row, n in enumerate(valid):
        if n:
            ids[row, n - 1] = 2  # CLIP pools at the EOS position
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("op", ["gqa", "mha"])
@pytest.mark.parametrize("exporter", ["ts_sdpa", "ts_eager", "dynamo"])
def test_clip_text_empty_row_stays_finite_and_other_rows_exact_after_fuse_gqa(exporter: str, op: str) -> None:
    path = CORPUS / f"clip_text_{exporter}.onnx"
    model = ir.load(path)
    guards_before = nan_guard.count_guards(model)
    # the job's own sets are padded, which GroupQueryAttention's right-aligned lengths cannot take
    ctx = PassContext(samples=[s.feeds for s in generate_input_sets(onnx.load(path), 3)]) if op == "mha" else None
    result = FuseGqa()(model, ctx) if ctx is not None else FuseGqa()(model)
    assert result.counts[f"fused_{op}"] == 2, result.counts
    ops = op_histogram(result.model)
    if op == "mha":  # each guard the export wrote is on the fused output now
        assert ops.get("com.microsoft::MultiHeadAttention") == 2
        assert nan_guard.count_guards(result.model) == 0 and ops.get("IsNaN", 0) == guards_before
    reference, fused = session(str(path)), session(result.model)
    rng = np.random.default_rng(0)
    for batch, seq, valid in ((2, 9, [9, 0]), (3, 17, [17, 5, 0]), (1, 6, [6])):
        feeds = _feeds(batch, seq, valid, rng)
        kept = [row for row, n in enumerate(valid) if n]
        for want, got in zip(reference.run(None, feeds), fused.run(None, feeds), strict=True):
            assert np.isfinite(got).all(), f"{exporter} {batch}x{seq} {valid}"
            np.testing.assert_allclose(got[kept], want[kept], rtol=1e-4, atol=1e-4, err_msg=f"{batch}x{seq}")
