"""Multi-head latent attention (MiniCPM3, DeepSeek-V3) through the ``fast`` preset's passes up to fuse_gqa
(issues 17/19, held-out decoders, rounds 2 and 8).

transformers caches MLA's compressed latent (one head: ``kv_lora_rank`` and the rotated key part) and expands it
to every head's keys (nope 16 + rope 8 = 24 wide) and values (16 wide) after the cache. GroupQueryAttention, and
MultiHeadAttention with 4-D keys, take one head size, and with no cache Concat in front of the keys the matcher
measured them one past too long ("key/value have shapes (1, 4, 5, 24)/(1, 4, 5, 16)"): no layer matched. Now each
layer matches; with ``attention='mha'`` it is MultiHeadAttention on flat ``[B, T, H*24]`` keys and ``[B, T, H*16]``
values (ORT's kernel takes different widths so) with the graph's mask as its bias, exact. That measured 2-10%
slower than the unfused graph (``bench/mla_attention_ab.py``), so ``auto`` leaves it, saying so. Dynamo writes
MiniCPM3's cached key transposed straight from its ``[d, h, S, B]`` scatter buffer, ``Transpose(X, [3, 1, 0, 2])``,
which ``_key_transpose.split_permuted`` gives the matcher's form.

``tests/models/heldout/minicpm3_past_{ts,dynamo}.onnx``: ``python -m bench.heldout_dec_round8 --only minicpm3
--forms past --exporters ts_eager dynamo --presets --tiny``; ``deepseek_v3_bmm_past_{ts,dynamo}.onnx``: round 2's
(``tests/passes/test_rotary_table_rows.py``). 2 layers, hidden 32, 4 heads, q/kv LoRA, Optimum's signature.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from passes._infra import PassContext, op_histogram
from passes.fusion._gqa_match import match_sites
from passes.fusion._key_transpose import split_permuted
from passes.fusion.fuse_gqa import MLA_SLOWER, FuseGqa, FuseGqaOptions
from passes.fusion.fuse_transformer import FuseTransformer, FuseTransformerOptions
from tests.numerics import assert_equivalent
from tests.passes._decoder_replay import assert_decodes_like_export, fast_upto

HELDOUT = Path(__file__).resolve().parent.parent / "models" / "heldout"
LAYERS, HEADS = 2, 4
CASES = ("minicpm3_past_ts", "minicpm3_past_dynamo", "deepseek_v3_bmm_past_ts", "deepseek_v3_bmm_past_dynamo")


@pytest.fixture(scope="module", params=CASES)
def rotated(request) -> tuple[str, ir.Model]:
    return request.param, fast_upto(HELDOUT / f"{request.param}.onnx", through="fuse_rotary")[0]


@pytest.fixture(scope="module")
def fused(rotated) -> tuple[str, ir.Model, dict[str, int]]:
    name, model = rotated
    result = FuseGqa(FuseGqaOptions(attention="mha"))(_copy(model), PassContext())
    return name, result.model, result.counts


def _copy(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


def test_with_attention_mha_each_layer_is_multi_head_attention_on_flat_keys_and_values(fused) -> None:
    _, model, counts = fused
    assert counts["fused_mha"] == LAYERS and not counts["fused_gqa"]
    ops = op_histogram(model)
    assert ops["com.microsoft::MultiHeadAttention"] == LAYERS and "Softmax" not in ops
    for node in (n for n in model.graph if n.op_type == "MultiHeadAttention"):
        key, value = node.inputs[1], node.inputs[2]
        assert key.producer().op_type == value.producer().op_type == "Reshape"  # [B, T, H*d], each its own width
        assert node.inputs[5] is not None  # the graph's own mask, as attention_bias


@pytest.mark.parametrize("prompt", [6, 19])
def test_fused_decoder_computes_what_the_export_does_on_a_growing_cache(fused, prompt) -> None:
    name, model, _ = fused
    assert_decodes_like_export(HELDOUT / f"{name}.onnx", model, batch=1 if prompt > 6 else 2, prompt=prompt)


def test_by_default_each_layer_is_left_with_the_measured_reason(rotated) -> None:
    _, model = rotated
    result = FuseGqa()(_copy(model), PassContext())
    reasons = [m.reason for m in result.non_matches if "attention layer" in m.reason]
    assert not result.counts.get("fused_mha") and not result.counts.get("fused_gqa")
    assert len(reasons) == LAYERS
    assert all("value heads are 16 wide and its query/key heads 24 (multi-head latent attention)" in r for r in reasons)
    assert all(MLA_SLOWER in r for r in reasons)


def _permuted_key_attention() -> tuple[ir.Model, object]:
    """Scores of q against a key kept as X [d, h, S, B] and transposed straight to k^T [B, h, d, S]."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Transpose", ["x"], ["kt"], perm=[3, 1, 0, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["context"]),
        helper.make_node("Transpose", ["context"], ["out"], perm=[0, 2, 1, 3]),
    ]
    inputs = [
        helper.make_tensor_value_info("q", f, ["b", 2, "s", 8]),
        helper.make_tensor_value_info("x", f, [8, 2, "s", "b"]),
        helper.make_tensor_value_info("v", f, ["b", 2, "s", 8]),
    ]
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("out", f, None)], [helper.make_tensor("scale", f, [], [0.3])]
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return ir.serde.deserialize_model(proto), proto


