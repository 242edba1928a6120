"""TimesFM 2.5 through the ``fast`` preset: a refused rotary fusion no longer costs fuse_transformer its run (issue
17, held-out round 16).

TimesFM 2.5 counts rotary positions from its first unpadded patch, ``arange(S) - num_masked``: a left-padded series
puts padded patches at -1, which ORT's RotaryEmbedding refuses. fuse_rotary's group is verified on a padded series
(the synthesized time-series inputs) and rolled back, rightly; but fuse_transformer had already run on the model
holding that group's changes, its candidates failed on the same RotaryEmbedding, and, having changed nothing, it
was never run again: its four residual RMS norms stayed unfused. The ledger now runs such a pass again on the
accepted stage (``tests/workers/test_ledger_groups.py`` for the rule itself).

``tests/models/heldout/timesfm2_5_{ts,dynamo}.onnx``: ``python -m tests.models.build_heldout_probe heldout_round16
timesfm2_5`` (2 layers, hidden 64, 4 heads of 16, a context of 64 values).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import JobConfig
from core.settings import PipelineSettings
from workers.pipeline import PipelineRequest, run_pipeline

HELDOUT = Path(__file__).resolve().parents[1] / "models" / "heldout"


@pytest.mark.parametrize("exporter", ["ts", "dynamo"])
def test_fuse_transformer_runs_again_once_the_rotary_fusion_it_ran_after_is_rolled_back(
    tmp_path: Path, exporter: str
) -> None:
    settings = PipelineSettings(verify_shape_sets=2, benchmark_warmup=1, ledger_runs=5, intra_op_threads=1)
    request = PipelineRequest(HELDOUT / f"timesfm2_5_{exporter}.onnx", tmp_path, JobConfig(preset="fast"), settings)
    records = {p["name"]: p for p in run_pipeline(request).report["passes"]}
    rotary = records["fuse_rotary"]
    assert rotary["status"] == "rolled_back" and "position_ids value -1" in rotary["reason"]
    fused = records["fuse_transformer"]
    assert "run again: it had run on the group" in fused["reason"], fused["reason"]
    assert fused["counts"]["fused_skip_layer_norm"] == 4
    assert "RotaryEmbedding" not in str(fused["non_matches"])  # its candidates ran on the accepted stage
