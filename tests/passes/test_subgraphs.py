"""passes._subgraphs: a graph pass run inside the If branches holding a model's bulk (Optimum's merged decoders).

fuse_transformer, one of the passes that call it (shape_inference and quantize_int4 the others), on the committed merged
Whisper, T5 and BART decoders (both exporters): each branch fused as its separate file is (MultiHeadAttention
reading the caches, SkipLayerNormalization), the weights the two branches pack alike read from the outer graph
once, and ONNX Runtime gives the original's outputs on both branches at shapes other than the generated sets'.
The helper's refusals: a model without a bulk If runs the pass as usual; a branch that reads a value computed
in the outer graph is left alone, saying so; a result whose outputs changed does not go back. Shape inference
per branch: constant folding after it
stays exact on both branches (inferred inside the If, it was not)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from core.inputs import generate_input_sets
from passes._infra import NonMatch, PassContext, PassResult
from passes._subgraphs import bulk_ifs, in_branches, put_back, standalone
from passes.cleanup.constant_folding import ConstantFolding
from passes.cleanup.shape_inference import ShapeInference
from passes.fusion.fuse_transformer import FuseTransformer
from passes.precision.quantize_int4 import QuantizeInt4
from tests.models.build_seq2seq import ARCHS, MERGED, OUT, folder, merged_feeds
from tests.numerics import reference_session, run_named

ATOL = 1e-4
CASES = [(a, x) for a in ARCHS for x in ("ts", "dynamo")]


def _branch_ops(proto: onnx.ModelProto) -> dict[str, Counter[str]]:
    (node,) = proto.graph.node
    return {a.g.name: Counter(n.op_type for n in a.g.node) for a in node.attribute}


def _fused(arch: str, exporter: str) -> tuple[onnx.ModelProto, PassResult]:
    source = onnx.load(str(OUT / folder(arch, exporter) / MERGED))
    model = ir.serde.deserialize_model(source)
    ctx = PassContext(samples=[s.feeds for s in generate_input_sets(model, 3)])
    result = FuseTransformer()(model, ctx)
    return source, result


@pytest.mark.parametrize(("arch", "exporter"), CASES)
def test_fuse_transformer_fuses_inside_both_branches_when_the_model_is_a_merged_decoder(arch, exporter):
    # setup / execute
    source, result = _fused(arch, exporter)
    fused = ir.serde.serialize_model(result.model)
    # assert: structure. Each branch: self and cross attention of every layer fused (T5's relative bias and
    # BART/Whisper's alike), the outer graph still one If, the weights read from outside the branches
    layers = ARCHS[arch].layers
    assert result.modified and result.counts["fused_attention"] == 2 * 2 * layers
    assert [n.op_type for n in fused.graph.node] == ["If"]
    ops = _branch_ops(fused)
    for branch in ("with_past", "no_past"):
        assert ops[branch]["MultiHeadAttention"] == 2 * layers, (branch, ops[branch])
        assert ops[branch]["Softmax"] == 0
        assert ops[branch]["SkipLayerNormalization"] + ops[branch]["SkipSimplifiedLayerNormalization"] > 0
    (node,) = fused.graph.node
    for attr in node.attribute:  # only scalars and small index tensors stay in a branch
        assert all(t.ByteSize() < 1024 for t in attr.g.initializer), [t.name for t in attr.g.initializer][:5]
    digests = [onnx.numpy_helper.to_array(t).tobytes() for t in fused.graph.initializer]
    assert len(digests) == len(set(digests))  # a weight packed alike in both branches is held once
    assert {i.name for i in fused.graph.input} == {i.name for i in source.graph.input}
    assert [o.name for o in fused.graph.output] == [o.name for o in source.graph.output]
    # numerics: both branches, at shapes the generated sets never had
    want_sess, got_sess = reference_session(source), reference_session(fused)
    for use_cache, (batch, dec, past, enc) in ((False, (3, 2, 0, 9)), (True, (2, 1, 7, 9)), (True, (1, 3, 2, 5))):
        feeds = merged_feeds(ARCHS[arch], use_cache, batch, dec=dec, past=past, enc=enc, seed=5)
        want, got = run_named(want_sess, feeds), run_named(got_sess, feeds)
        for key, expected in want.items():
            np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=f"{use_cache}: {key}")


def test_branch_non_matches_and_notes_name_their_branch_when_reported():
    _, result = _fused("t5", "ts")
    assert set(result.notes["branches"]) == {
        "If optimum::if then_branch (with_past)",
        "If optimum::if else_branch (no_past)",
    }
    assert all(m.reason.startswith("inside If optimum::if ") for m in result.non_matches)


def _tiny_if(bulk: bool, outer_computed: bool = False) -> onnx.ModelProto:
    """x -> [Relu ->] If(c) { then: x' @ W + 1, else: x' @ W }: the branches hold the bulk unless ``bulk`` is
    False (then four outer Relus outweigh them); with ``outer_computed``, the branches read the Relu's output."""
    w = onnx.numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")
    one = onnx.numpy_helper.from_array(np.ones(4, dtype=np.float32), "one")
    src = "r" if outer_computed else "x"
    then = helper.make_graph(
        [helper.make_node("MatMul", [src, "W"], ["m1"]), helper.make_node("Add", ["m1", "one"], ["y1"])],
        "then", [], [helper.make_tensor_value_info("y1", TensorProto.FLOAT, ["b", 4])],
    )  # fmt: skip
    other = helper.make_graph(
        [helper.make_node("MatMul", [src, "W"], ["y2"])],
        "else", [], [helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["b", 4])],
    )  # fmt: skip
    nodes = [helper.make_node("Relu", ["x"], ["r"])]
    if not bulk:
        nodes += [helper.make_node("Relu", ["x"], [f"z{i}"]) for i in range(4)]
    nodes.append(helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other))
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])], [w, one],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


