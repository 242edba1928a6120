"""A Llama with a KV cache exported by dynamo without its optimizer fuses to GroupQueryAttention (issue 17/19,
held-out export variants).

``tests/models/heldout/llama_past_dynamo_noopt.onnx``: ``python -m bench.heldout_export_variants --only
llama_past --exporters dynamo_noopt`` (tiny LlamaForCausalLM from its config, ``torch.onnx.export(dynamo=True,
optimize=False)``, Optimum's signature). repeat_kv's ``x[:, :, None, :, :]`` is written with Slices that keep
everything around its Unsqueeze; fuse_gqa's match stopped there (it read the repeated keys as the new ones and
found them as long as the cache plus the new tokens): 0 of 2 layers fused. Whole Slices are read through now.
Compared with the export under ORT, optimizations off, at lengths other than the export's and decoding on its
own cache.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from passes.fusion._gqa_match import _whole
from tests.models.build_decoders import Signature, decoder_feeds, presents_as_past
from tests.numerics import reference_session, run_named
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import parse

NOOPT = Path(__file__).resolve().parent.parent / "models" / "heldout" / "llama_past_dynamo_noopt.onnx"
LAYERS = 2


@pytest.fixture(scope="module")
def fused() -> tuple[ir.Model, dict[str, int]]:
    return fast_upto(NOOPT)


def test_every_layer_fuses_through_the_whole_slices(fused) -> None:
    model, counts = fused
    assert counts.get("fuse_gqa.fused_gqa") == LAYERS
    ops = op_histogram(model)
    assert ops["com.microsoft::GroupQueryAttention"] == LAYERS and "Softmax" not in ops


@pytest.mark.parametrize(("batch", "seq", "past"), [(2, 5, 0), (1, 1, 17), (1, 4, 9)])
def test_the_fused_decoder_matches_the_export_at_other_lengths(fused, batch, seq, past) -> None:
    model, _ = fused
    signature = Signature.of(NOOPT)
    reference, candidate = reference_session(NOOPT), reference_session(model)
    feeds = decoder_feeds(signature, batch, seq, past, seed=batch + seq + past)
    want, got = run_named(reference, feeds), run_named(candidate, feeds)
    for name, expected in want.items():
        np.testing.assert_allclose(got[name], expected, atol=1e-4, rtol=1e-4, err_msg=name)


def test_the_fused_decoder_decodes_on_its_reference_cache(fused) -> None:
    model, _ = fused
    signature = Signature.of(NOOPT)
    reference, candidate = reference_session(NOOPT), reference_session(model)
    feeds = decoder_feeds(signature, 1, 6, 0, seed=5)
    for step in range(4):
        want, got = run_named(reference, feeds), run_named(candidate, feeds)
        for name, expected in want.items():
            np.testing.assert_allclose(got[name], expected, atol=1e-4, rtol=1e-4, err_msg=f"{name} step {step}")
        past = presents_as_past(want)
        tokens = want["logits"][:, -1:].argmax(-1).astype(np.int64)
        length = past["past_key_values.0.key"].shape[2]
        feeds = decoder_feeds(signature, 1, 1, length, tokens=tokens, past_values=past)


def test_only_a_slice_that_keeps_everything_is_read_through() -> None:
    graph = ir.serde.deserialize_model(
        parse("""
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[B, 2, S, 8] x) => (float[B, 2, S, 8] whole, float[B, 2, S, 8] cut) <int64[2] zero = {0, 0},
          int64[2] end = {9223372036854775807, 9223372036854775807}, int64[2] short = {9223372036854775807, 3},
          int64[2] axes = {0, 1}, int64[2] one = {1, 1}> {
            whole = Slice(x, zero, end, axes, one)
            cut = Slice(x, zero, short, axes, one)
        }
        """)
    ).graph
    x = graph.inputs[0]
    assert _whole(graph.outputs[0]) is x
    assert _whole(graph.outputs[1]) is graph.outputs[1]  # ends at 3 on axis 1: not the whole axis
