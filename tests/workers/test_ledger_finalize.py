"""workers/ledger.py: finalize. The artifact is the last applied stage stamped with provenance metadata, so the
stage's verification is the artifact's, unless the reference or what is compared changed since (a pass handed
the engine more input sets): then the artifact is verified anew. Passes are TEST-ONLY (conftest.py and below)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from core.config import EXACT_TOLERANCE, JobConfig
from core.inputs import make_input_sets
from core.settings import PipelineSettings
from passes._infra import Pass, PassContext, PassResult
from tests.workers.conftest import DropReluChain, resolver
from workers import verify
from workers.pipeline import PipelineRequest, PipelineResult, run_pipeline


class SameModelMoreSets(Pass):
    """Says it changed the model, hands it back as it was, and asks for one more verification input set; not
    declared exact, so it runs alone, after the group before it was verified."""

    name = "test_same_model_more_sets"
    summary = "test only: no change, one more verification set"
    exact = False

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        feeds = {name: np.full_like(value, 0.5) for name, value in ctx.samples[0].items()}
        return PassResult(model, True, verify_inputs={"one more set": feeds})


@pytest.fixture
def verification_sessions(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The file names of the models the verifier builds a session for (the real sessions, counted)."""
    built: list[str] = []
    real = verify.make_session

    def counting(path: Path, *args: Any, **kwargs: Any) -> Any:
        built.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(verify, "make_session", counting)
    yield built


def _run(model: Path, out: Path, settings: PipelineSettings, *passes: Pass) -> PipelineResult:
    request = PipelineRequest(
        model_path=model, output_dir=out, config=JobConfig(), settings=settings, pass_resolver=resolver(*passes)
    )
    return run_pipeline(request)


def _max_abs(verification: dict[str, Any]) -> dict[tuple[str, str], float | None]:
    return {(o["input_set"], o["name"]): o["max_abs"] for o in verification["outputs"]}


def test_finalize_reuses_the_last_stage_verification_when_the_artifact_is_that_stage_stamped(
    tmp_path: Path, slow_mlp_path: Path, fast_settings: PipelineSettings, verification_sessions: list[str]
) -> None:
    result = _run(slow_mlp_path, tmp_path / "out", fast_settings, DropReluChain())
    report = result.report
    assert [p["status"] for p in report["passes"]] == ["applied"] and not result.used_original
    # The stage was verified; the stamped artifact is not verified a second time.
    assert any(name.startswith("stage-") for name in verification_sessions)
    assert "artifact.onnx" not in verification_sessions
    assert report["verification"]["ok"] is True
    # What the report says of the artifact is what a fresh verification of the model handed back finds.
    sets = make_input_sets(onnx.load(str(slow_mlp_path)), count=fast_settings.verify_shape_sets, seed=JobConfig().seed)
    fresh = verify.Verifier(slow_mlp_path, sets, EXACT_TOLERANCE, target="cpu").check(result.model_path)
    assert fresh.ok and _max_abs(fresh.to_dict()) == _max_abs(report["verification"])


def test_finalize_verifies_the_artifact_anew_when_a_later_pass_added_input_sets(
    tmp_path: Path, slow_mlp_path: Path, fast_settings: PipelineSettings, verification_sessions: list[str]
) -> None:
    result = _run(slow_mlp_path, tmp_path / "out", fast_settings, DropReluChain(), SameModelMoreSets())
    statuses = [p["status"] for p in result.report["passes"]]
    assert statuses == ["applied", "no_change"]
    # The stage was verified before the set was added: the artifact is verified on every set, the new one too.
    assert "artifact.onnx" in verification_sessions
    outputs = result.report["verification"]["outputs"]
    assert "one more set" in {o["input_set"] for o in outputs}
    assert result.report["verification"]["ok"] is True
