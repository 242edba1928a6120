"""Attention written as transformers 4.x wrote BART, Marian, M2M100 and Whisper (and XGLM still does): heads
folded into the batch (``torch.bmm`` on ``[B*h, S, d]``) and the Softmax on the folded ``[B*h, S, T]`` scores,
the mask (when there is one) added on a 4-D view between two Reshapes, XGLM's scores clamped at ``finfo.min``
after it. Nothing fused there: onnxscript's SDPA rule and ``unfold_batched_heads`` read a 4-D Softmax.
``softmax_before_fold`` moves the Softmax to the 4-D scores, ``_score_mask_order``'s clamp rule puts the clamp
on the mask, and a LayerNorm encoder of the team's own (no transformers embedding layout) gets a family from
its norms instead of "unknown".

Models: ``tests/models/heldout/bmm_{mask,nomask}_{ts,dynamo}.onnx`` (``python -m
tests.models.build_heldout_bmm_softmax``) and ``xglm_past_ts.onnx`` (``python -m bench.heldout_dec_round2
--only xglm --exporters ts_eager --forms past --presets --tiny``: 2 layers, hidden 32, 4 heads of 8, Optimum's
cache signature).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes._infra import op_histogram
from passes.fusion import _batched_heads, _fusion_families
from passes.fusion import fuse_transformer as ft
from passes.fusion._score_mask_order import rules as score_rules
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._decoder_replay import assert_decodes_like_export, fast_upto
from tests.passes._util import session

HELDOUT = Path(__file__).resolve().parent.parent / "models" / "heldout"
LAYERS = 2
FOLDED = ["bmm_mask_ts", "bmm_mask_dynamo", "bmm_nomask_ts", "bmm_nomask_dynamo"]


def _feeds(name: str, batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * 100 + seq)
    feeds = {"input_ids": rng.integers(0, 64, (batch, seq)).astype(np.int64)}
    if "nomask" not in name:
        mask = np.ones((batch, seq), np.int64)
        mask[1:, seq // 2 :] = 0
        feeds["attention_mask"] = mask
    return feeds


@pytest.mark.parametrize("name", FOLDED)
def test_folded_softmax_attention_fuses_and_computes_what_the_export_does(name: str) -> None:
    ft._LAST.clear()
    result = FuseTransformer({"pack_qkv": True})(ir.load(HELDOUT / f"{name}.onnx"))
    onnxscript = result.notes["candidates"]["onnxscript"]
    assert onnxscript["softmax_unfolded"] == LAYERS and onnxscript["bmm_unfolded"] == 2 * LAYERS
    assert result.counts["fused_attention"] == LAYERS and "attention" not in result.notes["missing"]
    assert "Softmax" not in op_histogram(result.model)
    reference, fused = session(HELDOUT / f"{name}.onnx"), session(result.model, optimized=True)
    for batch, seq in ((1, 3), (3, 11), (2, 40)):
        feeds = _feeds(name, batch, seq)
        np.testing.assert_allclose(fused.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["bmm_mask_ts", "bmm_nomask_dynamo"])
def test_own_layernorm_encoder_gets_a_family_from_its_norms(name: str) -> None:
    model = ir.load(HELDOUT / f"{name}.onnx")
    family, evidence = _fusion_families.detect_family(model)
    assert family == "distilbert" and "post-norm" in evidence and "no embedding layout" in evidence


def _pre_norm_block() -> onnx.ModelProto:
    """x + attention(LN(x)): the residual stream read by the norm and the Add (pre-norm)."""
    scale = numpy_helper.from_array(np.ones(8, np.float32), "gamma")
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma"], ["n"], axis=-1),
        helper.make_node("Transpose", ["n"], ["nt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["n", "nt"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "n"], ["attended"]),
        helper.make_node("Add", ["x", "attended"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "pre_norm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", 8])],
        [scale],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_own_pre_norm_encoder_is_read_as_vit_layers() -> None:
    family, evidence = _fusion_families.detect_family(ir.serde.deserialize_model(_pre_norm_block()))
    assert family == "vit" and "pre-norm" in evidence


def _folded(axis: int, fold: list[int]) -> onnx.ModelProto:
    """x4 [2, 4, 5, 6] -> Reshape(fold) -> Softmax(axis)."""
    shape = numpy_helper.from_array(np.array(fold, np.int64), "fold")
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "fold"], ["folded"]),
            helper.make_node("Softmax", ["folded"], ["p"], axis=axis),
            helper.make_node("Identity", ["p"], ["y"]),
        ],
        "folded_softmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 5, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [shape],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("axis", "fold", "moved"), [(-1, [8, 5, 6], 1), (2, [8, 5, 6], 1), (1, [8, 5, 6], 0)])
def test_softmax_moves_across_a_leading_fold_only_over_the_last_axis(axis: int, fold: list[int], moved: int) -> None:
    proto = _folded(axis, fold)
    model = ir.serde.deserialize_model(proto)
    common_passes.ShapeInferencePass()(model)
    assert _batched_heads.softmax_before_fold(model) == moved
    if moved:
        softmax = next(n for n in model.graph if n.op_type == "Softmax")
        assert list(softmax.inputs[0].shape) == [2, 4, 5, 6]
    x = np.random.default_rng(0).standard_normal((2, 4, 5, 6)).astype(np.float32)
    want = session(ir.serde.deserialize_model(proto)).run(None, {"x": x})[0]
    got = session(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def _clamped(floor: float) -> onnx.ModelProto:
    """Softmax(Max(q @ k^T + mask, floor)), the mask [B, 1, 1, T] of 0 and finfo.min (or both summed: -inf)."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["q", "kt"], ["scores"]),
            helper.make_node("Add", ["scores", "mask"], ["masked"]),
            helper.make_node("Max", ["masked", "floor"], ["clamped"]),
            helper.make_node("Softmax", ["clamped"], ["y"], axis=-1),
        ],
        "clamped",
        [
            helper.make_tensor_value_info("q", TensorProto.FLOAT, ["B", 2, "S", 4]),
            helper.make_tensor_value_info("kt", TensorProto.FLOAT, ["B", 2, 4, "T"]),
            helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["B", 1, 1, "T"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 2, "S", "T"])],
        [numpy_helper.from_array(np.array(floor, np.float32), "floor")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_clamp_of_the_masked_scores_moves_onto_the_mask_exactly() -> None:
    low = float(np.finfo(np.float32).min)
    proto = _clamped(low)
    model = ir.serde.deserialize_model(proto)
    assert score_rules.apply_to_model(model) == 1
    add = next(n for n in model.graph if n.op_type == "Add")
    assert add.inputs[1].producer().op_type == "Max" and next(iter(add.outputs[0].uses())).node.op_type == "Softmax"
    rng = np.random.default_rng(0)
    mask = np.zeros((3, 1, 1, 5), np.float32)
    mask[1, ..., 3:] = low
    mask[2] = -np.inf  # a row masked twice over: every key at -inf, the clamp makes it uniform
    feeds = {"q": rng.standard_normal((3, 2, 4, 4)).astype(np.float32) * 30, "mask": mask}
    feeds["kt"] = rng.standard_normal((3, 2, 4, 5)).astype(np.float32) * 30
    want = session(ir.serde.deserialize_model(proto)).run(None, feeds)[0]
    got = session(model).run(None, feeds)[0]
    np.testing.assert_array_equal(got, want)


def test_clamp_that_is_not_a_large_negative_stays() -> None:
    model = ir.serde.deserialize_model(_clamped(-1e4))
    assert score_rules.apply_to_model(model) == 0


def test_xglm_cached_decoder_fuses_every_attention_and_decodes_like_the_export() -> None:
    path = HELDOUT / "xglm_past_ts.onnx"
    model, counts = fast_upto(path, through="fuse_transformer")
    assert counts["fuse_gqa.scores_reordered"] == LAYERS  # the clamps, put on the mask
    assert counts["fuse_transformer.fused_attention"] == LAYERS
    assert op_histogram(model)["com.microsoft::MultiHeadAttention"] == LAYERS and "Softmax" not in op_histogram(model)
    assert_decodes_like_export(path, model)
