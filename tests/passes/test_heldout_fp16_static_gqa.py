"""Llama with a KV cache exported in float16 through the ``fast`` preset's passes up to fuse_gqa (issue 17/19,
held-out export variants).

``tests/models/heldout/llama_past_ts_fp16.onnx``: ``python -m bench.heldout_export_variants --only llama_past
--exporters ts_fp16`` (tiny LlamaForCausalLM from its config, ``model.half()``, TorchScript, Optimum's
signature). Its softmax runs in float32 (``Softmax -> Cast(to=float) -> Cast(to=float16)``, or the Cast to
float before the Softmax), and fuse_gqa's match stopped at the Cast: 0 of 2 layers fused. GroupQueryAttention
computes the softmax in float32 for float16 inputs, so the Casts are read through; the fused graph must match
the export at the float16 tolerance (``Tolerance.half_precision_floor``) at lengths other than the export's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from core.config import HALF_PRECISION_FLOOR
from passes._infra import op_histogram
from tests.models.build_decoders import Signature, decoder_feeds, presents_as_past
from tests.numerics import reference_session, run_named
from tests.passes._decoder_replay import fast_upto

HELDOUT = Path(__file__).resolve().parent.parent / "models" / "heldout"
FP16 = HELDOUT / "llama_past_ts_fp16.onnx"
LAYERS = 2
TOL = HALF_PRECISION_FLOOR["float16"]


def through_fuse_gqa(path: Path) -> tuple[ir.Model, dict[str, int]]:
    """The model after the fast preset's passes up to and including fuse_gqa, and fuse_gqa's counts."""
    model, counts = fast_upto(path)
    return model, {key.split(".", 1)[1]: n for key, n in counts.items() if key.startswith("fuse_gqa.")}


def half(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}


@pytest.fixture(scope="module")
def fused() -> tuple[ir.Model, dict[str, int]]:
    return through_fuse_gqa(FP16)


def test_float16_decoder_fuses_every_layer_through_the_softmax_casts(fused) -> None:
    model, counts = fused
    ops = op_histogram(model)
    assert counts.get("fused_gqa") == LAYERS
    assert ops["com.microsoft::GroupQueryAttention"] == LAYERS and "Softmax" not in ops
    for gqa in (n for n in model.graph if n.op_type == "GroupQueryAttention"):
        assert gqa.inputs[3].dtype == ir.DataType.FLOAT16  # the export's own float16 cache, no Cast around it


@pytest.mark.parametrize(("batch", "seq", "past"), [(2, 5, 0), (1, 1, 17), (1, 4, 9), (3, 1, 6)])
def test_float16_fused_decoder_matches_the_export_at_other_lengths(fused, batch, seq, past) -> None:
    model, _ = fused
    signature = Signature.of(FP16)
    reference, candidate = reference_session(FP16), reference_session(model)
    feeds = half(decoder_feeds(signature, batch, seq, past, seed=batch + seq + past))
    want, got = run_named(reference, feeds), run_named(candidate, feeds)
    for name, expected in want.items():
        assert got[name].dtype == expected.dtype == np.float16
        np.testing.assert_allclose(got[name], expected, atol=TOL, rtol=TOL, err_msg=name)


def test_float16_fused_decoder_decodes_on_its_reference_cache(fused) -> None:
    model, _ = fused
    signature = Signature.of(FP16)
    reference, candidate = reference_session(FP16), reference_session(model)
    feeds = half(decoder_feeds(signature, 1, 6, 0, seed=5))
    for step in range(4):  # a prompt, then one token at a time on the reference's own presents
        want, got = run_named(reference, feeds), run_named(candidate, feeds)
        for name, expected in want.items():
            np.testing.assert_allclose(got[name], expected, atol=TOL, rtol=TOL, err_msg=f"{name} step {step}")
        past = presents_as_past(want)
        tokens = want["logits"][:, -1:].argmax(-1).astype(np.int64)
        length = past["past_key_values.0.key"].shape[2]
        feeds = decoder_feeds(signature, 1, 1, length, tokens=tokens, past_values=past)


def test_match_reads_through_a_float_cast_before_the_softmax_and_refuses_an_integer_one() -> None:
    # The other form a half-precision export takes: Cast(to=float) of the float16 scores, Softmax in float32,
    # Cast(to=float16) of the probabilities. A Cast to an integer type is no precision change: not read.
    from passes.fusion._gqa_match import match_sites
    from tests.passes._util import parse

    def graph(to: int) -> ir.Graph:
        text = f"""<ir_version: 8, opset_import: ["" : 17]>
        g (float16[1,2,3,4] q, float16[1,2,3,4] k, float16[1,2,3,4] v, float16[1,1,3,3] mask)
          => (float16[1,3,2,4] out) <float c = {{0.5}}> {{
            kt = Transpose <perm = [0, 1, 3, 2]> (k)
            qk = MatMul (q, kt)
            scaled = Mul (qk, c)
            masked = Add (scaled, mask)
            wide = Cast <to = {to}> (masked)
            probs = Softmax <axis = -1> (wide)
            narrow = Cast <to = 10> (probs)
            ctx = MatMul (narrow, v)
            out = Transpose <perm = [0, 2, 1, 3]> (ctx)
        }}"""
        return ir.serde.deserialize_model(parse(text, check=False)).graph

    sites, declined = match_sites(graph(1))
    assert len(sites) == 1 and not declined
    assert sites[0].mask is not None and sites[0].mask.name == "mask" and sites[0].scale == 0.5
    sites, declined = match_sites(graph(7))
    assert not sites and len(declined) == 1


# Static shapes: ``--exporters ts_static`` (no dynamic_axes: batch 2, 3 new tokens after 4) and ``ts_batch``
# (dynamic batch only). The probe fed 2 x 5 new tokens, which such a graph refuses: "not causal", 0 of 2
# fused. The probe now runs at the dims the export fixed; several new tokens after a cache in a batch is a call
# ORT's GroupQueryAttention refuses, so the layers become MultiHeadAttention, exact for any batch.
STATIC = HELDOUT / "llama_past_ts_static.onnx"
BATCH = HELDOUT / "llama_past_ts_batch.onnx"


@pytest.mark.parametrize("path", [STATIC, BATCH], ids=["static", "batch_only"])
def test_fixed_length_decoder_fuses_every_layer_and_computes_what_the_export_does(path) -> None:
    model, counts = through_fuse_gqa(path)
    ops = op_histogram(model)
    assert counts.get("fused_mha") == LAYERS and not counts.get("fused_gqa")
    assert ops["com.microsoft::MultiHeadAttention"] == LAYERS and "Softmax" not in ops
    signature = Signature.of(path)
    reference, candidate = reference_session(path), reference_session(model)
    batches = (2,) if path == STATIC else (2, 1, 3)  # the static graph runs at its own batch only
    for batch in batches:
        feeds = decoder_feeds(signature, batch, 3, 4, seed=batch)  # the lengths the export fixed
        for step in range(3):  # the next call on the reference's own cache, cropped to the fixed past length
            want, got = run_named(reference, feeds), run_named(candidate, feeds)
            for name, expected in want.items():
                np.testing.assert_allclose(got[name], expected, atol=1e-5, rtol=1e-4, err_msg=f"{name} {step}")
            past = {k: v[:, :, -4:] for k, v in presents_as_past(want).items()}
            tokens = want["logits"][:, -3:].argmax(-1).astype(np.int64)
            feeds = decoder_feeds(signature, batch, 3, 4, tokens=tokens, past_values=past)
