"""The `fast` preset runs, with no samples, on the three exports whose inputs only their roles explain.

Before input roles (issue 17) each of these jobs stopped before any pass with "give shapes in the config or
upload samples.npz": a GPT-2 with a KV cache (the mask must span past + new tokens), wav2vec2 on raw audio
(its convolution stack needs at least 400 samples) and a BART classifier (its head looks up the EOS token).
The report says which inputs were used and why.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import JobConfig
from core.settings import PipelineSettings
from tests.workers.conftest import MODELS
from workers.pipeline import PipelineRequest, run_pipeline


@pytest.mark.slow
@pytest.mark.parametrize("name", ["roles_gpt2_past", "roles_wav2vec2", "roles_bart_cls"])
def test_fast_preset_completes_with_generated_inputs_when_inputs_need_their_roles(
    tmp_path: Path, fast_settings: PipelineSettings, name: str
) -> None:
    request = PipelineRequest(
        model_path=MODELS / f"{name}.onnx",
        output_dir=tmp_path,
        config=JobConfig.parse({"preset": "fast"}),
        settings=fast_settings,
    )
    result = run_pipeline(request)
    report = result.report
    assert report["verification"]["ok"] is True
    sets = report["input_sets"]
    assert sets and all(s["inputs"]["source"] == "generated" for s in sets)
    roles = {name: entry["role"] for name, entry in sets[0]["inputs"]["inputs"].items()}
    if name == "roles_gpt2_past":
        shapes = sets[0]["shapes"]
        past = shapes["past_key_values.0.key"][2]
        assert shapes["attention_mask"][1] == past + shapes["input_ids"][1]
        assert any(s["shapes"]["past_key_values.0.key"][2] == 0 for s in sets)  # prefill: an empty past
    elif name == "roles_wav2vec2":
        assert all(s["shapes"]["input_values"][1] >= 400 for s in sets)
        assert "audio" in roles["input_values"]
    else:
        assert roles["input_ids"] == "token_ids"
