"""The decoder structure fuse_rotary reports (``notes["decoder"]``, from ``_decoder_structure.detect``) is the
one tests/models/decoders/manifest.json records for every corpus decoder, read from the graph alone."""

from __future__ import annotations

import json

import onnx_ir as ir
import pytest

from passes.fusion.fuse_rotary import FuseRotary
from tests.models.build_decoders import OUT

MANIFEST = json.loads((OUT / "manifest.json").read_text())
FILES = [e for e in MANIFEST["files"] if "error" not in e]


@pytest.mark.parametrize("entry", FILES, ids=lambda e: e["file"])
def test_decoder_structure_matches_the_manifest_when_read_from_the_graph(entry):
    family = MANIFEST["families"][entry["family"]]
    result = FuseRotary()(ir.load(OUT / entry["file"]))
    found = result.notes["decoder"]
    head_size = family["hidden"] // family["heads"]
    assert {k: found[k] for k in ("layers", "heads", "kv_heads", "head_size", "hidden", "vocab")} == {
        "layers": family["layers"],
        "heads": family["heads"],
        "kv_heads": family["kv_heads"],
        "head_size": head_size,
        "hidden": family["hidden"],
        "vocab": family["vocab"],
    }
    if entry["family"] == "gpt2":
        assert found["rotary"] == "no rotary"
        assert found["norm"] == "layernorm"
        assert found["max_positions"] == family["max_positions"]  # GPT-2's learned position table
    else:
        assert found["rotary"] == {
            "rotary_dim": head_size,
            "form": "inv_freq",
            "theta": 10000.0,
            "attention_scaling": 1.0,
            "partial_rotary_factor": 1.0,
            "interleaved": False,
        }
        assert found["norm"] == "rms"
    if entry["cache"] == "past":
        assert found["cache"] == {
            "layout": "BNSH",
            "names": "past_key_values.{layer}.{key|value}",
            "kv_heads": family["kv_heads"],
            "head_size": head_size,
        }
    else:
        assert found["cache"] is None