class _FlattenWeights:
    """A toy in-place pass: every MatMul reads its constant weight flattened and reshaped back (an exact
    rewrite that makes the same new weight, W_flat, in both branches)."""

    name = "toy"
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        del ctx
        changed = 0
        for node in list(model.graph):
            weight = node.inputs[1] if node.op_type == "MatMul" else None
            if weight is not None and weight.const_value is not None:
                array = weight.const_value.numpy()
                flat = ir.Value(name=f"{weight.name}_flat", const_value=ir.tensor(array.reshape(-1).copy()))
                dims = ir.Value(name=f"{weight.name}_dims", const_value=ir.tensor(np.array(array.shape, np.int64)))
                for value in (flat, dims):
                    value.shape, value.type = value.const_value.shape, ir.TensorType(value.const_value.dtype)
                    model.graph.register_initializer(value)
                back = ir.node("Reshape", [flat, dims])
                model.graph.insert_before(node, back)
                node.replace_input_with(1, back.outputs[0])
                changed += 1
        return PassResult(model, bool(changed), {"weights_flattened": changed})


def test_a_pass_reaches_both_branches_and_their_equal_weights_are_held_once_when_an_if_holds_the_bulk():
    # setup
    source = _tiny_if(bulk=True)
    model = ir.serde.deserialize_model(source)
    # execute
    result = in_branches(_FlattenWeights(), model, PassContext())
    # assert: in place, both branches rewritten, the two equal new weights one outer weight, the unread W dropped
    assert result is not None and result.model is model and result.modified
    assert result.counts["weights_flattened"] == 2 and result.counts["branch_weights_shared"] == 2
    proto = ir.serde.serialize_model(result.model)
    assert sorted(t.name for t in proto.graph.initializer) == ["W_flat_shared", "one"]
    node = next(n for n in proto.graph.node if n.op_type == "If")
    for attr in node.attribute:  # the [4, 4] shape stays in each branch, as Optimum keeps 1-D ints there
        assert [t.name for t in attr.g.initializer] == ["W_dims"]
        assert attr.g.node[0].op_type == "Reshape" and attr.g.node[0].input[0] == "W_flat_shared"
    onnx.checker.check_model(proto)
    feeds = {"x": np.arange(8, dtype=np.float32).reshape(2, 4)}
    for c in (True, False):
        want = run_named(reference_session(source), {**feeds, "c": np.array([c])})
        got = run_named(reference_session(proto), {**feeds, "c": np.array([c])})
        np.testing.assert_array_equal(got["y"], want["y"])


def test_the_pass_runs_as_usual_when_no_if_holds_the_bulk():
    assert bulk_ifs(_tiny_if(bulk=False)) == []
    assert in_branches(_FlattenWeights(), ir.serde.deserialize_model(_tiny_if(bulk=False)), PassContext()) is None


