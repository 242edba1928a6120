"""fuse_gqa reads q/k/v of a fused qkv projection without Transposes (``_head_layout``), and folds a dynamo
merged decoder's head Reshapes by the graph's own arithmetic (``_gqa_reshapes``' roots) (issue 19).

GPT-NeoX splits its per-head [N, 3*D] block after the head Transpose (TorchScript: three Slices; dynamo: one
Split), Falcon slices [N+2, D] heads before it and reshapes each to the shape it has; GroupQueryAttention
read ``Reshape(Transpose(...))`` of each of q, k and v, 4 Transposes per layer. Now each is a Slice/Split of
the projection's [B,S,N,3D] view itself. A dynamo merged decoder's branches carry no shapes, and its head
split takes its batch from a past input and its length from the ids: the projection's dims are now traced to
the ids through the norms and the embedding lookup, and the signature names the past's batch the same.

Files: ``tests/models/heldout/gpt_neox_past_ts.onnx``, ``falcon_past_ts_sdpa.onnx``, ``falcon_past_dynamo.onnx``
(``python -m bench.heldout_dec_past --only gpt_neox|falcon``; dynamo's Falcon picks k and v by ``GatherND`` between
two Transposes), ``gpt_neox_nocache_dynamo.onnx`` (``python -m
bench.heldout_dec_nocache --only gpt_neox --exporters dynamo``, no cache, no position ids),
``tests/models/decoders/llama_merged_dynamo.onnx``. Each checked against the upload in ORT (optimizations off)
at batch, prompt and cache lengths the exports never used.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from core.inputs import generate_input_sets
from passes._infra import PassContext
from passes.fusion._gqa_reshapes import reading
from passes.fusion._head_layout import is_identity
from passes.fusion.fuse_gqa import FuseGqa
from passes.registry import build_passes, get_preset
from tests.models.build_decoders import OUT, Signature, decoder_feeds, merged_decoder_feeds, presents_as_past
from tests.passes._util import session

HELDOUT = Path(__file__).resolve().parent.parent / "models" / "heldout"
LAYERS = 2
ATOL = 1e-5


def _until_gqa(path: Path) -> tuple[ir.Model, PassContext]:
    """``path`` through the fast preset's passes before fuse_gqa, on its generated input sets."""
    model = ir.load(path)
    ctx = PassContext(samples=[s.feeds for s in generate_input_sets(model, 3)])
    specs = get_preset("fast").specs
    for earlier in build_passes(specs[: [s.name for s in specs].index("fuse_gqa")]):
        model = earlier(model, ctx).model
    return model, ctx


def _layout(model: ir.Model) -> Counter[str]:
    """Reshape and Transpose nodes, in the graph and in any If branch."""
    nodes = ir.traversal.RecursiveGraphIterator(model.graph)
    return Counter(n.op_type for n in nodes if n.op_type in ("Reshape", "Transpose"))


def _fused(path: Path) -> tuple[ir.Model, dict, Counter[str]]:
    model, ctx = _until_gqa(path)
    before = _layout(model)
    result = FuseGqa()(model, ctx)
    return result.model, result.counts, before


def _producer_ops(value: ir.Value, skip: tuple[str, ...] = ("Reshape", "RotaryEmbedding")) -> list[str]:
    """The op types from ``value`` back to the first op not in ``skip``, inclusive."""
    ops = []
    node = value.producer()
    while node is not None:
        ops.append(node.op_type)
        if node.op_type not in skip:
            break
        node = node.inputs[0].producer()
    return ops


