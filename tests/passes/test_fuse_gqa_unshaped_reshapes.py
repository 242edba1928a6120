"""fuse_gqa's head Reshape folding (``_gqa_reshapes``) where no value carries a shape: a merged decoder's
branches reach the passes without value_info (``passes._subgraphs.standalone``), so the rank of a Reshape's
data is read from the ops that make it (``_ranks``: a Reshape's target entries, ...).
``Reshape(Reshape(x, [0,0,-1,D]), [0,0,-1])`` is ``x`` only when x has rank 3; a rank-4 x comes back in
another shape and stays. Numerics against the graph as written (optimizations off) at two shapes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes.fusion._gqa_reshapes import _ranks, fold_head_reshapes
from tests.numerics import reference_session, run_named


def _graph(source_shape: list[int]) -> tuple[ir.Model, ir.Node]:
    """a [B,S,2,8] -> x = Reshape(a, source_shape) -> Reshape(x, [0,0,-1,4]) -> fuse_gqa's to_bsh
    Reshape(., [0,0,-1]) -> Neg -> y; no intermediate value has a shape. Returns the model and the Neg."""
    a = ir.Value(name="a", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["B", "S", 2, 8]))

    def ints(name: str, values: list[int]) -> ir.Value:
        node = ir.node("Constant", [], {"value": ir.tensor(np.array(values, np.int64), name=name)}, name=name)
        nodes.append(node)
        return node.outputs[0]

    nodes: list[ir.Node] = []
    x = ir.node("Reshape", [a, ints("source_shape", source_shape)], name="source")
    split = ir.node("Reshape", [x.outputs[0], ints("split_shape", [0, 0, -1, 4])], name="split")
    flat = ir.node("Reshape", [split.outputs[0], ints("flat_shape", [0, 0, -1])], name="fuse_gqa/layer_0/k/to_bsh")
    neg = ir.node("Neg", [flat.outputs[0]], name="neg")
    nodes += [x, split, flat, neg]
    neg.outputs[0].name = "y"
    neg.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([a], [neg.outputs[0]], nodes=nodes, opset_imports={"": 18}, name="g")
    return ir.Model(graph, ir_version=9), neg


def _feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
    return {"a": np.random.default_rng(batch * 10 + seq).standard_normal((batch, seq, 2, 8), dtype=np.float32)}


@pytest.mark.parametrize(("source_shape", "folds"), [([0, 0, -1], True), ([0, 0, -1, 8], False)])
def test_fold_head_reshapes_reads_the_rank_from_the_producing_reshape_when_values_have_no_shape(source_shape, folds):
    # setup
    model, neg = _graph(source_shape)
    want = reference_session(ir.serde.serialize_model(model))
    source = next(n for n in model.graph if n.name == "source")
    assert source.outputs[0].shape is None and _ranks(model.graph)[id(source.outputs[0])] == len(source_shape)
    # execute
    folded = fold_head_reshapes(model.graph)
    # assert: the rank-3 source is read straight; the rank-4 one keeps both Reshapes, which reshape it
    assert folded == int(folds)
    assert (neg.inputs[0] is source.outputs[0]) == folds
    got = reference_session(ir.serde.serialize_model(model))
    for batch, seq in ((1, 3), (2, 7)):
        feeds = _feeds(batch, seq)
        expected, actual = run_named(want, feeds)["y"], run_named(got, feeds)["y"]
        assert actual.shape == expected.shape == (batch, seq, 16)
        np.testing.assert_array_equal(actual, expected)


def test_rank_is_unknown_when_the_target_is_computed_from_an_unknown_shape():
    # setup: a target read from an input of unknown rank: its entry count is unknown, and so is the rank of
    # what reads the Reshape's output
    a = ir.Value(name="a", type=ir.TensorType(ir.DataType.FLOAT))
    shape = ir.node("Shape", [a], name="shape")
    reshape = ir.node("Reshape", [a, shape.outputs[0]], name="reshape")
    neg = ir.node("Neg", [reshape.outputs[0]], name="neg")
    graph = ir.Graph([a], [neg.outputs[0]], nodes=[shape, reshape, neg], opset_imports={"": 18}, name="g")
    # execute
    ranks = _ranks(graph)
    # assert
    assert ranks[id(reshape.outputs[0])] is None and ranks[id(neg.outputs[0])] is None


def test_ranks_read_reshape_targets_without_walking_roots_when_a_residual_stream_feeds_them(monkeypatch):
    """``_ranks`` runs before the roots are read: resolving a Reshape target's leading dims there walked the
    residual stream back once per branch of every Add, 2^layers; a 4-layer TorchScript GPT-2 at bench size
    spent minutes in it before fuse_gqa started (bench/README.md). It needs only the entry count."""
    import onnx

    from passes.fusion import _gqa_reshapes
    from tests.models.corpus import committed_path

    model = ir.serde.deserialize_model(onnx.load(str(committed_path("gpt2", "ts_eager"))))
    reshapes = [n for n in model.graph if n.op_type == "Reshape"]
    assert len(reshapes) >= 8

    def no_walk(value):
        raise AssertionError("_ranks walked a root")

    with monkeypatch.context() as patched:
        patched.setattr(_gqa_reshapes, "_root", no_walk)
        ranks = _ranks(model.graph)
    for node in reshapes:
        entries = _gqa_reshapes._shape_entries(node.inputs[1], roots=False)
        assert entries is None or ranks[id(node.outputs[0])] == len(entries)
    # And reading the roots after them visits each node output about once (linear, not per branch).
    calls = []
    real = _gqa_reshapes._leading_source
    monkeypatch.setattr(_gqa_reshapes, "_leading_source", lambda *a: calls.append(1) or real(*a))
    with _gqa_reshapes.reading(model.graph):
        pass
    assert len(calls) <= 1.2 * sum(len(n.outputs) for n in model.graph)
