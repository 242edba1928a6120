"""Verification compares outputs at valid positions only where a pass left pad positions undefined."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir

from core.config import EXACT_TOLERANCE
from core.inputs import make_input_sets
from passes._infra import PassContext
from passes.cleanup.shape_inference import ShapeInference
from passes.compute_order.padding_elimination import PaddingElimination
from workers.verify import Verifier

MODEL = Path(__file__).resolve().parents[1] / "models" / "hf_bert_encoder.onnx"


def unpadded_model(tmp_path: Path) -> tuple[Path, dict]:
    model = ir.load(MODEL)
    ShapeInference()(model)
    result = PaddingElimination({"force": True})(model, PassContext())
    assert result.modified, result.non_matches
    path = tmp_path / "unpadded.onnx"
    onnx.save(ir.serde.serialize_model(result.model), path)
    return path, result.notes["valid_positions"]


def test_verifier_passes_unpadded_model_when_compared_at_valid_positions(tmp_path):
    path, positions = unpadded_model(tmp_path)
    input_sets = make_input_sets(onnx.load(MODEL), count=3, seed=0)
    verifier = Verifier(MODEL, input_sets, EXACT_TOLERANCE)

    result = verifier.check(path, positions)

    assert result.ok, result.reason
    assert {o.positions for o in result.outputs} == {"valid"}
    assert positions == {"last_hidden_state": {"mask_input": "attention_mask", "axes": [0, 1]}}


def test_verifier_fails_unpadded_model_when_every_position_is_compared(tmp_path):
    """Pad positions hold zeros instead of the original's values: only the mask makes them don't-care."""
    path, _ = unpadded_model(tmp_path)
    input_sets = make_input_sets(onnx.load(MODEL), count=3, seed=0)
    assert any((s.feeds["attention_mask"] == 0).any() for s in input_sets), "generated masks must pad"
    verifier = Verifier(MODEL, input_sets, EXACT_TOLERANCE)

    result = verifier.check(path)

    assert not result.ok
    assert "last_hidden_state" in result.reason
