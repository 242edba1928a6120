"""fuse_transformer checks its candidates against the engine's reference of the upload when the context gives
one (``PassContext.references``), instead of running its input with optimizations off on every sample: one
run of the three input sets of Whisper's encoder was ~1.6 s of its job (issue 17, job time)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import PassContext
from passes.fusion import fuse_transformer
from passes.fusion.fuse_transformer import FuseTransformer
from tests.models.build_torchscript import inputs
from tests.passes._util import MODELS, session


def _context(model: ir.Model, shift: float = 0.0) -> PassContext:
    samples = []
    for batch, seq in ((1, 8), (2, 16), (3, 5)):
        ids, mask = inputs(batch, seq, seed=seq)
        samples.append({"input_ids": ids, "attention_mask": mask})
    reference = session(model)
    names = [o.name for o in reference.get_outputs()]
    outputs = [[out + np.float32(shift) for out in reference.run(None, feeds)] for feeds in samples]
    return PassContext(samples=samples, references=outputs, reference_names=names)


@pytest.fixture
def sessions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    built: list[int] = []
    real = fuse_transformer._session

    def counted(model):
        built.append(1)
        return real(model)

    monkeypatch.setattr(fuse_transformer, "_session", counted)
    fuse_transformer._LAST.clear()
    return built


def test_candidates_are_checked_against_the_given_reference_without_running_the_input(sessions: list[int]) -> None:
    model = ir.load(MODELS / "ts_bert_eager.onnx")
    original = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    ctx = _context(model)
    result = FuseTransformer({"pack_qkv": True})(model, ctx)
    assert result.counts["fused_attention"] == 2
    chosen = result.notes["chosen"]
    assert result.notes["candidates"][chosen]["verified"] is True
    assert len(sessions) == 1  # the chosen candidate's session; the input model was never run
    reference, fused = session(original), session(result.model)
    for feeds in ctx.samples:
        for want, got in zip(reference.run(None, feeds), fused.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_given_reference_is_what_the_candidates_must_match(sessions: list[int]) -> None:
    # outputs moved by 1: no candidate matches them, so none is applied (the pass trusts what the engine gives)
    model = ir.load(MODELS / "ts_bert_eager.onnx")
    result = FuseTransformer({"pack_qkv": True})(model, _context(model, shift=1.0))
    assert not result.modified
    assert all(c.get("verified") is not True for c in result.notes["candidates"].values())


def test_without_a_reference_for_every_sample_the_input_is_run(sessions: list[int]) -> None:
    model = ir.load(MODELS / "ts_bert_eager.onnx")
    ctx = _context(model)
    ctx.reference_names = ["another output"]  # not this model's outputs: the pass runs its input itself
    result = FuseTransformer({"pack_qkv": True})(model, ctx)
    assert result.counts["fused_attention"] == 2 and len(sessions) == 2
