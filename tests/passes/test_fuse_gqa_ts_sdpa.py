"""fuse_gqa on TorchScript exports with ``attn_implementation="sdpa"`` and a KV cache.

TorchScript's SDPA decomposition reshapes ``MatMul(probs, v)`` back to the query's 4-D shape (a ``Reshape``
whose target is read off the product's own ``Shape``) before the model's ``Transpose(0,2,1,3)``; the matcher
expected the Transpose right after the MatMul and declined every layer of every family ("expected
MatMul(probs, v) to feed one Transpose; found Shape, Reshape"). The files are the corpus families' cache
decoders exported that way (``python -m tests.models.build_decoders --sdpa``, committed under
tests/models/decoders/ and listed under ``sdpa`` in its manifest); numerics against the export under ORT with
graph optimizations off, at caches and batches other than the export's, and for Mistral at and beyond its
window (its crop of the past dropped, of the present kept).
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from passes.fusion.fuse_gqa import FuseGqa
from tests.models import build_decoders as bd
from tests.numerics import reference_session, run_named

# (batch, new tokens, past); mistral's window is 64: 63 + 1 fills it, 100 + 3 is a past the export refuses
CASES = ((1, 1, 5), (4, 1, 7), (1, 9, 6), (2, 20, 0), (1, 1, 63), (2, 1, 63), (1, 70, 0), (1, 3, 100))
SDPA = {e["family"]: e for e in json.loads((bd.OUT / "manifest.json").read_text())["sdpa"]}


def _committed(name: str) -> tuple[bd.Family, object]:
    assert "error" not in SDPA[name], SDPA[name]
    return bd.FAMILIES[name], bd.OUT / bd.sdpa_filename(name)


def _feeds(reference, family: bd.Family, batch: int, new: int, past: int, rng) -> dict[str, np.ndarray]:
    names = {i.name for i in reference.get_inputs()}
    feeds = {
        "input_ids": rng.integers(0, family.vocab, (batch, new)).astype(np.int64),
        "attention_mask": np.ones((batch, past + new), np.int64),
    }
    if "position_ids" in names:
        feeds["position_ids"] = np.repeat(np.arange(past, past + new, dtype=np.int64)[None], batch, axis=0)
    for value in reference.get_inputs():
        if value.name.startswith("past_key_values"):
            feeds[value.name] = rng.standard_normal((batch, value.shape[1], past, value.shape[3])).astype(np.float32)
    return feeds


@pytest.mark.parametrize("name", sorted(bd.FAMILIES))
def test_fuse_gqa_fuses_every_layer_of_a_torchscript_sdpa_export_with_a_cache_exactly(name):
    # setup
    family, path = _committed(name)
    model = ir.load(path)
    window = dict(family.extra).get("sliding_window")
    # execute
    result = FuseGqa()(model)
    # assert: every layer GroupQueryAttention, no softmax left; mistral's past crops gone (2 per layer)
    ops = op_histogram(result.model)
    assert result.counts["fused_gqa"] == family.layers and not result.non_matches, result.non_matches
    assert "Softmax" not in ops and "IsNaN" not in ops
    assert result.counts["past_crops_dropped"] == (2 * family.layers if window else 0)
    reference = reference_session(path)
    fused = reference_session(result.model)
    rng = np.random.default_rng(0)
    for batch, new, past in CASES:
        if past + new > family.max_positions or (not window and past + new > 64):
            continue
        feeds = _feeds(reference, family, batch, new, past, rng)
        fed = feeds
        if window and past >= window:  # the export refuses it: its answer on the W - 1 positions it keeps
            fed = {k: v[:, :, -(window - 1) :] if k.startswith("past_key_values") else v for k, v in feeds.items()}
            fed["attention_mask"] = np.ones((batch, window - 1 + new), np.int64)
        want, got = run_named(reference, fed), run_named(fused, feeds)
        for key, expected in want.items():
            where = f"{key} at batch {batch}, {new} new after {past}"
            assert got[key].shape == expected.shape, where
            np.testing.assert_allclose(got[key], expected, rtol=1e-4, atol=1e-5, err_msg=where)
