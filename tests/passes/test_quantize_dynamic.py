"""quantize_dynamic: structure (MatMulInteger, int8 weights), int8 numerics on several shapes, the user's
exclusions, refusal of unknown node names, the accuracy loop that keeps the most sensitive node float, and the
next-token budget (off unless min_top1_agreement is set) on the trained decoder."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.errors import InvalidPassOptionsError
from passes._infra import PassContext
from passes.precision import _accuracy, _sensitivity
from passes.precision.quantize_dynamic import QuantizeDynamic
from tests.models.build_decoders import OUT as DECODERS
from tests.models.build_decoders import Signature, decoder_feeds
from tests.models.build_hf import make_inputs
from tests.passes._util import MODELS

BERT = MODELS / "hf_bert_encoder.onnx"
SHAPES = [(1, 5), (3, 17), (2, 24)]


def bert_samples(shapes=SHAPES, pad=0.2):
    return [make_inputs("bert_encoder", b, s, pad_fraction=pad, seed=i, size="tiny") for i, (b, s) in enumerate(shapes)]


def outlier_model() -> onnx.ModelProto:
    """Two MatMuls on x[N,16]: ``clean`` reads x, ``outlier`` reads x * [1000, 1, ..., 1]. Per-tensor
    activation quantization of the outlier input crushes its 15 ordinary features to zero."""
    rng = np.random.default_rng(0)
    w_outlier = rng.standard_normal((16, 16)).astype(np.float32)
    w_outlier[0] *= 1e-3  # the outlier feature's contribution stays ordinary: the loss is the other 15
    scale = np.ones(16, np.float32)
    scale[0] = 1000.0
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w_clean"], ["y_clean"], name="clean"),
            helper.make_node("Mul", ["x", "s"], ["x_scaled"], name="scale"),
            helper.make_node("MatMul", ["x_scaled", "w_outlier"], ["y_outlier"], name="outlier"),
        ],
        "outlier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [
            helper.make_tensor_value_info("y_clean", TensorProto.FLOAT, ["N", 16]),
            helper.make_tensor_value_info("y_outlier", TensorProto.FLOAT, ["N", 16]),
        ],
        initializer=[
            numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w_clean"),
            numpy_helper.from_array(scale, "s"),
            numpy_helper.from_array(w_outlier, "w_outlier"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def outlier_samples(n=3):
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((r, 16)).astype(np.float32)} for r in (4, 7, 2)[:n]]


def run(proto_or_ir, feeds):
    proto = ir.serde.serialize_model(proto_or_ir) if isinstance(proto_or_ir, ir.Model) else proto_or_ir
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    sess = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def ops(model: ir.Model) -> Counter:
    return Counter(n.op_type for n in model.graph)


def quantize(options=None, model_path=BERT, samples=None):
    model = ir.load(model_path)
    result = QuantizeDynamic(options)(model, PassContext(samples=bert_samples() if samples is None else samples))
    return model, result


@pytest.fixture(scope="module")
def bert_default():
    return quantize()


def test_matmuls_with_constant_weights_become_matmulinteger_with_int8_weights(bert_default):
    original, result = bert_default
    assert result.modified and result.model is not original
    before, after = ops(original), ops(result.model)
    # 12 linear layers (2 layers x Q, K, V, out, up, down); the 4 attention MatMuls have no constant weight
    assert after["MatMulInteger"] == 12 == result.counts["nodes_quantized"]
    assert after["MatMul"] == before["MatMul"] - 12 == 4
    assert after["DynamicQuantizeLinear"] >= 6  # one per distinct activation (Q, K, V share theirs)
    assert len(result.non_matches) == 4 and all("not a constant" in m.reason for m in result.non_matches)
    for node in result.model.graph:
        if node.op_type == "MatMulInteger":
            weight = node.inputs[1].const_value
            assert weight is not None and weight.dtype == ir.DataType.INT8
            assert node.inputs[0].producer().op_type == "DynamicQuantizeLinear"
    assert result.notes["weight_type"] == "QInt8"
    assert result.notes["op_types_after"]["MatMulInteger"] == 12
    assert ops(original)["MatMulInteger"] == 0  # functional: the input is untouched


def test_int8_numerics_on_several_shapes(bert_default):
    original, result = bert_default
    proto = ir.serde.serialize_model(original)
    quantized = ir.serde.serialize_model(result.model)
    onnx.checker.check_model(quantized, full_check=True)
    for i, (b, s) in enumerate([(1, 7), (4, 31), (2, 64), (3, 9)]):
        feeds = make_inputs("bert_encoder", b, s, pad_fraction=0.25, seed=10 + i, size="tiny")
        ref, got = run(proto, feeds)[0], run(quantized, feeds)[0]
        assert got.shape == ref.shape == (b, s, 32)
        assert _accuracy.compare_arrays(ref, got).cosine >= 0.99
    acc = result.notes["accuracy"]["last_hidden_state"]
    assert acc["cosine"] >= 0.99 and acc["max_abs"] > 0  # measured, and not exact
    assert result.notes["samples_used"] == 3


def test_per_channel_and_reduce_range_give_vector_scales():
    _, result = quantize({"per_channel": True, "reduce_range": True, "op_types": ["MatMul"]})
    assert result.modified and result.notes["per_channel"] and result.notes["reduce_range"]
    for node in result.model.graph:
        if node.op_type == "MatMulInteger":
            weight = node.inputs[1].const_value.numpy()
            assert weight.dtype == np.int8 and np.abs(weight.astype(int)).max() <= 64  # 7-bit weights
            scale_mul = node.outputs[0].uses()[0].node.outputs[0].uses()[0].node  # Cast -> Mul(scales)
            scales = [v for v in scale_mul.inputs if v is not None and v.producer() is not None]
            assert scales  # the per-channel scale product is computed at run time from the vector scale
    assert result.notes["accuracy"]["last_hidden_state"]["cosine"] >= 0.99


def test_nodes_to_exclude_stay_float():
    names = ["node_MatMul_86", "node_MatMul_145"]
    _, result = quantize({"nodes_to_exclude": names})
    assert result.modified
    kept = {n.name: n for n in result.model.graph if n.name in names}
    assert set(kept) == set(names) and all(n.op_type == "MatMul" for n in kept.values())
    assert all(kept[n].inputs[1].const_value.dtype == ir.DataType.FLOAT for n in names)
    assert ops(result.model)["MatMulInteger"] == 10
    assert result.counts == {"nodes_quantized": 10, "nodes_excluded_by_user": 2}


def test_unknown_node_name_is_refused_with_close_names():
    model, result = quantize({"nodes_to_exclude": ["encoder.layer.0.attention.self.query", "node_MatMul_8"]})
    assert not result.modified and result.model is not model
    assert len(result.non_matches) == 2
    first, second = result.non_matches
    assert "encoder.layer.0.attention.self.query" in first.reason and "not framework module" in first.reason
    assert "node_MatMul_86" in second.reason  # a close node name is suggested
    assert ops(result.model)["MatMulInteger"] == 0


def test_accuracy_loop_keeps_the_sensitive_node_float_and_names_it():
    proto = outlier_model()
    samples = outlier_samples()
    result = QuantizeDynamic()(ir.serde.deserialize_model(proto), PassContext(samples=samples))
    assert result.modified
    notes = result.notes
    before = notes["accuracy_all_quantized"]
    assert before["y_outlier"]["cosine"] < 0.99 <= before["y_clean"]["cosine"]
    assert notes["node_errors_top"][0]["node"] == "outlier"  # ranked worst by the error it introduces
    assert notes["node_errors_top"][0]["rel_l2"] > 10 * notes["node_errors_top"][1]["rel_l2"]
    assert [e["node"] for e in notes["excluded_for_accuracy"]] == ["outlier"]
    assert "outlier" in notes["decision"]
    assert all(a["cosine"] >= 0.99 for a in notes["accuracy"].values())
    assert result.counts == {"nodes_quantized": 1, "nodes_excluded_by_user": 0, "nodes_excluded_for_accuracy": 1}
    nodes = {n.name: n.op_type for n in result.model.graph}
    assert nodes["outlier"] == "MatMul" and "clean" not in nodes and ops(result.model)["MatMulInteger"] == 1
    ref, got = run(proto, samples[0]), run(result.model, samples[0])
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-4)  # the float node is exact


def test_tiny_budget_on_the_encoder_excludes_the_worst_nodes_or_refuses(bert_default):
    full = bert_default[1].notes["accuracy_all_quantized"]["last_hidden_state"]["rel_l2"]
    # a budget just under what full quantization reaches: the loop keeps the worst node(s) float
    _, result = quantize({"max_rel_error": full * 0.95, "max_exclusions": 12})
    assert result.modified
    excluded = result.notes["excluded_for_accuracy"]
    assert excluded and all(e["node"].startswith("node_MatMul") and e["rel_l2"] > 0 for e in excluded)
    assert [e["node"] for e in excluded] == [e["node"] for e in result.notes["node_errors_top"][: len(excluded)]]
    assert result.notes["accuracy"]["last_hidden_state"]["rel_l2"] <= full * 0.95
    float_names = {n.name for n in result.model.graph if n.op_type == "MatMul"}
    assert {e["node"] for e in excluded} <= float_names
    assert all(e["node"] in result.notes["decision"] for e in excluded)
    # an impossible budget within 2 exclusions: the pass changes nothing and says why
    _, refused = quantize({"max_rel_error": 1e-6, "max_exclusions": 2})
    assert not refused.modified
    assert "accuracy budget missed" in refused.non_matches[-1].reason
    trials = refused.notes["exclusion_trials"]
    assert [t["excluded"] for t in trials] == [1, 2] and not any(t["holds"] for t in trials)
    assert len(refused.notes["excluded_for_accuracy"]) == 2


def test_bisection_finds_the_smallest_exclusion_count():
    ranking = [_sensitivity.NodeError(f"n{i}", "MatMul", 1.0 / (i + 1), 0.9) for i in range(10)]
    calls = []

    def fake_quantize(excluded, tag):
        calls.append(len(excluded))
        return len(excluded)

    def evaluate(k):
        return {"y": _accuracy.OutputAccuracy(0.1, 0.1, 0.999 if k >= 5 else 0.9)}

    out = _sensitivity.exclusion_loop(ranking, fake_quantize, evaluate, _accuracy.Budget(0.99, None, None), 8)
    assert [e.node for e in out.excluded] == ["n0", "n1", "n2", "n3", "n4"]
    assert calls == [1, 2, 4, 8, 6, 5]


def test_without_samples_it_quantizes_and_leaves_accuracy_to_the_ledger():
    _, result = quantize(samples=[])
    assert result.modified and result.counts["nodes_quantized"] == 12
    assert result.notes["accuracy"].startswith("not measured")


def test_nothing_to_quantize_is_a_non_match():
    _, result = quantize({"op_types": ["Conv"]})
    assert not result.modified and "no node of op types Conv" in result.non_matches[-1].reason


def test_options_are_validated():
    assert QuantizeDynamic.exact is False and QuantizeDynamic.in_place is False
    with pytest.raises(InvalidPassOptionsError):
        QuantizeDynamic({"weight_type": "QInt4"})
    with pytest.raises(InvalidPassOptionsError):
        QuantizeDynamic({"per_chanel": True})
    with pytest.raises(InvalidPassOptionsError):
        QuantizeDynamic({"op_types": []})
    schema = QuantizeDynamic.options_schema()
    assert all(field.get("description") for field in schema["properties"].values())


def test_attention_without_a_qattention_form_is_named_not_counted():
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node(
                "Attention",
                ["x", "w", "b", "", "", "bias"],
                ["y"],
                name="attn",
                domain="com.microsoft",
                num_heads=2,
                qkv_hidden_sizes=[8, 8, 8],
            )
        ],
        "attention",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8]),
            helper.make_tensor_value_info("bias", TensorProto.FLOAT, [1, 2, 4, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
        initializer=[
            numpy_helper.from_array(rng.standard_normal((8, 24)).astype(np.float32), "w"),
            numpy_helper.from_array(np.zeros(24, np.float32), "b"),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    result = QuantizeDynamic()(ir.serde.deserialize_model(model), PassContext())
    assert not result.modified
    assert result.non_matches[0].node == "attn" and "no QAttention form" in result.non_matches[0].reason


def test_packed_qkv_projection_becomes_one_int8_matmul_when_fused_to_multi_head_attention():
    """The int8 preset's order: fuse_transformer(attention='mha', pack_qkv) keeps the attention core fused and
    leaves one Q|K|V MatMul per layer, which quantize_dynamic turns into one MatMulInteger on one quantized
    activation (QAttention cannot take the exporter's attention_bias, so a packed Attention would stay float)."""
    from passes.fusion.fuse_transformer import FuseTransformer

    fused = FuseTransformer({"attention": "mha", "pack_qkv": True, "engines": ["onnxscript"]})(ir.load(BERT)).model
    result = QuantizeDynamic()(fused, PassContext(samples=bert_samples()))
    after = ops(result.model)
    assert after["MultiHeadAttention"] == 2
    # per layer: packed Q|K|V, output projection, FFN up, FFN down; no float MatMul with a constant weight left
    assert result.counts["nodes_quantized"] == 8 == after["MatMulInteger"]
    assert "MatMul" not in after
    packed = [n for n in result.model.graph if n.op_type == "MatMulInteger" and n.inputs[1].const_value.shape[1] == 96]
    assert len(packed) == 2  # hidden 32: [32, 3 * 32] int8 weights
    assert all(n.inputs[1].const_value.dtype == ir.DataType.INT8 for n in packed)
    proto, quantized = ir.serde.serialize_model(ir.load(BERT)), ir.serde.serialize_model(result.model)
    for i, (b, s) in enumerate([(1, 7), (3, 20)]):
        feeds = make_inputs("bert_encoder", b, s, pad_fraction=0.25, seed=20 + i, size="tiny")
        assert _accuracy.compare_arrays(run(proto, feeds)[0], run(quantized, feeds)[0]).cosine >= 0.99


def fused_matmul_head() -> onnx.ModelProto:
    """y = Relu(FusedMatMul(x, W, transB=1)) with a constant W [6, 8]: a tied LM head after onnxscript's fusions."""
    rng = np.random.default_rng(3)
    weight = numpy_helper.from_array(rng.standard_normal((6, 8)).astype(np.float32), "table")
    nodes = [
        helper.make_node("FusedMatMul", ["x", "table"], ["h"], name="head", domain="com.microsoft", transB=1),
        helper.make_node("Relu", ["h"], ["y"], name="act"),
    ]
    graph = helper.make_graph(
        nodes,
        "fused_head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 6])],
        [weight],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def test_fused_matmul_with_transposed_constant_weight_is_quantized_when_op_types_include_matmul():
    """FusedMatMul(x, W, transB=1) -> MatMul(x, W^T) -> MatMulInteger: the tied LM head gets int8 weights, the
    input model keeps its FusedMatMul (functional pass)."""
    proto = fused_matmul_head()
    model = ir.serde.deserialize_model(proto)
    rng = np.random.default_rng(4)
    samples = [{"x": rng.standard_normal((r, 8)).astype(np.float32)} for r in (3, 5)]
    result = QuantizeDynamic()(model, PassContext(samples=samples))
    after = ops(result.model)
    assert result.notes["fused_matmuls_unfused"] == 1 and result.counts["nodes_quantized"] == 1
    assert after["MatMulInteger"] == 1 and "FusedMatMul" not in after
    assert ops(model)["FusedMatMul"] == 1
    for feeds in samples:
        assert _accuracy.compare_arrays(run(proto, feeds)[0], run(result.model, feeds)[0]).cosine >= 0.99


def test_fused_matmul_is_quantized_and_output_keeps_its_name_when_it_is_a_graph_output():
    """GPT-2's tied head writes the ``logits`` graph output itself: the quantized head writes it, same name."""
    proto = fused_matmul_head()
    del proto.graph.node[1]  # no Relu: the FusedMatMul's output is the graph output
    proto.graph.node[0].output[0] = "y"
    model = ir.serde.deserialize_model(proto)
    rng = np.random.default_rng(5)
    samples = [{"x": rng.standard_normal((r, 8)).astype(np.float32)} for r in (3, 5)]
    result = QuantizeDynamic()(model, PassContext(samples=samples))
    assert result.notes["fused_matmuls_unfused"] == 1 and result.counts["nodes_quantized"] == 1
    assert [o.name for o in result.model.graph.outputs] == ["y"]
    assert ops(result.model)["MatMulInteger"] == 1
    for feeds in samples:
        assert _accuracy.compare_arrays(run(proto, feeds)[0], run(result.model, feeds)[0]).cosine >= 0.99


def test_fused_matmul_stays_when_matmul_is_not_an_op_type_to_quantize():
    model = ir.serde.deserialize_model(fused_matmul_head())
    result = QuantizeDynamic({"op_types": ["Gather"]})(model, PassContext(samples=[{"x": np.ones((2, 8), np.float32)}]))
    assert not result.modified
    assert ops(result.model)["FusedMatMul"] == 1


def decoder_samples():
    signature = Signature.of(DECODERS / "trained_llama_past_ts.onnx")
    # a prompt, and a decode step on a random cache that the next-token figures feed as a prefill instead
    return DECODERS / "trained_llama_past_ts.onnx", [
        decoder_feeds(signature, 2, 16, 0, seed=1),
        decoder_feeds(signature, 2, 1, 9, seed=2),
    ]


def test_quantize_dynamic_reports_next_token_figures_but_does_not_gate_them_when_min_top1_agreement_is_unset():
    # setup
    path, samples = decoder_samples()
    # execute
    result = QuantizeDynamic()(ir.load(path), PassContext(samples=samples))
    # assert: 2 x 16 prompt positions + 2 x 1 prefilled decode tokens, every figure present, no gate
    assert result.modified and result.notes["budget"]["min_top1_agreement"] is None
    tokens = result.notes["accuracy"]["logits (teacher forcing)"]
    assert tokens["positions"] == 34 and 0 <= tokens["flipped"] <= 34
    assert set(tokens["perplexity"]) == {"original", "quantized"} and tokens["max_logit_diff"] > 0
    assert result.notes["next_token"]["logits"] == "logits"


def test_quantize_dynamic_is_refused_with_the_flipped_tokens_when_min_top1_agreement_is_missed():
    # setup: int8 flips some of the 34 greedy tokens of the trained decoder (measured: 4); 1.0 allows none
    path, samples = decoder_samples()
    # execute
    result = QuantizeDynamic({"min_top1_agreement": 1.0, "max_exclusions": 0})(
        ir.load(path), PassContext(samples=samples)
    )
    # assert
    assert not result.modified
    flipped = result.notes["accuracy_all_quantized"]["logits (teacher forcing)"]["flipped"]
    (reason,) = [m.reason for m in result.non_matches if "accuracy budget missed" in m.reason]
    assert flipped > 0 and f"top-1 agreement {1 - flipped / 34:.4f} < 1.0 ({flipped} of 34 greedy tokens" in reason


def test_quantize_dynamic_notes_that_the_top1_gate_is_not_applied_when_the_model_has_no_logits_output():
    result = QuantizeDynamic({"min_top1_agreement": 0.99})(ir.load(BERT), PassContext(samples=bert_samples()))
    assert result.modified
    assert result.notes["next_token"].startswith("not measured: no logits output")
    assert result.notes["next_token"].endswith("is not applied")
