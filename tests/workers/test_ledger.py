"""workers/ledger.py: what the ledger does with the pass contract's typed result fields.

The pass here is TEST-ONLY: it writes garbage at the pad positions of a BERT-like model's output, which is
right only when it says so through ``PassResult.valid_positions`` (as padding_elimination does)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from core.config import JobConfig
from core.settings import PipelineSettings
from passes._infra import Pass, PassContext, PassResult
from tests.workers.conftest import make_bert_like, resolver
from workers.pipeline import PipelineRequest, run_pipeline

VALID = {"hidden": {"mask_input": "attention_mask", "axes": [0, 1]}}


class PadGarbage(Pass):
    """hidden = Mul(sum, mask) becomes hidden + (1 - mask): changed at pad positions only."""

    name = "test_pad_garbage"
    summary = "test only: leaves pad positions undefined"

    def __init__(self, declare: bool) -> None:
        super().__init__()
        self.declare = declare

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        graph = model.graph
        mul = next(n for n in graph if n.name == "apply_mask")
        masked = mul.outputs[0]
        one = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(1.0, np.float32))})
        pad = ir.node("Sub", [one.outputs[0], mul.inputs[1]])
        hidden = ir.Value(name="hidden", type=masked.type, shape=masked.shape)
        masked.name = "masked"
        add = ir.node("Add", [masked, pad.outputs[0]], outputs=[hidden])
        graph.extend([one, pad, add])
        graph.outputs[0] = hidden
        return PassResult(model, True, {"nodes_added": 3}, valid_positions=VALID if self.declare else {})


@pytest.fixture
def padded_bert(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "in" / "bert.onnx"
    model.parent.mkdir()
    onnx.save(make_bert_like(), str(model))
    rng = np.random.default_rng(5)
    mask = np.ones((2, 6), np.int64)
    mask[0, 4:] = 0  # right padding: two pad positions in the first row
    samples = tmp_path / "in" / "samples.npz"
    ids = rng.integers(1, 50, (2, 6)).astype(np.int64)
    np.savez(samples, input_ids=ids, attention_mask=mask, token_type_ids=np.zeros((2, 6), np.int64))
    return model, samples


@pytest.mark.parametrize("declare", [True, False])
def test_ledger_compares_valid_positions_only_when_the_result_declares_them(
    tmp_path: Path, padded_bert: tuple[Path, Path], fast_settings: PipelineSettings, declare: bool
) -> None:
    # setup
    model, samples = padded_bert
    config = JobConfig(rollback_slower=False)  # three extra kernels may be slower; verification decides here
    passes = resolver(PadGarbage(declare))
    out = tmp_path / "out"
    request = PipelineRequest(model, out, config, fast_settings, samples_path=samples, pass_resolver=passes)
    # execute
    record = run_pipeline(request).report["passes"][0]
    # assert
    if declare:
        assert record["status"] == "applied" and record["verification"]["ok"] is True, record["reason"]
    else:
        assert record["status"] == "rolled_back" and record["reason"].startswith("broke tolerance"), record["reason"]
