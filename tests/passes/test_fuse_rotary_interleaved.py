"""fuse_rotary on interleaved ("GPT-J style", rotate_every_two) rotary embeddings (issue 17/19, held-out probes).

GPT-J, Cohere and RoFormer rotate channel pairs (2i, 2i+1); their exports kept the rotation as strided
Slices, Neg, a stack and a Reshape per q and k, and cos/sin from a gathered sin|cos table or repeat-interleaved
angles. Exports (tiny, random weights; how to rebuild each: ``tests/models/build_heldout_interleaved.py``):
GPT-J partial rotary (4 of 8 channels, [B,S,N,D] layout) from dynamo without a cache and from TorchScript with
one (``position_ids`` an input), Cohere from dynamo, RoFormer (an encoder) from TorchScript, and from dynamo
where the attention fusion after it is checked too (``bench.heldout_text --only roformer --exporters dynamo``).
Each must become ``com.microsoft::RotaryEmbedding(interleaved=1)`` with the arithmetic gone and compute what the
export does under ORT (optimizations off for the reference) at shapes other than the export's. Hand-built graphs check
that the match refuses a rotation that is not exactly the interleaved one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from passes import registry
from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_rotary import FuseRotary
from tests.models.build_decoders import Signature, decoder_feeds
from tests.numerics import reference_session, run_named
from tests.passes._decoder_replay import assert_decodes_like_export
from tests.passes._util import MODELS, session

LAYERS, HEADS, VOCAB = 2, 4, 384
PAST = MODELS / "heldout" / "gptj_past_ts.onnx"
NO_CACHE = {  # file: rotary_embedding_dim where the rotation is partial
    "heldout_gptj_partial_rotary_dynamo.onnx": 4,
    "heldout_cohere_dynamo.onnx": None,
    "heldout_roformer_ts_eager.onnx": None,
}
SHAPES = ((1, 1), (1, 9), (3, 23), (2, 64))


def _rotary_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "RotaryEmbedding" and n.domain == "com.microsoft"]


def _feeds(path: Path, batch: int, seq: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    names = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]
    feeds = {"input_ids": rng.integers(5, VOCAB, (batch, seq)).astype(np.int64)}
    feeds["attention_mask"] = np.ones((batch, seq), np.int64)
    if "token_type_ids" in names:
        feeds["token_type_ids"] = np.zeros((batch, seq), np.int64)
    return feeds


def _before_fuse_rotary(model: ir.Model) -> ir.Model:
    """The fast preset's passes before fuse_rotary (range_gather_to_slice turns RoFormer's Gather(table,
    arange(S)) into Slice(table, 0, S): no positions left in the graph)."""
    specs = registry.PRESETS["fast"].specs
    before = [s for s in specs[: [s.name for s in specs].index("fuse_rotary")] if s.name != "padding_elimination"]
    for p in registry.build_passes(before):
        model = p(model, PassContext()).model
    return model


@pytest.mark.parametrize("preset", [False, True], ids=["export", "after_fast_cleanup"])
@pytest.mark.parametrize("name", sorted(NO_CACHE))
def test_interleaved_rotary_becomes_rotary_embedding_interleaved(name: str, preset: bool) -> None:
    # setup
    path = MODELS / name
    model = _before_fuse_rotary(ir.load(path)) if preset else ir.load(path)
    # execute
    result = FuseRotary()(model, PassContext())
    # assert: q and k of each layer rotated by one interleaved RotaryEmbedding, the arithmetic gone
    ops = op_histogram(result.model)
    assert result.counts["rotary_embeddings"] == result.counts["interleaved_rotary"] == 2 * LAYERS, result.non_matches
    assert not result.non_matches
    assert ops["com.microsoft::RotaryEmbedding"] == 2 * LAYERS
    assert ops["Neg"] == ops["Sin"] == ops["Cos"] == ops["GatherElements"] == 0
    for node in _rotary_nodes(result.model):
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert attrs["interleaved"] == 1
        assert attrs.get("rotary_embedding_dim", 0) == (NO_CACHE[name] or 0)
    assert result.notes["decoder"]["rotary"]["interleaved"] is True
    onnx.checker.check_model(ir.serde.serialize_model(result.model), full_check=True)
    reference, fused = reference_session(path), reference_session(result.model)
    rng = np.random.default_rng(0)
    for batch, seq in SHAPES:
        feeds = _feeds(path, batch, seq, rng)
        want, got = run_named(reference, feeds), run_named(fused, feeds)
        for key, value in want.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-5, err_msg=f"{name} {key} {batch}x{seq}")


@pytest.fixture(scope="module")
def fused_past() -> tuple[ir.Model, ir.Model, dict]:
    """GPT-J with a cache through the fast preset's passes up to fuse_rotary, and that model after fuse_gqa."""
    specs = registry.PRESETS["fast"].specs
    result = FuseRotary()(_before_fuse_rotary(ir.load(PAST)), PassContext())
    rotated = result.model
    gqa = ir.from_proto(ir.serde.serialize_model(rotated))
    for p in registry.build_passes([s for s in specs if s.name in ("fuse_gqa", "dead_node_elimination")]):
        gqa = p(gqa, PassContext()).model
    return rotated, gqa, result.counts