def _assert_cache_calls_exact(source: Path, model: ir.Model) -> None:
    signature = Signature.of(source)
    reference, candidate = session(source), session(model, optimized=True)
    names = [o.name for o in reference.get_outputs()]
    # batch, new tokens, past: several new tokens after a cache at batch 1 only (ORT's GQA refuses more rows)
    for batch, prompt, past in ((3, 9, 0), (1, 1, 13), (4, 1, 21), (1, 6, 10)):
        feeds = decoder_feeds(signature, batch, prompt, past, seed=batch + past)
        want, got = reference.run(names, feeds), candidate.run(names, feeds)
        for name, expected, actual in zip(names, want, got, strict=True):
            np.testing.assert_allclose(actual, expected, rtol=0, atol=ATOL, err_msg=f"{name} at {batch, prompt, past}")
    feeds = decoder_feeds(signature, 2, 4, 0, seed=5)
    for step in range(3):  # the artifact decoding on its own presents, token by token
        want = dict(zip(names, reference.run(names, feeds), strict=True))
        got = dict(zip(names, candidate.run(names, feeds), strict=True))
        for name in names:
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=ATOL, err_msg=f"{name} step {step}")
        past = presents_as_past(got)
        tokens = want["logits"][:, -1:].argmax(-1).astype(np.int64)
        feeds = decoder_feeds(signature, 2, 1, past["past_key_values.0.key"].shape[2], tokens=tokens, past_values=past)


@pytest.mark.parametrize(
    ("name", "split"),
    [
        ("gpt_neox_past_ts.onnx", "Slice"),
        ("falcon_past_ts_sdpa.onnx", ("Slice", "Gather")),
        ("falcon_past_dynamo.onnx", "Slice"),  # k, v: Transpose(GatherND(Transpose(view), [[i]])): a Slice of view
    ],
)
def test_fused_qkv_reaches_group_query_attention_without_transposes_when_cache(name, split):
    # setup
    source = HELDOUT / name
    # execute
    model, counts, before = _fused(source)
    # assert: no Transpose left (4 per layer were: the export's head Transpose(s) and fuse_gqa's own way back);
    # per layer 4 Reshapes: the projection's view and q, k, v flat (6 and 9 were left before)
    after = _layout(model)
    assert counts["fused_gqa"] == LAYERS
    assert before["Transpose"] >= 2 * LAYERS and after["Transpose"] == 0, (before, after)
    assert after["Reshape"] == 4 * LAYERS, (before, after)
    assert counts["head_reshapes_folded"] == LAYERS  # GQA's output straight into the output projection
    # assert: q, k and v are slices of the projection's [B,S,N,3D] (or [B,S,N+2,D]) view, rotated flat
    for node in model.graph:
        if node.op_type == "GroupQueryAttention":
            for value in node.inputs[:3]:
                chain = _producer_ops(value)
                assert chain[-1] in split and "Transpose" not in chain, chain
                data = value
                while data.producer().op_type in ("Reshape", "RotaryEmbedding"):
                    data = data.producer().inputs[0]
                assert _producer_ops(data.producer().inputs[0], skip=()) == ["Reshape"]  # the projection's view
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    _assert_cache_calls_exact(source, model)


def test_split_qkv_and_rotary_batch_read_the_projection_when_no_cache():
    # setup: dynamo's GPT-NeoX without a cache: one Split of the transposed [B,N,S,3D]; fuse_rotary's position
    # ids take their batch from the Shape of each heads-first rotary input
    source = HELDOUT / "gpt_neox_nocache_dynamo.onnx"
    # execute
    model, counts, before = _fused(source)
    # assert: one Split per layer on the [B,S,N,3D] view (axis 3), no Transpose left for a Shape to keep alive
    after = _layout(model)
    assert counts["fused_gqa"] == LAYERS
    assert before["Transpose"] >= 2 * LAYERS and after["Transpose"] == 0, (before, after)
    assert after["Reshape"] == 4 * LAYERS, (before, after)
    splits = [n for n in model.graph if n.op_type == "Split"]
    assert len(splits) == LAYERS
    assert all(n.attributes.get_int("axis") == 3 and n.inputs[0].producer().op_type == "Reshape" for n in splits)
    # assert: exact against the upload at prompt lengths and batches other than the export's (2 x 16)
    reference, candidate = session(source), session(model, optimized=True)
    for batch, length in ((1, 1), (3, 5), (2, 37)):
        ids = np.random.default_rng(length).integers(0, 256, (batch, length)).astype(np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch, length), np.int64)}
        (want,), (got,) = reference.run(None, feeds), candidate.run(None, feeds)
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=f"logits at {batch}x{length}")


