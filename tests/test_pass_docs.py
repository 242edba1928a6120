"""docs/passes.md is generated from the registry and must stay equal to what the registry renders."""

from __future__ import annotations

from pathlib import Path

from passes import registry
from passes._catalogue_doc import render

ROOT = Path(__file__).resolve().parents[1]


def test_passes_doc_matches_registry_when_generated():
    assert (ROOT / "docs" / "passes.md").read_text() == render(), (
        "docs/passes.md is stale: python -m passes._catalogue_doc > docs/passes.md"
    )


def test_passes_doc_names_every_pass_option_and_preset_when_rendered():
    text = render()
    for cls in registry.PASSES:
        assert f"## `{cls.name}`" in text
        for option in cls.options_schema().get("properties", {}):
            assert f"| `{option}` |" in text, f"{cls.name}.{option} is not documented"
    for name in registry.PRESETS:
        assert f"### `{name}`" in text
