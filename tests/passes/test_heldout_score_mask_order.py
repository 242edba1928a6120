"""GPT-Neo's and CodeGen's cached exports through the ``fast`` preset's passes up to fuse_gqa (issue 17/19,
held-out decoders, round 2).

``tests/models/heldout/gpt_neo_past_ts.onnx`` and ``codegen_past_dynamo.onnx``: ``python -m
bench.heldout_dec_round2 --only gpt_neo codegen --forms past --exporters ts_eager dynamo --presets --tiny``
(2 layers, hidden 32, 4 heads of 8, vocabulary 256, Optimum's signature; TorchScript eager and dynamo).
Neither orders its scores as ``Softmax(scale * (q @ k^T) + mask)``: GPT-Neo applies its causal mask (a
window of 64 keys on its local layer) with ``Where`` on unscaled scores and adds the padding mask after,
CodeGen adds the mask before dividing by ``sqrt(d)``. fuse_gqa declined every layer of both ("an Add before
the Softmax whose inputs are not scores"; "expected MatMul(q, k^T) under the scale; found Add") until
``_score_mask_order`` rewrote them to that order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from passes import registry
from passes._infra import PassContext, op_histogram
from tests.models.build_decoders import Signature, decoder_feeds, presents_as_past
from tests.passes._util import session

HELDOUT = Path(__file__).resolve().parent.parent / "models" / "heldout"
LAYERS = 2
# model -> GroupQueryAttention's scale (GPT-Neo does not scale its scores; CodeGen divides by sqrt(8))
CASES = {"gpt_neo_past_ts": 1.0, "codegen_past_dynamo": 8**-0.5}


def _upto_fuse_gqa(path: Path) -> tuple[ir.Model, dict[str, int]]:
    model = ir.load(path)
    specs = registry.PRESETS["fast"].specs
    upto = [s for s in specs[: [s.name for s in specs].index("fuse_gqa") + 1] if s.name != "padding_elimination"]
    counts: dict[str, int] = {}
    for p in registry.build_passes(upto):
        result = p(model, PassContext())
        model = result.model
        for key, value in result.counts.items():
            counts[f"{p.name}.{key}"] = counts.get(f"{p.name}.{key}", 0) + value
    return model, counts


@pytest.fixture(scope="module", params=sorted(CASES))
def fused(request) -> tuple[str, ir.Model, dict[str, int]]:
    return request.param, *_upto_fuse_gqa(HELDOUT / f"{request.param}.onnx")


def test_every_layer_becomes_group_query_attention_with_the_models_scale(fused) -> None:
    name, model, counts = fused
    ops = op_histogram(model)
    assert counts.get("fuse_gqa.fused_gqa", 0) == LAYERS
    assert ops["com.microsoft::GroupQueryAttention"] == LAYERS
    assert "Softmax" not in ops and "Where" not in ops
    nodes = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    for node in nodes:
        assert node.attributes.get_float("scale") == pytest.approx(CASES[name], rel=1e-6)
    windows = sorted(node.attributes.get_int("local_window_size", -1) for node in nodes)
    if name.startswith("gpt_neo"):  # global then local (64 keys) attention
        assert windows[0] == -1 and windows[1] > 0, windows
    else:
        assert windows == [-1, -1]
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


def test_fused_decoder_computes_what_the_export_does_on_a_growing_cache(fused) -> None:
    name, model, _ = fused
    path = HELDOUT / f"{name}.onnx"
    signature = Signature.of(path)
    reference, candidate = session(path), session(model, optimized=True)
    names = [o.name for o in reference.get_outputs()]
    feeds = decoder_feeds(signature, 2, 6, 0, seed=3)  # the export's example was 2 x 3 after 4
    for step in range(5):  # a prefill on an empty cache, then one token at a time on the reference's cache
        want = dict(zip(names, reference.run(names, feeds), strict=True))
        got = dict(zip(names, candidate.run(names, feeds), strict=True))
        for out in names:
            np.testing.assert_allclose(got[out], want[out], rtol=1e-4, atol=1e-5, err_msg=f"{out} step {step}")
        past = presents_as_past(want)
        tokens = want["logits"][:, -1:].argmax(-1).astype(np.int64)
        feeds = decoder_feeds(signature, 2, 1, past["past_key_values.0.key"].shape[2], tokens=tokens, past_values=past)
