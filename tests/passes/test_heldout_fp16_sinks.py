"""GPT-OSS exported in half precision fuses its rotary too, and its routers are no attention (issues 17/19).

``tests/models/heldout/gpt_oss_fp16_ts.onnx`` (``python -m tests.models.build_heldout_fp16_sinks``): ``model.half()``
without a cache. fuse_rotary's check of the chunked-halves rope compared the graph's float16 output with a
float32 reference within 1e-5 and declined all four ("the output is not Concat(...) of the cache rows"); it allows
the float16 rounding of the products now. Its routers normalize only their top-k logits, ``softmax(topk(x @ W +
b).values)``, which was not read as a router: fuse_gqa numbered them attention layers. Both fixed; the sinks fuse
into GroupQueryAttention as in float32.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes._infra import op_histogram
from passes.fusion._fusion_families import count_layers, is_router
from tests.models.build_heldout_fp16_sinks import PATH, feeds
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import session


def test_the_half_precision_export_fuses_its_rope_and_its_sink_attention() -> None:
    model, counts = fast_upto(PATH)
    ops = op_histogram(model)
    assert counts.get("fuse_rotary.rotary_embeddings", 0) == 4 and ops["com.microsoft::RotaryEmbedding"] == 4
    assert counts.get("fuse_gqa.fused_gqa", 0) == 2 and ops["com.microsoft::GroupQueryAttention"] == 2
    assert all(n.inputs[11] is not None for n in model.graph if n.op_type == "GroupQueryAttention")  # head_sink
    reference, fused = session(PATH), session(model, optimized=True)
    for batch, seq in ((1, 6), (2, 13)):
        feed = feeds(batch, seq, seed=seq)
        got, want = (s.run(None, feed)[0].astype(np.float32) for s in (fused, reference))
        np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2, err_msg=f"{batch}x{seq}")


def test_a_router_over_its_top_k_logits_is_no_attention_layer() -> None:
    model = ir.load(PATH)
    softmaxes = [n for n in model.graph if n.op_type == "Softmax"]
    routers = [n for n in softmaxes if is_router(n)]
    assert len(softmaxes) == 4 and len(routers) == 2
    assert all("router" in (n.name or "") for n in routers)
    assert count_layers(model) == 2
