"""MusicGen's decoder goes through ``fast`` with no samples (issue 17, held-out round 18: both jobs failed before any
pass ran).

Its ``input_ids`` are ``[batch * codebooks, sequence]``, viewed as ``[-1, codebooks, sequence]`` with the sequence
read off the input (a Concat in TorchScript's export, a Shape slice in dynamo's), then each codebook's ids picked
(``Gather(axis=1)``) and looked up in its own table of 65 rows. The synthesized sets had a batch of 1 (the view
refused it, and the row-group guess did not see a target it could not read as a constant) and ids up to 100 (the
per-codebook selection hid the tables). ``core/inputs/graph.py`` reads both now
(``tests/core/test_inputs.py::test_codebook_ids_get_whole_row_groups_and_each_tables_vocabulary``).

``tests/models/heldout/musicgen_{ts,dynamo}.onnx``: ``python -m tests.models.build_heldout_probe heldout_round18
musicgen`` (2 layers, hidden 64, 4 heads, 2 codebooks of 64 codes, no cache).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import JobConfig
from core.settings import PipelineSettings
from workers.pipeline import PipelineRequest, run_pipeline

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "heldout"


@pytest.mark.parametrize("exporter", ["ts", "dynamo"])
def test_musicgens_decoder_goes_through_fast_with_no_samples(tmp_path: Path, exporter: str) -> None:
    settings = PipelineSettings(verify_shape_sets=2, benchmark_warmup=1, ledger_runs=5, intra_op_threads=1)
    request = PipelineRequest(HELDOUT / f"musicgen_{exporter}.onnx", tmp_path, JobConfig(preset="fast"), settings)
    report = run_pipeline(request).report
    assert report["verification"]["ok"] is True
    sets = report["input_sets"]
    assert all(s["shapes"]["input_ids"][0] % 2 == 0 for s in sets), sets  # whole codebook groups
    records = {p["name"]: p for p in report["passes"]}
    assert records["fuse_transformer"]["counts"]["fused_attention"] == 2