def test_dynamo_merged_branches_fold_their_head_reshapes_by_the_graphs_arithmetic():
    # setup: the branches carry no shapes; dynamo's head split reads its batch from a past input and its
    # length from the ids, the projection's dims trace to the ids through RMSNorm and the embedding lookup
    source = OUT / "llama_merged_dynamo.onnx"
    # execute
    model, counts, before = _fused(source)
    # assert: every head split and merge folded in both branches (16 Reshapes were left in each)
    (node,) = model.graph
    for branch in ("then_branch", "else_branch"):
        graph = node.attributes[branch].as_graph()
        reshapes = sum(n.op_type == "Reshape" for n in graph)
        assert reshapes == 0, (branch, reshapes, before)
    assert before["Reshape"] > 0 and counts["head_reshapes_folded"] >= 2 * 4 * LAYERS, (counts, before)
    # assert: exact on both branches at shapes the export's checks and the generated sets never used
    reference, candidate = session(source), session(model, optimized=True)
    names = [o.name for o in reference.get_outputs()]
    for seed, (cached, batch, length, past) in enumerate(
        ((False, 3, 7, 0), (False, 1, 2, 0), (True, 3, 1, 5), (True, 1, 3, 9))
    ):
        feeds = merged_decoder_feeds(source, cached, batch, length, past, seed=seed)
        for name, want, got in zip(names, reference.run(names, feeds), candidate.run(names, feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=f"{name} at {cached, batch, length, past}")


# ------------------------------------------------------------------------------------------------ units


def _reshape_of_sliced_heads(target: list) -> ir.Model:
    """x[B,S,48] -> y = Reshape(x, [0,0,6,8]) -> Slice(y, axis 2, 0:4) -> Transpose(0,2,1,3) -> Reshape(target),
    where ``target`` entries are ints or ("b"|"s") for Shape(x)[0] / Shape(x)[1]; no value annotated."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["B", "S", 48]))
    nodes: list[ir.Node] = []

    def ints(values: list[int]) -> ir.Value:
        nodes.append(ir.node("Constant", [], {"value": ir.tensor(np.array(values, np.int64))}))
        return nodes[-1].outputs[0]

    shape = ir.node("Shape", [x])
    nodes.append(shape)
    pieces = []
    for entry in target:
        if isinstance(entry, int):
            pieces.append(ints([entry]))
            continue
        gather = ir.node("Gather", [shape.outputs[0], ints([0 if entry == "b" else 1])], {"axis": 0})
        nodes.append(gather)
        pieces.append(gather.outputs[0])
    concat = ir.node("Concat", pieces, {"axis": 0})
    view = ir.node("Reshape", [x, ints([0, 0, 6, 8])])
    sliced = ir.node("Slice", [view.outputs[0], ints([0]), ints([4]), ints([2])])
    heads = ir.node("Transpose", [sliced.outputs[0]], {"perm": [0, 2, 1, 3]})
    same = ir.node("Reshape", [heads.outputs[0], concat.outputs[0]], name="under_test")
    nodes += [concat, view, sliced, heads, same]
    same.outputs[0].name = "y"
    graph = ir.Graph([x], [same.outputs[0]], nodes=nodes, opset_imports={"": 18}, name="g")
    return ir.Model(graph, ir_version=9)


@pytest.mark.parametrize(
    ("target", "identity"),
    [
        (["b", 4, "s", 8], True),  # Falcon's Reshape of q to the shape it has
        ([0, 4, -1, 8], True),  # one -1: the element count fixes it
        (["b", 3, "s", 8], False),  # the slice keeps 4 heads, not 3
        (["s", 4, "b", 8], False),  # batch and length swapped
        ([0, -1, -1, 8], False),  # two unknowns
        (["b", 4, "s", -1], True),
    ],
)
def test_is_identity_reads_each_dim_from_the_graphs_arithmetic(target, identity):
    # setup
    model = _reshape_of_sliced_heads(target)
    node = next(n for n in model.graph if n.name == "under_test")
    # execute
    with reading(model.graph):
        got = is_identity(node)
    # assert
    assert got is identity
    if identity:  # and the graph agrees: the Reshape's output has its input's shape
        feeds = {"x": np.arange(2 * 5 * 48, dtype=np.float32).reshape(2, 5, 48)}
        (out,) = session(model).run(None, feeds)
        assert out.shape == (2, 4, 5, 8)