def test_interleaved_partial_rotary_with_a_cache_reads_position_ids_and_keeps_the_flag_through_gqa(fused_past) -> None:
    rotated, gqa, counts = fused_past
    assert counts["interleaved_rotary"] == counts["partial_rotary"] == 2 * LAYERS
    for model in (rotated, gqa):
        nodes = _rotary_nodes(model)
        assert len(nodes) == 2 * LAYERS
        for node in nodes:
            attrs = {k: a.value for k, a in node.attributes.items()}
            assert (attrs["interleaved"], attrs["rotary_embedding_dim"], attrs["num_heads"]) == (1, 4, HEADS)
            assert node.inputs[1].name == "position_ids"  # the caller's positions, not a recomputed arange
    ops = op_histogram(gqa)
    assert ops["com.microsoft::GroupQueryAttention"] == LAYERS and ops["Neg"] == 0 and "Softmax" not in ops


@pytest.mark.parametrize(("batch", "prompt", "past"), [(2, 7, 0), (2, 1, 9), (1, 4, 6), (3, 5, 40)])
def test_interleaved_rotary_with_a_cache_computes_what_the_export_does(fused_past, batch, prompt, past) -> None:
    rotated, gqa, _ = fused_past
    signature = Signature.of(PAST)
    reference = session(PAST)
    names = [o.name for o in reference.get_outputs()]
    feeds = decoder_feeds(signature, batch, prompt, past, seed=batch + past)
    want = reference.run(names, feeds)
    # ORT's GroupQueryAttention refuses a batch of prompts after a cache (fuse_gqa's samples route that to MHA)
    candidates = [rotated] if batch > 1 and prompt > 1 and past else [rotated, gqa]
    for model in candidates:
        got = session(model, optimized=True).run(names, feeds)
        for name, w, g in zip(names, want, got, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"{name} at {batch, prompt, past}")


def test_interleaved_rotary_decodes_token_by_token_on_a_growing_cache(fused_past) -> None:
    _, gqa, _ = fused_past
    assert_decodes_like_export(PAST, gqa, batch=1)


# ------------------------------------------------------------------------------- hand-built rotations

D, ROWS = 8, 32


