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

import onnx
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from tests.passes._decoder_replay import assert_decodes_like_export, fast_upto

HELDOUT = Path(__file__).resolve().parent.parent / "models" / "heldout"
LAYERS = 2
# model -> GroupQueryAttention's scale (GPT-Neo does not scale its scores; CodeGen divides by sqrt(8))
CASES = {"gpt_neo_past_ts": 1.0, "codegen_past_dynamo": 8**-0.5}


@pytest.fixture(scope="module", params=sorted(CASES))
def fused(request) -> tuple[str, ir.Model, dict[str, int]]:
    return request.param, *fast_upto(HELDOUT / f"{request.param}.onnx")


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
    assert_decodes_like_export(HELDOUT / f"{name}.onnx", model)  # the export's example was 2 x 3 after 4
