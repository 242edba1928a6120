"""quantize_int4's bias fold (passes/precision/_nbits_bias.py): a constant [N] bias Add after a MatMulNBits,
directly or one per piece after the Split of a packed projection, becomes the kernel's ``bias`` input.

Structure (no bias Add left after a MatMulNBits, the q/k/v ones read their bias, packed or not) and numerics
against the same quantized model with its Adds kept (``target="cuda"``, where the pass leaves them), ORT
graph optimizations off, at batch/prompt/cache sizes other than the export's and on a growing cache; the Split
form, which ORT's own MatMulNBitsFusion leaves, on a small graph at both accuracy levels and both bit widths;
the declines."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import matmul_nbits_quantizer as mnb

from passes._infra import PassContext
from passes.fusion.pack_matmuls import PackMatmuls
from passes.precision._nbits_bias import fold_bias_adds
from passes.precision.quantize_int4 import QuantizeInt4
from tests.models.build_decoders import OUT, Signature, decoder_feeds, presents_as_past
from tests.numerics import reference_session, run_named

NAME = "qwen2_past_ts"  # q/k/v with biases, 2 layers
OPTIONS = {"block_size": 32, "accuracy_level": 4, "lm_head": "int8", "min_top1_agreement": None}
SHAPES = ((2, 7, 0), (1, 1, 9), (3, 5, 6), (1, 1, 40))  # (batch, new tokens, past): none the export's (2, 3, 4)
# The int8 compute path adds the bias inside its tile: within a rounding of the sum, never more.
ATOL, RTOL = 1e-5, 1e-5


def _bias_adds_after_nbits(model: ir.Model) -> int:
    """Adds of a constant that read a MatMulNBits' output, directly or through a Split."""
    count = 0
    for node in model.graph:
        if node.op_type != "Add" or not any(v is not None and v.const_value is not None for v in node.inputs):
            continue
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and producer.op_type == "Split":
                producer = producer.inputs[0].producer()
            count += producer is not None and producer.op_type == "MatMulNBits"
    return count


def _quantized(pack: bool, target: str) -> ir.Model:
    path = OUT / f"{NAME}.onnx"
    signature = Signature.of(path)
    samples = [decoder_feeds(signature, 1, 6, 0, seed=1), decoder_feeds(signature, 1, 1, 6, seed=2)]
    model = ir.load(path)
    if pack:
        PackMatmuls()(model, PassContext())
    result = QuantizeInt4(OPTIONS)(model, PassContext(samples=samples, target=target))  # type: ignore[arg-type]
    assert result.modified
    return result.model


@pytest.mark.parametrize("pack", [False, True], ids=["separate", "packed"])
def test_quantize_int4_folds_qkv_bias_adds_into_matmulnbits_and_stays_exact_when_qwen2(pack):
    # setup: the same quantized weights with the bias Adds kept (the CUDA target's graph)
    kept = _quantized(pack, "cuda")
    layers = 2
    assert _bias_adds_after_nbits(kept) == (1 if pack else 3) * layers  # q, k, v; packed: one Add of them
    # execute
    folded = _quantized(pack, "cpu")
    # assert: every bias Add gone, the q/k/v MatMulNBits read a [N] bias, nothing else changed
    assert _bias_adds_after_nbits(folded) == 0
    with_bias = [n for n in folded.graph if n.op_type == "MatMulNBits" and len(n.inputs) == 6 and n.inputs[5]]
    assert len(with_bias) == (1 if pack else 3) * layers
    for node in with_bias:
        assert tuple(node.inputs[5].const_value.shape) == (node.attributes["N"].value,)
    ops_kept, ops_folded = Counter(n.op_type for n in kept.graph), Counter(n.op_type for n in folded.graph)
    assert ops_kept - ops_folded == Counter({"Add": (1 if pack else 3) * layers})
    assert ops_folded - ops_kept == Counter()
    assert [v.name for v in folded.graph.outputs] == [v.name for v in kept.graph.outputs]
    # numerics: at other batch/prompt/cache sizes, then a cache grown by each model's own presents
    signature = Signature.of(OUT / f"{NAME}.onnx")
    ref, new = reference_session(kept), reference_session(folded)
    for index, (batch, seq, past) in enumerate(SHAPES):
        feeds = decoder_feeds(signature, batch, seq, past, seed=index)
        want, got = run_named(ref, feeds), run_named(new, feeds)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=ATOL, rtol=RTOL, err_msg=f"{key} {batch, seq, past}")
    out_ref = out_new = run_named(ref, decoder_feeds(signature, 1, 5, 0, seed=7))
    for step in range(3):
        token = np.array([[int(out_ref["logits"][0, -1].argmax())]], np.int64)
        out_ref = run_named(
            ref, decoder_feeds(signature, 1, 1, 5 + step, tokens=token, past_values=presents_as_past(out_ref))
        )
        out_new = run_named(
            new, decoder_feeds(signature, 1, 1, 5 + step, tokens=token, past_values=presents_as_past(out_new))
        )
        for key in out_ref:
            np.testing.assert_allclose(out_new[key], out_ref[key], atol=1e-4, rtol=1e-4, err_msg=f"{key} step {step}")


