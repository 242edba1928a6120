"""Rotary written without transformers: ``cos``/``sin`` buffers ``[1, 1, max_pos, head]`` cut to the sequence
(``self.cos[:, :, :T]``) and broadcast, no position_ids anywhere (``tests/models/heldout/own_llama_dynamo.onnx``,
``python -m tests.models.build_heldout_own_models``). fuse_rotary declined it ("cos is not unsqueezed on the
heads axis 1"); it now reads the cut table as rows 0..S-1, the kernel's one-element start. onnxscript's GQA
rewrite derives seqlens_k from [batch, sequence] position_ids and is not offered such a rotation (its candidate
failed to load), so attention fuses as MultiHeadAttention."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes._infra import op_histogram
from passes.fusion import fuse_transformer as ft
from passes.fusion._rotary_match import Declined, cos_sin
from passes.fusion.fuse_rotary import FuseRotary
from tests.models.build_heldout_own_models import llama_feeds
from tests.passes._decoder_replay import fast_upto
from tests.passes._util import session

MODEL = Path(__file__).resolve().parent.parent / "models" / "heldout" / "own_llama_dynamo.onnx"


def test_cut_cos_sin_tables_fuse_to_rotary_embedding_from_position_zero() -> None:
    result = FuseRotary()(ir.load(MODEL))
    assert result.counts["rotary_embeddings"] == 4 and not result.non_matches
    rotaries = [n for n in result.model.graph if n.op_type == "RotaryEmbedding"]
    assert all(n.inputs[1].const_value.numpy().tolist() == [0] for n in rotaries)  # rows 0..S-1
    assert "Sin" not in op_histogram(result.model) and "Cos" not in op_histogram(result.model)


def test_own_llama_fuses_rotary_and_attention_and_computes_what_the_export_does() -> None:
    ft._LAST.clear()
    model, counts = fast_upto(MODEL, through="fuse_transformer")
    assert counts["fuse_rotary.rotary_embeddings"] == 4
    assert counts["fuse_transformer.fused_attention"] == 2
    ops = op_histogram(model)
    assert ops["com.microsoft::RotaryEmbedding"] == 4 and "Softmax" not in ops
    reference, fused = session(MODEL), session(model, optimized=True)
    for batch, seq in ((1, 5), (3, 17), (2, 128)):
        x = llama_feeds(batch, seq, seed=seq)
        np.testing.assert_allclose(fused.run(None, x)[0], reference.run(None, x)[0], rtol=1e-4, atol=1e-5)


def _cut(start: int, axis: int, halves_equal: bool = True) -> ir.Value:
    """Slice(table [1, 1, 16, 4], start:S, axis) feeding a Mul, as the factor cos_sin reads."""
    rows = np.arange(16 * 2, dtype=np.float32).reshape(16, 2)
    table = np.concatenate([rows, rows if halves_equal else rows + 1], axis=-1)[None, None]
    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["x"], ["shape"], start=2, end=3),
            helper.make_node("Slice", ["table", "start", "shape", "axis"], ["cos"]),
            helper.make_node("Mul", ["x", "cos"], ["y"]),
        ],
        "cut",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 2, "S", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 2, "S", 4])],
        [
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(np.array([start], np.int64), "start"),
            numpy_helper.from_array(np.array([axis], np.int64), "axis"),
        ],
    )
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    return next(n for n in model.graph if n.op_type == "Mul").inputs[1]


def test_cut_table_is_read_only_from_row_zero_on_the_positions_axis() -> None:
    found = cos_sin(_cut(0, 2), "Cos")
    assert found.kind == "table" and found.positions is None and found.values.shape == (16, 2)
    for start, axis in ((1, 2), (0, 3)):  # rows from 1: not positions 0..S-1; a cut of the channels
        with pytest.raises(Declined, match="not unsqueezed"):
            cos_sin(_cut(start, axis), "Cos")
    with pytest.raises(Declined, match="halves differ"):
        cos_sin(_cut(0, 2, halves_equal=False), "Cos")
