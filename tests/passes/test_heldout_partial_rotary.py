"""GPT-NeoX's partial rotary through the ``fast`` preset's passes up to fuse_rotary (issue 17, held-out decoders).

``tests/models/heldout/gpt_neox_past_ts.onnx``: ``python -m bench.heldout_dec_past --only gpt_neox --exporters
ts`` (tiny GPTNeoXForCausalLM from its config: 2 layers, hidden 32, 4 heads, ``rotary_pct`` 0.25 so 2 of 8
dims rotate, parallel residual; TorchScript export with a KV cache in Optimum's signature). q and k come
from the fused qkv projection sliced on the last axis after the head Transpose, where fuse_rotary did not
read the heads: each rotation was fused on the 2-dim slice alone, the Slice/Concat around it kept, and a Cos
kept computed for the slice's end (``q[..., : cos.shape[-1]]``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from passes import registry
from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_rotary import FuseRotary
from tests.models.build_decoders import Signature, decoder_feeds
from tests.passes._decoder_replay import assert_decodes_like_export
from tests.passes._util import session

MODEL = Path(__file__).resolve().parent.parent / "models" / "heldout" / "gpt_neox_past_ts.onnx"
LAYERS = 2


@pytest.fixture(scope="module")
def fused() -> tuple[ir.Model, dict]:
    model = ir.load(MODEL)
    specs = registry.PRESETS["fast"].specs
    before = [s for s in specs[: [s.name for s in specs].index("fuse_rotary")] if s.name != "padding_elimination"]
    for p in registry.build_passes(before):
        model = p(model, PassContext()).model
    result = FuseRotary()(model, PassContext())
    for p in registry.build_passes([s for s in specs if s.name == "dead_node_elimination"]):
        model = p(model, PassContext()).model
    return model, result.counts


def test_partial_rotary_of_a_fused_qkv_is_one_rotary_embedding_over_the_whole_head(fused) -> None:
    model, counts = fused
    ops = op_histogram(model)
    assert counts["rotary_embeddings"] == counts["partial_rotary"] == 2 * LAYERS
    assert ops["com.microsoft::RotaryEmbedding"] == 2 * LAYERS
    assert ops["Sin"] == ops["Cos"] == ops["Neg"] == 0  # the Cos read only for its static width is gone too
    for node in model.graph:
        if node.op_type == "RotaryEmbedding":
            attrs = {k: a.value for k, a in node.attributes.items()}
            assert attrs["rotary_embedding_dim"] == 2 and attrs["num_heads"] == 4
            # the rotation takes q/k whole (head size 8): no Concat of the rotated dims with the rest on the
            # last axis (the key's one Concat is the cache's, on the sequence axis)
            for use in node.outputs[0].uses():
                if use.node.op_type == "Concat":
                    assert use.node.attributes["axis"].as_int() in (2, -2)
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)


@pytest.mark.parametrize(("batch", "prompt", "past"), [(2, 7, 0), (2, 1, 9), (1, 4, 6), (3, 5, 40)])
def test_partial_rotary_computes_what_the_export_does(fused, batch, prompt, past) -> None:
    model, _ = fused
    signature = Signature.of(MODEL)
    reference, candidate = session(MODEL), session(model, optimized=True)
    names = [o.name for o in reference.get_outputs()]
    feeds = decoder_feeds(signature, batch, prompt, past, seed=batch + past)
    for name, want, got in zip(names, reference.run(names, feeds), candidate.run(names, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{name} at {batch, prompt, past}")


def test_partial_rotary_decodes_token_by_token_on_a_growing_cache(fused) -> None:
    model, _ = fused
    assert_decodes_like_export(MODEL, model)