def _split_model(k: int, widths: list[int], bias_shape: tuple[int, ...] | None, *, level: int, bits: int):
    """x[B, S, k] -> MatMulNBits (N = sum(widths)) -> Split(last axis) -> one Add of a constant per piece."""
    rng = np.random.default_rng(len(widths) + k)
    n = sum(widths)
    inits = [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W")]
    inits.append(numpy_helper.from_array(np.array(widths, np.int64), "widths"))
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["y"], name="proj"),
        helper.make_node("Split", ["y", "widths"], [f"p{i}" for i in range(len(widths))], name="split", axis=-1),
    ]
    for i, width in enumerate(widths):
        shape = bias_shape or (width,)
        inits.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), f"b{i}"))
        nodes.append(
            helper.make_node("Add", [f"b{i}", f"p{i}"] if i % 2 else [f"p{i}", f"b{i}"], [f"o{i}"], name=f"add{i}")
        )
    outputs = [helper.make_tensor_value_info(f"o{i}", TensorProto.FLOAT, None) for i in range(len(widths))]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", k])], outputs, inits
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    config = mnb.DefaultWeightOnlyQuantConfig(block_size=16, is_symmetric=False, accuracy_level=level, bits=bits)
    quantizer = mnb.MatMulNBitsQuantizer(proto, algo_config=config)
    quantizer.process()
    return quantizer.model.model


@pytest.mark.parametrize(("level", "bits"), [(0, 4), (4, 4), (0, 8), (4, 8)])
def test_fold_bias_adds_packs_the_biases_after_a_split_into_one_bias_input_when_each_piece_adds_one(level, bits):
    # setup: K = 40 is not a multiple of the block (16): a padded last block
    proto = _split_model(40, [64, 16, 16], None, level=level, bits=bits)
    model = ir.serde.deserialize_model(proto)
    # execute
    folded, declined = fold_bias_adds(model)
    # assert
    assert (folded, declined) == (3, [])
    assert Counter(n.op_type for n in model.graph) == Counter({"MatMulNBits": 1, "Split": 1})
    (node,) = [n for n in model.graph if n.op_type == "MatMulNBits"]
    assert tuple(node.inputs[5].const_value.shape) == (96,)
    assert [v.name for v in model.graph.outputs] == ["o0", "o1", "o2"]
    assert set(model.graph.initializers) == {n.name for n in node.inputs if n is not None and n.const_value} | {
        "widths"
    }  # the three per-piece biases are gone with their Adds
    rng = np.random.default_rng(0)
    ref, new = reference_session(proto), reference_session(model)
    for shape in ((1, 1), (2, 9), (3, 130)):
        feeds = {"x": rng.standard_normal((*shape, 40)).astype(np.float32)}
        for want, got in zip(ref.run(None, feeds), new.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_fold_bias_adds_declines_with_reason_when_bias_is_not_one_value_per_column():
    # setup: [1, N] biases would broadcast a 2-D output up a rank, not a bias input's [N]
    model = ir.serde.deserialize_model(_split_model(32, [32, 32], (1, 32), level=4, bits=4))
    before = Counter(n.op_type for n in model.graph)
    # execute
    folded, declined = fold_bias_adds(model)
    # assert
    assert folded == 0 and Counter(n.op_type for n in model.graph) == before
    assert len(declined) == 1 and "[1, 32], not [32]" in declined[0].reason and declined[0].node == "add0"


def test_quantize_int4_keeps_bias_adds_and_says_why_when_target_is_cuda():
    # setup / execute
    model = _quantized(False, "cuda")
    # assert
    assert _bias_adds_after_nbits(model) == 6
    assert all(len(n.inputs) < 6 for n in model.graph if n.op_type == "MatMulNBits")


def _direct_model(second_reader: bool):
    """x -> MatMulNBits -> Add(b) -> graph output y; optionally the MatMulNBits' output also feeds a Relu."""
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.standard_normal((48, 40)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal(40).astype(np.float32), "b"),
    ]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="proj"), helper.make_node("Add", ["h", "b"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if second_reader:
        nodes.append(helper.make_node("Relu", ["h"], ["r"], name="relu"))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["S", 48])]
    proto = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits))
    config = mnb.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=0, bits=4)
    quantizer = mnb.MatMulNBitsQuantizer(proto, algo_config=config)
    quantizer.process()
    return quantizer.model.model


def test_fold_bias_adds_gives_the_graph_output_name_to_matmulnbits_and_is_bit_exact_when_accuracy_level_0():
    # setup: a 2-D input, the Add's output a graph output
    proto = _direct_model(second_reader=False)
    model = ir.serde.deserialize_model(proto)
    # execute
    folded, declined = fold_bias_adds(model)
    # assert
    assert (folded, declined) == (1, [])
    (node,) = list(model.graph)
    assert node.op_type == "MatMulNBits" and node.inputs[5].name == "b" and node.outputs[0].name == "y"
    assert [v.name for v in model.graph.outputs] == ["y"]
    x = np.random.default_rng(1).standard_normal((5, 48)).astype(np.float32)
    np.testing.assert_array_equal(
        reference_session(model).run(None, {"x": x})[0], reference_session(proto).run(None, {"x": x})[0]
    )


def test_fold_bias_adds_leaves_the_add_when_the_matmulnbits_output_has_another_reader():
    # setup: the unbiased product is read by a Relu too: folding would hand it the bias
    model = ir.serde.deserialize_model(_direct_model(second_reader=True))
    before = Counter(n.op_type for n in model.graph)
    # execute
    folded, declined = fold_bias_adds(model)
    # assert
    assert (folded, declined) == (0, []) and Counter(n.op_type for n in model.graph) == before