def test_a_branch_reading_an_outer_computed_value_is_left_alone_with_a_reason_when_it_cannot_stand_alone():
    source = _tiny_if(bulk=True, outer_computed=True)
    branch = next(a.g for a in source.graph.node[-1].attribute if a.name == "then_branch")
    assert "computed in the outer graph" in standalone(source, branch)
    result = in_branches(_FlattenWeights(), ir.serde.deserialize_model(source), PassContext())
    assert result is not None and not result.modified
    assert len(result.non_matches) == 2 and all(isinstance(m, NonMatch) for m in result.non_matches)
    assert all("cannot stand alone" in m.reason for m in result.non_matches)


def test_a_result_with_other_outputs_does_not_go_back_when_put_back():
    source = _tiny_if(bulk=True)
    branch = next(a.g for a in source.graph.node[-1].attribute if a.name == "then_branch")
    alone = standalone(source, branch)
    assert not isinstance(alone, str)
    alone.graph.output[0].name = "m1"
    before = branch.SerializeToString()
    assert put_back(source, branch, alone) == "the pass changed the branch's outputs"
    assert branch.SerializeToString() == before


def test_shapes_inferred_per_branch_keep_constant_folding_exact_when_the_model_is_a_merged_decoder():
    """Inferred inside the If, T5's no-cache branch took a cross-attention length of 4 from the outputs Optimum
    declared, and constant folding then baked it into the position bias (ORT refused the 12-long encoder)."""
    # setup
    source = onnx.load(str(OUT / folder("t5", "ts") / MERGED))
    model = ir.serde.deserialize_model(source)
    # execute
    inferred = ShapeInference()(model, PassContext())
    folded = ConstantFolding()(inferred.model, PassContext())
    # assert: shapes annotated inside both branches, and the folded model exact on both at other shapes
    assert inferred.modified and set(inferred.notes["branches"]) == {
        "If optimum::if then_branch (with_past)",
        "If optimum::if else_branch (no_past)",
    }
    proto = ir.serde.serialize_model(folded.model)
    (node,) = proto.graph.node
    assert all(len(a.g.value_info) > 0 for a in node.attribute)
    want_sess, got_sess = reference_session(source), reference_session(proto)
    for use_cache, (batch, dec, past, enc) in ((False, (1, 8, 0, 12)), (True, (2, 1, 5, 7))):
        feeds = merged_feeds(ARCHS["t5"], use_cache, batch, dec=dec, past=past, enc=enc, seed=3)
        want, got = run_named(want_sess, feeds), run_named(got_sess, feeds)
        for key, expected in want.items():
            np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=f"{use_cache}: {key}")


@pytest.mark.parametrize(("arch", "exporter"), [("bart", "ts"), ("whisper", "dynamo")])
def test_quantize_int4_quantizes_inside_both_branches_when_the_model_is_a_merged_decoder(arch, exporter):
    # setup
    source = onnx.load(str(OUT / folder(arch, exporter) / MERGED))
    model = ir.serde.deserialize_model(source)
    ctx = PassContext(samples=[s.feeds for s in generate_input_sets(model, 3)])
    # execute
    result = QuantizeInt4()(model, ctx)
    # assert: MatMulNBits in both branches; packed weights equal in both held once, outside them (the block
    # size is measured on the cache branch and given to the other: tests/test_merged_decoder_only.py)
    proto = ir.serde.serialize_model(result.model)
    assert result.modified and result.counts["nodes_quantized"] > 0
    for branch, ops in _branch_ops(proto).items():
        assert ops["MatMulNBits"] > 0, (branch, ops)
    (node,) = proto.graph.node
    tensors = [*proto.graph.initializer, *(t for a in node.attribute for t in a.g.initializer if len(t.dims) > 1)]
    digests = [(tuple(t.dims), onnx.numpy_helper.to_array(t).tobytes()) for t in tensors]
    assert len(digests) == len(set(digests))
    assert sum(t.ByteSize() for t in tensors) < sum(t.ByteSize() for t in source.graph.initializer)
    # numerics: int4 on random weights, within the int4 preset's tolerance, on both branches at other shapes
    want_sess, got_sess = reference_session(source), reference_session(proto)
    for use_cache, (batch, dec, past, enc) in ((False, (3, 2, 0, 9)), (True, (2, 1, 7, 9))):
        feeds = merged_feeds(ARCHS[arch], use_cache, batch, dec=dec, past=past, enc=enc, seed=5)
        want, got = run_named(want_sess, feeds)["logits"], run_named(got_sess, feeds)["logits"]
        cosine = float(np.sum(want * got) / np.linalg.norm(want) / np.linalg.norm(got))
        assert cosine > 0.98, (use_cache, cosine)