def _rotation_graph(*, table: str = "interleaved", negate: str = "odd", order: str = "neg_first") -> onnx.ModelProto:
    """``x * cos + stack(...).flatten(-2) * sin`` on x [B, N, S, D], cos/sin gathered by position_ids from a
    [ROWS, D] table: ``interleaved`` repeats each angle on two adjacent channels, ``halves`` concatenates them
    (rotate_half's layout). ``negate`` which strided half is negated, ``order`` which goes first in the stack."""
    angles = np.arange(ROWS, dtype=np.float32)[:, None] * (1.0 / 10000 ** (np.arange(0, D, 2) / D))[None, :]
    freqs = np.repeat(angles, 2, axis=-1) if table == "interleaved" else np.concatenate([angles, angles], axis=-1)
    big = np.iinfo(np.int64).max
    inits = [
        helper.make_tensor("cos_table", TensorProto.FLOAT, freqs.shape, np.cos(freqs).astype(np.float32).ravel()),
        helper.make_tensor("sin_table", TensorProto.FLOAT, freqs.shape, np.sin(freqs).astype(np.float32).ravel()),
        helper.make_tensor("one", TensorProto.INT64, [1], [1]),
        helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
        helper.make_tensor("two", TensorProto.INT64, [1], [2]),
        helper.make_tensor("end", TensorProto.INT64, [1], [big]),
        helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("flat", TensorProto.INT64, [4], [0, 0, 0, -1]),
    ]
    odd, even = ("x_odd", "x_even") if negate == "odd" else ("x_even", "x_odd")
    stacked = ["neg_u", "pos_u"] if order == "neg_first" else ["pos_u", "neg_u"]
    nodes = [
        helper.make_node("Gather", ["cos_table", "position_ids"], ["cos_g"]),
        helper.make_node("Gather", ["sin_table", "position_ids"], ["sin_g"]),
        helper.make_node("Unsqueeze", ["cos_g", "one"], ["cos"]),
        helper.make_node("Unsqueeze", ["sin_g", "one"], ["sin"]),
        helper.make_node("Slice", ["x", "one", "end", "last", "two"], ["x_odd"]),
        helper.make_node("Slice", ["x", "zero", "end", "last", "two"], ["x_even"]),
        helper.make_node("Neg", [odd], ["neg"]),
        helper.make_node("Unsqueeze", ["neg", "last"], ["neg_u"]),
        helper.make_node("Unsqueeze", [even, "last"], ["pos_u"]),
        helper.make_node("Concat", stacked, ["stack"], axis=-1),
        helper.make_node("Reshape", ["stack", "flat"], ["rotated"]),
        helper.make_node("Mul", ["x", "cos"], ["x_cos"]),
        helper.make_node("Mul", ["rotated", "sin"], ["r_sin"]),
        helper.make_node("Add", ["x_cos", "r_sin"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "rotation",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", HEADS, "sequence", D]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "sequence"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", HEADS, "sequence", D])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_hand_built_interleaved_rotation_fuses_and_computes_the_same() -> None:
    # setup
    proto = _rotation_graph()
    # execute
    result = FuseRotary()(ir.serde.deserialize_model(proto), PassContext())
    # assert
    assert result.counts["interleaved_rotary"] == 1 and not result.non_matches
    assert op_histogram(result.model)["Neg"] == 0
    (node,) = _rotary_nodes(result.model)
    assert node.attributes["interleaved"].as_int() == 1 and node.inputs[1].name == "position_ids"
    rng = np.random.default_rng(1)
    reference, fused = reference_session(proto), reference_session(result.model)
    for batch, seq in ((1, 1), (2, 5), (3, 17)):
        feeds = {
            "x": rng.standard_normal((batch, HEADS, seq, D)).astype(np.float32),
            "position_ids": rng.integers(0, ROWS - 1, (batch, seq)).astype(np.int64),  # any positions, per row
        }
        np.testing.assert_allclose(run_named(fused, feeds)["y"], run_named(reference, feeds)["y"], atol=1e-6)


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ({"table": "halves"}, "does not repeat each value on two adjacent channels"),
        ({"negate": "even"}, None),  # the other direction of rotation: no match at all
        ({"order": "pos_first"}, None),  # stack((x1, -x2)): not rotate_every_two
    ],
)
def test_a_rotation_that_is_not_exactly_interleaved_is_left_as_it_is(variant: dict, reason: str | None) -> None:
    # setup
    proto = _rotation_graph(**variant)
    # execute
    result = FuseRotary()(ir.serde.deserialize_model(proto), PassContext())
    # assert
    assert not result.counts.get("rotary_embeddings") and not _rotary_nodes(result.model)
    assert op_histogram(result.model)["Neg"] == 1
    if reason is not None:
        assert any(reason in m.reason for m in result.non_matches), result.non_matches


def test_attention_still_fuses_after_an_interleaved_rotary_embedding() -> None:
    """onnxscript 0.7.2's MultiHeadAttention rule re-creates a heads-first RotaryEmbedding without its attributes
    (interleaved lost); fuse_rotary rotates the flat [B, S, N*D] q/k instead, so the attention fuses around it."""
    # setup
    path = MODELS / "heldout_roformer_dynamo.onnx"
    specs = registry.PRESETS["fast"].specs
    upto = [
        s for s in specs[: [s.name for s in specs].index("fuse_transformer") + 1] if s.name != "padding_elimination"
    ]
    model = ir.load(path)
    # execute
    for p in registry.build_passes(upto):
        model = p(model, PassContext()).model
    # assert
    ops = op_histogram(model)
    assert ops["com.microsoft::MultiHeadAttention"] == LAYERS and "Softmax" not in ops and ops["Neg"] == 0
    assert all(n.attributes["interleaved"].as_int() == 1 for n in _rotary_nodes(model))
    assert len(_rotary_nodes(model)) == 2 * LAYERS
    reference, fused = reference_session(path), reference_session(model)
    rng = np.random.default_rng(2)
    for batch, seq in SHAPES:
        feeds = _feeds(path, batch, seq, rng)
        want, got = run_named(reference, feeds), run_named(fused, feeds)
        for key, value in want.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-5, err_msg=f"{key} at {batch}x{seq}")
