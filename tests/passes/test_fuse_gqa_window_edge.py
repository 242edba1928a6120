"""fuse_gqa has the job verify a sliding-window decoder at the window's edge (``PassResult.verify_inputs``).

The job's own input sets keep the cache below Mistral's window, so a present cache one position too long
(a later pass dropping the export's crop of it, as ``fuse_transformer`` once did) verified. With the edge sets
fuse_gqa declares, the engine verifies its stage and every later one at caches of W - 1 and beyond: the same
bug, re-introduced by a test pass after fuse_gqa, is rolled back; with the edge check switched off it is not.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from core.config import JobConfig
from core.settings import PipelineSettings
from passes._infra import Pass, PassContext, PassResult
from passes.fusion.fuse_gqa import FuseGqa
from tests.models.build_decoders import OUT
from tests.workers.conftest import resolver
from workers.pipeline import PipelineRequest, run_pipeline

MANIFEST = json.loads((OUT / "manifest.json").read_text())
WINDOW = dict(MANIFEST["families"]["mistral"]["extra"])["sliding_window"]


class DropPresentCrop(Pass):
    """TEST-ONLY, wrong at the window's edge: each present's crop to the window keeps the whole cache (its
    start becomes 0), the bug ``_slice_dims`` fixed. Below the window the crop keeps everything anyway."""

    name = "test_drop_present_crop"
    summary = "test only: the present cache comes back uncropped"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        zero = ir.Value(name="test/zero", const_value=ir.tensor(np.array([0], np.int64)))
        model.graph.register_initializer(zero)
        crops = [o.producer() for o in model.graph.outputs if o.name.startswith("present")]
        for crop in crops:
            crop.replace_input_with(1, zero)
        return PassResult(model, bool(crops), {"crops_dropped": len(crops)})


def _job(tmp_path, *passes: Pass):
    settings = PipelineSettings(
        verify_shape_sets=3, benchmark_warmup=1, benchmark_min_runs=5, benchmark_max_seconds=0.1, ledger_runs=5,
        intra_op_threads=1,
    )  # fmt: skip
    request = PipelineRequest(
        OUT / "mistral_past_ts.onnx",
        tmp_path,
        JobConfig(rollback_slower=False, benchmark=False),
        settings,
        pass_resolver=resolver(*passes),
    )
    return {p["name"]: p for p in run_pipeline(request).report["passes"]}


def _shapes(result: PassResult) -> list[tuple[tuple[int, ...], int]]:
    return sorted((f["input_ids"].shape, f["past_key_values.0.key"].shape[2]) for f in result.verify_inputs.values())


def test_fuse_gqa_declares_caches_at_the_window_edge_and_across_it_within_the_positions_it_may_use():
    # setup
    models = [ir.load(OUT / "mistral_past_dynamo.onnx") for _ in range(3)]
    # execute
    result = FuseGqa()(models[0])
    edge_only = FuseGqa({"window_edge_up_to": WINDOW})(models[1])  # reaching the edge takes W positions
    none = FuseGqa({"window_edge_up_to": WINDOW - 1})(models[2])
    # assert: a decode step after W - 1, two rows, a prompt up to the edge; then across it (after W, 3 tokens)
    edge = [((1, 1), WINDOW - 1), ((1, 2), WINDOW - 2), ((2, 1), WINDOW - 1)]
    assert _shapes(result) == sorted([*edge, ((1, 1), WINDOW), ((1, 3), WINDOW - 2)])
    for feeds in result.verify_inputs.values():
        past, new = feeds["past_key_values.0.key"].shape[2], feeds["input_ids"].shape[1]
        assert feeds["attention_mask"].shape[1] == past + new
        np.testing.assert_array_equal(feeds["position_ids"][0], np.arange(past, past + new))
    assert result.notes["window_edge"] == f"verified at the window of {WINDOW} keys where the upload runs"
    assert (
        _shapes(edge_only) == edge and "not verified at 1 token after a cache of 64" in edge_only.notes["window_edge"]
    )
    assert none.modified and none.verify_inputs == {}


@pytest.mark.parametrize("edge", [True, False])
def test_a_pass_dropping_the_present_crop_after_fuse_gqa_is_rolled_back_only_with_the_window_edge(edge, tmp_path):
    # setup
    fuse = FuseGqa({} if edge else {"window_edge_up_to": 0})
    # execute
    records = _job(tmp_path, fuse, DropPresentCrop())
    # assert: fuse_gqa kept either way; the bug caught at the window's edge, missed by the job's own sets
    assert records["fuse_gqa"]["status"] == "applied", records["fuse_gqa"]["reason"]
    bug = records["test_drop_present_crop"]
    if edge:
        assert bug["status"] == "rolled_back"
        assert "present" in bug["reason"] and "window edge" in bug["reason"], bug["reason"]
        assert f"shape [1, 2, {WINDOW}, 8] instead of [1, 2, {WINDOW - 1}, 8]" in bug["reason"]
        refused = records["fuse_gqa"]["notes"]["verify_inputs_refused_by_the_original"]
        assert list(refused) == [f"fuse_gqa window edge: 1 token after a cache of {WINDOW}"]  # the upload's limit
    else:
        assert bug["status"] == "applied", bug["reason"]
