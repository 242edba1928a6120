"""How many cos/sin rows fuse_rotary's interleaved match computes (issue 17/19, held-out decoders round 2).

CodeGen's dynamo export gathers its sin|cos from a fixed ``embed_positions`` table (``n_positions`` rows) with a
``GatherND``; the probe ran the factors at ``max_positions`` (4096) rows, past the table's end, and ORT refused
the index ("cos/sin did not compute at 4096 positions"): rotary 0/4. The cache now has the table's rows.
``tests/models/heldout/codegen_past_dynamo.onnx``: ``python -m bench.heldout_dec_round2 --only codegen --forms
past --exporters dynamo --presets --tiny`` (2 layers, hidden 32, 4 heads of 8, a 128-row table).

Angles computed from ``position_ids`` are run in parts of ``CHUNK_ROWS`` positions, so a long max_positions
never builds [1, rows, hidden] activations at once; angles of the graph's own Range go at once up to
``AT_ONCE_ROWS`` and are declined, with the option that would fuse, beyond it.

DeepSeek-V3's MLA rope (committed tiny TorchScript and dynamo exports) rotates pairs but writes them evens
first: ``RotaryEmbedding(interleaved=0)`` of ``Concat(x[..., 0::2], x[..., 1::2])`` (``_rotary_split_pairs``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from passes._infra import PassContext, op_histogram
from passes.fusion import _rotary_interleaved_probe as probe
from passes.fusion._rotary_eval import const
from passes.fusion.fuse_rotary import FuseRotary, FuseRotaryOptions, cache_rows
from tests.models.build_decoders import Signature, decoder_feeds
from tests.numerics import reference_session, run_named
from tests.passes._util import session

CODEGEN = Path(__file__).resolve().parent.parent / "models" / "heldout" / "codegen_past_dynamo.onnx"
HEADS, D = 2, 8


def _rotary_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "RotaryEmbedding" and n.domain == "com.microsoft"]


def test_codegen_dynamo_table_gathered_by_gathernd_fuses_with_the_tables_rows() -> None:
    # setup
    model = ir.load(CODEGEN)
    (table,) = [t for n in model.graph if n.op_type == "GatherND" and (t := const(n.inputs[0])) is not None]
    # execute
    result = FuseRotary(FuseRotaryOptions(max_positions=4096))(model, PassContext())
    # assert
    nodes = _rotary_nodes(result.model)
    assert result.counts["interleaved_rotary"] == 4 and len(nodes) == 4, result.non_matches
    assert all(n.attributes["interleaved"].as_int() == 1 for n in nodes)
    assert not any(n.op_type in ("Sin", "Cos", "Neg") for n in result.model.graph)
    assert not any(n.op_type == "GatherND" and const(n.inputs[0]) is not None for n in result.model.graph)
    caches = cache_rows(result.model)
    assert {c.shape for c in caches.values()} == {(table.shape[0], table.shape[1] // 2)}
    np.testing.assert_array_equal(caches["rotary_emb.sin_cache"], table[:, : table.shape[1] // 2])
    # outputs at other batch, prompt and cache lengths than the export's (2 x 3 after 4)
    reference, fused = session(CODEGEN), session(result.model)
    names = [o.name for o in reference.get_outputs()]
    signature = Signature.of(CODEGEN)
    for batch, prompt, past in ((1, 1, 0), (3, 17, 0), (2, 5, 40), (1, 1, 120)):
        feeds = decoder_feeds(signature, batch, prompt, past, seed=batch + past)
        want, got = reference.run(names, feeds), fused.run(names, feeds)
        for name, a, b in zip(names, got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"{name} {batch}x{prompt}+{past}")


def _computed_rotation(positions: str) -> onnx.ModelProto:
    """Interleaved rotation of x [B, N, S, D] by ``cos(p * inv_freq)`` repeated pairwise, p from a
    ``position_ids`` input (``positions="input"``) or from ``Range(0, S)`` of the token ids' shape (``"range"``)."""
    inv_freq = np.repeat(1.0 / 10000 ** (np.arange(0, D, 2) / D), 2).astype(np.float32)
    big = np.iinfo(np.int64).max
    inits = [
        helper.make_tensor("inv_freq", TensorProto.FLOAT, [D], inv_freq),
        *(helper.make_tensor(n, TensorProto.INT64, [1], [v]) for n, v in [("zero", 0), ("one", 1), ("two", 2)]),
        helper.make_tensor("end", TensorProto.INT64, [1], [big]),
        helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("flat", TensorProto.INT64, [4], [0, 0, 0, -1]),
        helper.make_tensor("s0", TensorProto.INT64, [], [0]),
        helper.make_tensor("s1", TensorProto.INT64, [], [1]),
        helper.make_tensor("heads_axis", TensorProto.INT64, [2], [0, 1]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", HEADS, "sequence", D])]
    if positions == "input":
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "sequence"]))
        where = [helper.make_node("Cast", ["position_ids"], ["p"], to=TensorProto.FLOAT)]
        head_axis = "one"  # [B, S, D] -> [B, 1, S, D]
    else:
        inputs.append(helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]))
        where = [  # the length from the token ids, as a decoder reads it
            helper.make_node("Shape", ["input_ids"], ["x_shape"], start=1, end=2),
            helper.make_node("Squeeze", ["x_shape"], ["seq"]),
            helper.make_node("Range", ["s0", "seq", "s1"], ["arange"]),
            helper.make_node("Cast", ["arange"], ["p"], to=TensorProto.FLOAT),
        ]
        head_axis = "heads_axis"  # [S, D] -> [1, 1, S, D]
    nodes = [
        *where,
        helper.make_node("Unsqueeze", ["p", "last"], ["p_u"]),
        helper.make_node("Mul", ["p_u", "inv_freq"], ["angles"]),
        helper.make_node("Cos", ["angles"], ["cos_a"]),
        helper.make_node("Sin", ["angles"], ["sin_a"]),
        helper.make_node("Unsqueeze", ["cos_a", head_axis], ["cos"]),
        helper.make_node("Unsqueeze", ["sin_a", head_axis], ["sin"]),
        helper.make_node("Slice", ["x", "one", "end", "last", "two"], ["x_odd"]),
        helper.make_node("Slice", ["x", "zero", "end", "last", "two"], ["x_even"]),
        helper.make_node("Neg", ["x_odd"], ["neg"]),
        helper.make_node("Unsqueeze", ["neg", "last"], ["neg_u"]),
        helper.make_node("Unsqueeze", ["x_even", "last"], ["pos_u"]),
        helper.make_node("Concat", ["neg_u", "pos_u"], ["stack"], axis=-1),
        helper.make_node("Reshape", ["stack", "flat"], ["rotated"]),
        helper.make_node("Mul", ["x", "cos"], ["x_cos"]),
        helper.make_node("Mul", ["rotated", "sin"], ["r_sin"]),
        helper.make_node("Add", ["x_cos", "r_sin"], ["y"]),
    ]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", HEADS, "sequence", D])
    graph = helper.make_graph(nodes, "rotation", inputs, [output], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_position_ids_angles_past_one_chunk_are_computed_in_parts(monkeypatch) -> None:
    # setup: a context of 2.5 probe chunks; every run's sequence length recorded
    rows = 2 * probe.CHUNK_ROWS + probe.CHUNK_ROWS // 2
    proto = _computed_rotation("input")
    lengths: list[int] = []
    runs = probe._runs

    def recording(model, values, feeds, shapes):
        lengths.extend(shape[1] for shape, _ in shapes)
        return runs(model, values, feeds, shapes)

    monkeypatch.setattr(probe, "_runs", recording)
    # execute
    result = FuseRotary(FuseRotaryOptions(max_positions=rows))(ir.serde.deserialize_model(proto), PassContext())
    # assert
    assert result.counts["interleaved_rotary"] == 1 and not result.non_matches
    assert max(lengths) == probe.CHUNK_ROWS and sum(n for n in lengths if n > 5) == rows, lengths
    assert op_histogram(result.model)["Cos"] == 0
    cos = cache_rows(result.model)["rotary_emb.cos_cache"]
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    angles = (np.arange(rows, dtype=np.float32)[:, None] * inv_freq[None, :]).astype(np.float32)
    assert cos.shape == (rows, D // 2)
    np.testing.assert_allclose(cos, np.cos(angles), atol=1e-6)
    reference, fused = reference_session(proto), reference_session(result.model)
    rng = np.random.default_rng(0)
    for batch, seq, first in ((1, 3, 0), (2, 7, probe.CHUNK_ROWS - 3), (2, 5, rows - 5)):  # across a chunk's end
        feeds = {
            "x": rng.standard_normal((batch, HEADS, seq, D)).astype(np.float32),
            "position_ids": np.tile(np.arange(first, first + seq), (batch, 1)).astype(np.int64),
        }
        np.testing.assert_allclose(run_named(fused, feeds)["y"], run_named(reference, feeds)["y"], atol=2e-5)


@pytest.mark.parametrize("over", [False, True])
def test_range_angles_go_at_once_up_to_a_bound_and_are_declined_past_it(over: bool) -> None:
    # setup
    rows = probe.AT_ONCE_ROWS + 1 if over else probe.CHUNK_ROWS + 8
    proto = _computed_rotation("range")
    # execute
    result = FuseRotary(FuseRotaryOptions(max_positions=rows))(ir.serde.deserialize_model(proto), PassContext())
    # assert
    if over:
        assert not _rotary_nodes(result.model) and op_histogram(result.model)["Neg"] == 1
        assert any(f"max_positions <= {probe.AT_ONCE_ROWS}" in m.reason for m in result.non_matches)
        return
    assert result.counts["interleaved_rotary"] == 1 and not result.non_matches
    assert cache_rows(result.model)["rotary_emb.cos_cache"].shape == (rows, D // 2)
    x = np.random.default_rng(1).standard_normal((2, HEADS, 33, D)).astype(np.float32)
    feeds = {"x": x, "input_ids": np.zeros((2, 33), np.int64)}
    got = run_named(reference_session(result.model), feeds)["y"]
    np.testing.assert_allclose(got, run_named(reference_session(proto), feeds)["y"], atol=1e-5)


# ------------------------------------------------------------------ DeepSeek-V3's MLA rope (split pairs)

# ``python -m bench.heldout_dec_round2 --only deepseek_v3_bmm --forms past --exporters ts_eager dynamo --presets
# --tiny``: a rope slice of 8 channels per head (qk_rope_head_dim), pairs (2i, 2i+1) rotated and written evens
# first, ``cat([x1*c - x2*s, x2*c + x1*s])``; before: "Cos feeds no q*cos + rotate_half(q)*sin", rotary 0/4.
DEEPSEEK = ("deepseek_v3_bmm_past_dynamo.onnx", "deepseek_v3_bmm_past_ts.onnx")


@pytest.mark.parametrize("name", DEEPSEEK)
def test_deepseek_mla_rope_on_split_pairs_becomes_rotary_embedding_of_its_halves(name: str) -> None:
    # setup
    path = CODEGEN.parent / name
    # execute
    result = FuseRotary()(ir.load(path), PassContext())
    # assert
    nodes = _rotary_nodes(result.model)
    assert result.counts["rotary_embeddings"] == 4 and len(nodes) == 4, result.non_matches
    assert all(n.attributes["interleaved"].as_int() == 0 for n in nodes)
    assert all(n.inputs[0].producer().op_type == "Concat" for n in nodes)  # Concat(x[..., 0::2], x[..., 1::2])
    assert not any(n.op_type in ("Sin", "Cos", "Sub") for n in result.model.graph)
    reference, fused = session(path), session(result.model)
    names = [o.name for o in reference.get_outputs()]
    signature = Signature.of(path)
    for batch, prompt, past in ((1, 1, 0), (3, 17, 0), (2, 5, 40), (1, 1, 7)):
        feeds = decoder_feeds(signature, batch, prompt, past, seed=batch + past)
        want, got = reference.run(names, feeds), fused.run(names, feeds)
        for out, a, b in zip(names, got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"{out} {batch}x{prompt}+{past}")


def test_split_pairs_with_the_halves_swapped_are_not_fused() -> None:
    # setup: the same rotation but its two halves concatenated odds first (another channel order)
    model = ir.load(CODEGEN.parent / DEEPSEEK[0])
    concats = [n for n in model.graph if n.op_type == "Concat" and len(n.inputs) == 2]
    swapped = 0
    for node in concats:
        ops = [v.producer().op_type if v.producer() is not None else None for v in node.inputs]
        if ops == ["Sub", "Add"]:
            first, second = node.inputs
            node.replace_input_with(0, second)
            node.replace_input_with(1, first)
            swapped += 1
    assert swapped == 4
    # execute
    result = FuseRotary()(model, PassContext())
    # assert
    assert not _rotary_nodes(result.model)
