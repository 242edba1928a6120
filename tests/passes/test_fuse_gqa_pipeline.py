"""A `fast` job on a corpus decoder with no samples: the pipeline's own generated input sets (core.inputs) are
ones GroupQueryAttention can be verified on (unpadded; prefill on an empty past with batch 2; decode of one
token per row with batch 4 on a past of 32; a batch-1 prompt after a past), so every attention layer becomes
GroupQueryAttention, not the MultiHeadAttention fallback, and the artifact matches the upload at shapes the
job never saw. Regression test for issue 19's first cause (padded and prompt-after-cache sets forced MHA).
Slower than the pass tests: a whole job with benchmarks (a few seconds per model)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from core.config import JobConfig
from core.settings import PipelineSettings
from passes._infra import op_histogram
from tests.models.build_decoders import OUT, Signature, decoder_feeds, presents_as_past
from tests.numerics import reference_session, run_named
from workers.pipeline import PipelineRequest, run_pipeline

MANIFEST = json.loads((OUT / "manifest.json").read_text())
ATOL = 1e-4


@pytest.mark.parametrize("name", ["llama_past_ts", "qwen2_nopast_dynamo"])
def test_fast_job_without_samples_fuses_groupqueryattention_and_stays_exact_when_decoder(name, tmp_path):
    # setup: no samples, no shapes: the job generates its own input sets
    settings = PipelineSettings(
        verify_shape_sets=3, benchmark_warmup=1, benchmark_min_runs=5, benchmark_max_seconds=0.1, ledger_runs=5,
        intra_op_threads=1,
    )  # fmt: skip
    # rollback_slower off: which passes pay is a timing question; this test asks what the ledger verified
    config = JobConfig(preset="fast", rollback_slower=False, benchmark=False)
    source = OUT / f"{name}.onnx"
    # execute
    result = run_pipeline(PipelineRequest(source, tmp_path / "out", config, settings))
    # assert: the generated sets are the unpadded generation calls, each with its reason
    text = json.dumps(result.report)
    assert "decoder-only language model" in text and "unpadded attention mask" in text
    entry = next(p for p in result.report["passes"] if p["name"] == "fuse_gqa")
    layers = MANIFEST["families"][name.rsplit("_", 2)[0]]["layers"]
    assert entry["status"] == "applied", entry
    assert entry["counts"]["fused_gqa"] == layers and entry["counts"]["fused_mha"] == 0, entry
    artifact = result.model_path
    ops = op_histogram(ir.load(str(artifact)))
    assert ops["com.microsoft::GroupQueryAttention"] == layers
    assert "com.microsoft::MultiHeadAttention" not in ops and "Softmax" not in ops
    # and exact at shapes the job never used: prefill 3 x 5, then decode steps on the artifact's own cache
    signature = Signature.of(source)
    reference, candidate = reference_session(source), reference_session(artifact)
    feeds = decoder_feeds(signature, 3, 5, 0, seed=11)
    want, got = run_named(reference, feeds), run_named(candidate, feeds)
    for key, expected in want.items():
        np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=key)
    if not signature.layers:
        return
    for step in range(3):
        past = 5 + step
        ids = np.random.default_rng(step).integers(0, signature.vocab, size=(3, 1), dtype=np.int64)
        want = run_named(
            reference, decoder_feeds(signature, 3, 1, past, tokens=ids, past_values=presents_as_past(want))
        )
        got = run_named(candidate, decoder_feeds(signature, 3, 1, past, tokens=ids, past_values=presents_as_past(got)))
        for key, expected in want.items():
            np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=f"{key} at past {past}")
    assert onnx.load(str(artifact)).graph.output[0].name == "logits"
