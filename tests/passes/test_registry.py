"""The registry: names and options are checked before anything runs, and the catalogue is complete."""

from __future__ import annotations

import importlib

import pytest

from core.config import PassSpec
from core.errors import InvalidPassOptionsError, UnknownPassError
from passes import registry


def test_get_pass_class_suggests_close_match_when_name_is_misspelled() -> None:
    with pytest.raises(UnknownPassError) as info:
        registry.get_pass_class("identity_elimnation")
    assert info.value.code == "UNKNOWN_PASS"
    assert "did you mean identity_elimination" in info.value.message
    assert info.value.detail["close_matches"][0] == "identity_elimination"


def test_get_pass_class_lists_known_passes_when_name_is_nothing_like_them() -> None:
    with pytest.raises(UnknownPassError) as info:
        registry.get_pass_class("zzz")
    assert info.value.detail["close_matches"] == []
    assert "known:" in info.value.message and "constant_folding" in info.value.message


def test_get_preset_raises_unknown_preset_when_name_is_misspelled() -> None:
    with pytest.raises(UnknownPassError) as info:
        registry.get_preset("saf")
    assert info.value.code == "UNKNOWN_PRESET"
    assert "safe" in info.value.message


def test_build_passes_raises_naming_the_option_when_option_key_is_unknown() -> None:
    specs = [
        PassSpec(name="identity_elimination"),
        PassSpec(name="constant_folding", options={"max_bytes": 1}),
    ]
    with pytest.raises(InvalidPassOptionsError) as info:
        registry.build_passes(specs)
    assert info.value.pass_name == "constant_folding"
    assert "max_bytes" in info.value.message
    assert info.value.detail["errors"][0]["loc"] == ["max_bytes"]


def test_build_passes_raises_when_option_value_has_wrong_type() -> None:
    with pytest.raises(InvalidPassOptionsError, match="max_output_bytes"):
        registry.build_passes([PassSpec(name="constant_folding", options={"max_output_bytes": "lots"})])


def test_build_passes_returns_configured_instances_in_order_when_specs_are_valid() -> None:
    specs = [PassSpec(name=name) for name in registry.get_preset("safe").passes]
    folding = registry.get_preset("safe").passes.index("constant_folding")
    specs[folding] = PassSpec(name="constant_folding", options={"max_output_bytes": 4096})
    passes = registry.build_passes(specs)
    assert [p.name for p in passes] == registry.get_preset("safe").passes
    assert passes[folding].options.model_dump()["max_output_bytes"] == 4096


def test_catalogue_lists_every_pass_with_a_described_options_schema() -> None:
    entries = {entry["name"]: entry for entry in registry.catalogue()}
    assert list(entries) == [cls.name for cls in registry.PASSES]
    for name, entry in entries.items():
        assert entry["summary"] and isinstance(entry["exact"], bool), name
        schema = entry["options_schema"]
        assert schema["type"] == "object" and schema.get("additionalProperties") is False, name
        for field, prop in schema.get("properties", {}).items():
            assert prop.get("description"), f"{name}.{field} has no description"
    assert "max_output_bytes" in entries["constant_folding"]["options_schema"]["properties"]


@pytest.mark.parametrize("name", registry.get_preset("safe").passes)
def test_safe_pass_declares_contract_when_registered(name: str) -> None:
    """Each pass of the exact preset names the ORT transform it re-implements or the onnx-ir pass it wraps,
    draws it, and is an exact in-place pass."""
    cls = registry.get_pass_class(name)
    assert cls.__module__.startswith("passes.") and cls.__module__.endswith(f".{name}")  # passes/<kind>/<name>.py
    doc = importlib.import_module(cls.__module__).__doc__ or ""
    assert ("ORT" in doc or "ONNX Runtime" in doc) and "-->" in doc
    assert cls.exact is True and cls.in_place is True
    assert cls.summary and "\n" not in cls.summary
    cls()  # the default options are valid