def test_a_key_transposed_from_another_layout_is_split_into_the_matchers_form_exactly() -> None:
    model, proto = _permuted_key_attention()
    assert not match_sites(model.graph)[0]
    assert split_permuted(model) == 1
    (site,) = match_sites(model.graph)[0]
    inner = site.k_new.producer()
    assert inner.op_type == "Transpose" and list(inner.attributes.get_ints("perm")) == [3, 1, 2, 0]
    shapes = [{"q": (2, 2, 5, 8), "x": (8, 2, 5, 2), "v": (2, 2, 5, 8)}, {"q": (1, 2, 3, 8), "x": (8, 2, 3, 1)}]
    shapes[1]["v"] = (1, 2, 3, 8)
    assert_equivalent(proto, model, shapes, rtol=0, atol=0)
    again, _ = _permuted_key_attention()
    again.graph.node(0).attributes["perm"] = ir.AttrInt64s("perm", [0, 1, 3, 2])  # the form read as it is
    assert split_permuted(again) == 0
    assert np.array_equal(list(again.graph.node(0).attributes.get_ints("perm")), [0, 1, 3, 2])


@pytest.fixture(scope="module", params=CASES)
def transformed(request) -> tuple[str, ir.Model, dict[str, int], list[str]]:
    """Through fuse_transformer, whose report is read off the pass itself (fast_upto keeps only the counts)."""
    model, _ = fast_upto(HELDOUT / f"{request.param}.onnx", through="fuse_gqa")
    result = FuseTransformer(FuseTransformerOptions())(model, PassContext())
    return request.param, result.model, result.counts, [m.reason for m in result.non_matches]


def test_fuse_transformer_leaves_latent_attention_as_fuse_gqa_does_and_keeps_its_other_fusions(transformed) -> None:
    """onnxscript's rules fused MLA as MultiHeadAttention against fuse_gqa's measurement, and in a cached export gave
    it 4-D values narrower than its keys, which ORT refused: the whole candidate was lost, its skip norms with it."""
    name, model, counts, reasons = transformed
    ops = op_histogram(model)
    assert not counts["fused_attention"] and ops["Softmax"] == LAYERS
    assert counts["fused_skip_layer_norm"] == 2 * LAYERS
    per_layer = [r for r in reasons if "Softmax" in r and "attention layer" in r]
    assert len(per_layer) == LAYERS and all(MLA_SLOWER in r for r in per_layer)
    (summary,) = (r for r in reasons if r.startswith("attention: expected"))
    assert "left unfused by design" in summary and MLA_SLOWER in summary
    assert not any("rejected" in r for r in reasons)
    assert_decodes_like_export(HELDOUT / f"{name}.onnx", model, batch=2, prompt=7)
