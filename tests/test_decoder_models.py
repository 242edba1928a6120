"""The committed decoder corpus (tests/models/decoders, built by tests.models.build_decoders): every file the
manifest lists is there unchanged, has Optimum's text-generation(-with-past) signature with symbolic axes, and
its KV cache works in ONNX Runtime: a prefill followed by decode steps on the returned cache gives the logits
of one prefill over the whole sequence, and the cache-free export of the same family gives the same logits.
No torch: this pins what the builder verified against torch."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import pytest

from tests.models.build_decoders import (
    HELDOUT,
    OUT,
    Signature,
    decoder_feeds,
    input_names,
    output_names,
    presents_as_past,
)
from tests.numerics import reference_session, run_named

MANIFEST = json.loads((OUT / "manifest.json").read_text())
BUILT = [e for e in MANIFEST["files"] if "error" not in e]
PAST = [e["file"] for e in BUILT if e["cache"] == "past"]


def session(name):
    return reference_session(OUT / name)


def test_decoder_corpus_has_every_family_with_and_without_cache_when_built():
    families = {e["family"] for e in BUILT}
    assert {"llama", "qwen2", "phi3", "gpt2", "mistral"} <= families
    for family in ("llama", "qwen2", "phi3", "gpt2", "mistral"):
        kinds = {(e["cache"], e["exporter"]) for e in BUILT if e["family"] == family}
        assert {("past", "ts"), ("nopast", "ts")} <= kinds, family
    assert "trained_llama_past_ts.onnx" in PAST


@pytest.mark.parametrize("entry", BUILT, ids=lambda e: e["file"])
def test_decoder_file_matches_manifest_and_optimum_signature_when_loaded(entry):
    path = OUT / entry["file"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
    assert path.stat().st_size < 600_000  # the corpus stays small enough to commit
    model = onnx.load(str(path))
    layers = MANIFEST["families"][entry["family"]]["layers"]
    assert [i.name for i in model.graph.input] == input_names(layers, entry["cache"])
    assert [o.name for o in model.graph.output] == output_names(layers, entry["cache"])
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        assert dims[0].dim_param == "batch"
        assert dims[2 if value.name.startswith("past_") else 1].dim_param


@pytest.mark.parametrize("name", PAST)
def test_decoder_cache_gives_the_full_prefill_logits_when_decoding_step_by_step(name):
    # setup: 9 tokens as one prefill, and as a prefill of 6 then 3 decode steps on the returned cache
    sess = session(name)
    signature = Signature.of(OUT / name)
    tokens = np.random.default_rng(5).integers(0, signature.vocab, size=(2, 9), dtype=np.int64)
    full = run_named(sess, decoder_feeds(signature, 2, 9, 0, tokens=tokens))
    # execute
    out = run_named(sess, decoder_feeds(signature, 2, 6, 0, tokens=tokens[:, :6]))
    steps = [out["logits"][:, -1]]
    for pos in range(6, 9):
        feeds = decoder_feeds(signature, 2, 1, pos, tokens=tokens[:, pos : pos + 1], past_values=presents_as_past(out))
        out = run_named(sess, feeds)
        steps.append(out["logits"][:, -1])
    # assert
    np.testing.assert_allclose(np.stack(steps, 1), full["logits"][:, 5:], atol=1e-4, rtol=0)
    assert out["present.0.key"].shape == (2, signature.kv_heads, 9, signature.head_dim)


@pytest.mark.parametrize("entry", [e for e in BUILT if e["cache"] == "nopast"], ids=lambda e: e["file"])
def test_decoder_without_cache_matches_the_cached_export_when_past_is_empty(entry):
    past_name = entry["file"].replace("_nopast_", "_past_")
    if past_name not in PAST:
        pytest.skip(f"{past_name} did not export (see manifest.json)")
    signature = Signature.of(OUT / past_name)
    feeds = decoder_feeds(signature, 3, 7, 0, seed=11)
    with_cache = run_named(session(past_name), feeds)["logits"]
    plain = session(entry["file"])
    without = run_named(plain, {i.name: feeds[i.name] for i in plain.get_inputs()})["logits"]
    np.testing.assert_allclose(without, with_cache, atol=1e-5, rtol=0)


def test_heldout_tokens_are_bytes_of_text_when_loaded():
    held = np.load(HELDOUT)
    assert held.dtype == np.int64 and held.shape == (8, 128)
    text = bytes(held[0].astype(np.uint8)).decode("utf-8", errors="strict")
    assert text.isprintable() or "\n" in text
