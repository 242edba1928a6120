"""quantize_int4 on the tiny decoder corpus (tests/models/decoders): structure (MatMulNBits per projection,
the lm_head found from the graph and left float), int4 numerics at prompt and cache lengths other than the
export's, accuracy_level and block size by measurement, the exclusion loop and the refusals. The next-token
gate on the trained decoder is in test_quantize_int4_trained.py.

The random-weight corpus decoders run with ``min_top1_agreement`` off: their logits are nearly tied, so the
greedy token of a random model says nothing about int4 (the gate is tested on the trained decoder)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.inputs import analyze
from passes._infra import PassContext
from passes.precision import _accuracy
from passes.precision.quantize_int4 import QuantizeInt4, lm_heads
from tests.models.build_decoders import OUT, Signature, decoder_feeds, presents_as_past

# Projections per layer: q, k, v, o, gate, up, down; Phi-3 fuses qkv and gate_up; GPT-2 has c_attn, c_proj,
# c_fc, mlp.c_proj (Gemms in the export). Two layers each.
PROJECTIONS = {"llama": 14, "qwen2": 14, "mistral": 14, "phi3": 8, "gpt2": 8}
PAST_FILES = [f"{family}_past_{exporter}" for family in PROJECTIONS for exporter in ("ts", "dynamo")]
# (batch, prompt, past): none of them the export's (2, 3, 4)
SHAPES = ((2, 7, 0), (2, 1, 9), (1, 4, 6))
NO_GATE = {"min_top1_agreement": None}


def samples_for(path, shapes=SHAPES, seed=0):
    signature = Signature.of(path)
    past_free = signature.layers == 0
    return [decoder_feeds(signature, b, s, 0 if past_free else p, seed=seed + i) for i, (b, s, p) in enumerate(shapes)]


def cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def session(model, optimized=False):
    proto = ir.serde.serialize_model(model) if isinstance(model, ir.Model) else onnx.load(str(model))
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def quantize(name, options=None, samples=None):
    path = OUT / f"{name}.onnx"
    model = ir.load(path)
    ctx = PassContext(samples=samples_for(path) if samples is None else samples)
    return model, QuantizeInt4(options)(model, ctx)


@pytest.fixture(scope="module")
def llama_default():
    return quantize("llama_past_ts", NO_GATE)


@pytest.mark.parametrize("name", PAST_FILES)
def test_quantize_int4_makes_every_projection_matmulnbits_and_keeps_the_head_float_when_decoder_has_a_cache(name):
    # setup / execute
    original, result = quantize(name, {"block_size": 32, "accuracy_level": 4, "lm_head": "float", **NO_GATE})
    # assert
    family = name.split("_")[0]
    assert result.modified and result.model is not original
    nbits = [n for n in result.model.graph if n.op_type == "MatMulNBits"]
    assert len(nbits) == PROJECTIONS[family] == result.counts["nodes_quantized"]
    for node in nbits:
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert node.domain == "com.microsoft"
        assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (4, 32, 4)
        assert node.inputs[1].const_value.dtype == ir.DataType.UINT8  # two int4 weights per byte
    (head,) = lm_heads(original)
    kept = {n.name: n for n in result.model.graph if n.op_type == "MatMul"}
    assert head in kept and kept[head].inputs[1].const_value.dtype == ir.DataType.FLOAT
    assert result.notes["lm_head"] == [head] and result.counts["lm_head_kept_float"] == 1
    assert result.notes["weight_bytes"]["after"] < result.notes["weight_bytes"]["before"]
    assert sum(1 for n in original.graph if n.op_type == "MatMulNBits") == 0  # functional: input untouched


def test_quantize_int4_stays_within_the_int4_budget_when_prompt_and_cache_lengths_differ_from_the_export(
    llama_default,
):
    # setup
    original, result = llama_default
    reference, candidate = session(original), session(result.model, optimized=True)
    signature = Signature.of(OUT / "llama_past_ts.onnx")
    names = [o.name for o in reference.get_outputs()]
    # execute: a prefill of 11 tokens, then 3 decode steps, each on the cache the previous call returned
    feeds = decoder_feeds(signature, 2, 11, 0, seed=7)
    ref_past = got_past = None
    for step in range(4):
        if step:
            tokens = np.full((2, 1), 17 + step, dtype=np.int64)
            past = 10 + step
            ref_feeds = decoder_feeds(signature, 2, 1, past, tokens=tokens, past_values=ref_past)
            got_feeds = decoder_feeds(signature, 2, 1, past, tokens=tokens, past_values=got_past)
        else:
            ref_feeds = got_feeds = feeds
        ref = dict(zip(names, reference.run(names, ref_feeds), strict=True))
        got = dict(zip(names, candidate.run(names, got_feeds), strict=True))
        # assert
        assert got["logits"].shape == ref["logits"].shape == (2, 11 if step == 0 else 1, signature.vocab)
        assert got["present.1.key"].shape == ref["present.1.key"].shape == (2, 2, 11 + step, 8)
        max_abs, cos = float(np.abs(got["logits"] - ref["logits"]).max()), cosine(ref["logits"], got["logits"])
        assert max_abs > 0 and cos >= 0.98, (step, max_abs, cos)
        ref_past, got_past = presents_as_past(ref), presents_as_past(got)
    assert result.notes["decision"].endswith("within the accuracy budget")


def fixed_latency(ms):
    """A stand-in for ``quantize_int4._latency_ms``: each candidate's latency (ms, every sample) by the name
    the pass measures it under (its file's stem: ``int8`` / ``fp32`` for the int4 MatMuls' level, ``float`` /
    ``int8 level 4`` / ``int8 level 0`` for the head), so a test checks the decision rule, not the host's speed."""

    def latency(path, feeds, repeats=5):
        return [ms[path.stem]] * len(feeds)

    return latency


def bits_and_levels(model):
    """``{MatMul name: (bits, accuracy_level)}`` of every MatMulNBits in ``model``."""
    return {
        n.name.rsplit("_Q", 1)[0]: (n.attributes["bits"].value, n.attributes["accuracy_level"].value)
        for n in model.graph
        if n.op_type == "MatMulNBits"
    }


def test_quantize_proto_keeps_the_level_of_the_matmulnbits_already_there_when_it_adds_an_8bit_head():
    # setup: every MatMul but the head int4 at fp32 compute (level 0)
    from passes.precision.quantize_int4 import QuantizeInt4Options, quantize_proto

    model = ir.load(OUT / "llama_past_ts.onnx")
    heads = lm_heads(model)
    options = QuantizeInt4Options(block_size=32)
    int4 = quantize_proto(ir.serde.serialize_model(model), options, 0, heads)
    others = [n.name for n in int4.graph.node if n.op_type == "MatMul" and n.name not in heads]
    # execute: the head 8-bit at int8 compute (level 4)
    both = quantize_proto(int4, options, 4, others, bits=8, include=heads)
    # assert: the int4 MatMuls keep level 0, only the node this call wrote has level 4
    levels = bits_and_levels(ir.serde.deserialize_model(both))
    assert levels.pop(heads[0]) == (8, 4)
    assert len(levels) == PROJECTIONS["llama"] and set(levels.values()) == {(4, 0)}


@pytest.mark.parametrize("faster", [4, 0])
def test_quantize_int4_chooses_accuracy_level_by_measurement_when_auto(monkeypatch, faster):
    # setup: both levels within the budget (a cosine one), the one named faster; the 8-bit head fastest at 4
    from passes.precision import quantize_int4

    ms = {"int8": 1.0, "fp32": 2.0} if faster == 4 else {"int8": 2.0, "fp32": 1.0}
    ms |= {"float": 2.0, "int8 level 4": 1.0, "int8 level 0": 3.0}
    monkeypatch.setattr(quantize_int4, "_latency_ms", fixed_latency(ms))
    # execute
    original, result = quantize("llama_past_ts", NO_GATE)
    # assert: the faster level within the budget is chosen, and it is the int4 MatMuls' level in the graph
    level = result.notes["accuracy_level"]
    assert level["within_budget"] == {"level 4": True, "level 0": True}
    assert (level["chosen"], level["by"]) == (faster, "measured: fastest within the budget")
    assert level["level_4_vs_0"] == (0.5 if faster == 4 else 2.0)
    (head,) = lm_heads(original)
    assert result.notes["lm_head_decision"].startswith("int8 (accuracy_level 4)")
    graph = bits_and_levels(result.model)
    assert graph.pop(head) == (8, 4)  # the head at its own level, whichever the int4 MatMuls have
    assert len(graph) == PROJECTIONS["llama"] and set(graph.values()) == {(4, faster)}
    # what the report says of each node is what the graph holds
    written = bits_and_levels(result.model)
    assert level["by_layer"] == {name: at for name, (_, at) in written.items()}
    assert result.notes["precision"] == {name: f"int{bits}" for name, (bits, _) in written.items()}


@pytest.mark.parametrize("head_faster", [4, 0])
def test_quantize_int4_times_an_asked_for_8bit_head_at_its_own_accuracy_level(monkeypatch, head_faster):
    # setup: the int4 MatMuls measure fastest at fp32 compute (level 0); the 8-bit head asked for is named
    # faster at head_faster, both levels within the budget (a cosine one)
    from passes.precision import quantize_int4

    ms = {"int8": 2.0, "fp32": 1.0, "int8 level 4": 1.0, "int8 level 0": 3.0}
    if head_faster == 0:
        ms |= {"int8 level 4": 3.0, "int8 level 0": 1.0}
    monkeypatch.setattr(quantize_int4, "_latency_ms", fixed_latency(ms))
    # execute
    original, result = quantize("llama_past_ts", {"lm_head": "int8", **NO_GATE})
    # assert: the head gets the level it measured fastest at, the int4 MatMuls keep theirs
    (head,) = lm_heads(original)
    assert result.notes["accuracy_level"]["chosen"] == 0
    decision = result.notes["lm_head_decision"]
    assert decision == f"int8 (option, accuracy_level {head_faster}, measured fastest): within the budget"
    assert set(result.notes["lm_head_latency_ms"]) == {"int8 level 4", "int8 level 0"}
    graph = bits_and_levels(result.model)
    assert graph.pop(head) == (8, head_faster)
    assert set(graph.values()) == {(4, 0)}
    # numerics: the artifact against the original on the generated sets (cosine budget, not exact)
    assert result.notes["accuracy"] and all(a["cosine"] >= 0.99 for a in result.notes["accuracy"].values())


def test_quantize_int4_keeps_the_given_accuracy_level_for_an_asked_for_8bit_head():
    # setup / execute: accuracy_level given: the head is not timed, it takes that level
    original, result = quantize("llama_past_ts", {"lm_head": "int8", "accuracy_level": 0, **NO_GATE})
    # assert
    (head,) = lm_heads(original)
    assert result.notes["lm_head_decision"] == "int8 (option, accuracy_level 0 as given): within the budget"
    assert "lm_head_latency_ms" not in result.notes
    assert bits_and_levels(result.model)[head] == (8, 0)


def test_quantize_int4_names_its_lm_head_choice_when_lm_head_is_auto(llama_default):
    _, result = llama_default
    decision = result.notes["lm_head_decision"]
    head_nodes = [n for n in result.model.graph if n.name.startswith("/model/lm_head/MatMul")]
    assert len(head_nodes) == 1
    if decision.startswith("int8"):
        assert head_nodes[0].op_type == "MatMulNBits" and head_nodes[0].attributes["bits"].value == 8
        level = head_nodes[0].attributes["accuracy_level"].value
        assert decision.startswith(f"int8 (accuracy_level {level})")
        assert result.notes["lm_head_vs_float"][f"int8 level {level}"] <= 1
    else:
        assert decision.startswith("float") and head_nodes[0].op_type == "MatMul"
    assert set(result.notes["lm_head_latency_ms"]) == {"float", "int8 level 4", "int8 level 0"}


def test_lm_heads_finds_the_head_by_structure_when_its_name_says_nothing():
    model = ir.load(OUT / "qwen2_past_ts.onnx")
    (head,) = lm_heads(model)
    node = next(n for n in model.graph if n.name == head)
    node.name = "proj_17"
    assert lm_heads(model) == ["proj_17"]
    assert _accuracy.logits_output(model) == "logits"
    # an encoder's output comes from a LayerNorm, not through elementwise ops from a MatMul: no head
    encoder = ir.load(OUT.parent / "hf_bert_encoder.onnx")
    assert lm_heads(encoder) == [] and _accuracy.logits_output(encoder) is None


def test_quantize_int4_keeps_the_most_sensitive_matmuls_float_when_the_budget_is_tighter_than_full_int4(
    llama_default,
):
    # setup: a budget between the fully quantized model's cosine and 1
    _, full = llama_default
    worst = min(a["cosine"] for a in full.notes["accuracy_all_quantized"].values())
    budget = 1 - (1 - worst) / 3
    # execute
    options = {"min_cosine": budget, "max_exclusions": 14, "lm_head": "float", "sensitive_as": "float", **NO_GATE}
    _, result = quantize("llama_past_ts", options)
    # assert
    assert result.modified
    excluded = [e["node"] for e in result.notes["excluded_for_accuracy"]]
    assert 1 <= len(excluded) == result.counts["nodes_excluded_for_accuracy"] < 14
    kept = {n.name for n in result.model.graph if n.op_type == "MatMul"}
    assert set(excluded) <= kept
    assert sum(1 for n in result.model.graph if n.op_type == "MatMulNBits") == 14 - len(excluded)
    assert min(a["cosine"] for a in result.notes["accuracy"].values()) >= budget
    assert {k for k, v in result.notes["precision"].items() if v == "float"} == {*excluded, *lm_heads(result.model)}


def test_quantize_int4_is_refused_when_the_budget_is_missed_and_max_exclusions_is_0():
    _, result = quantize("llama_past_ts", {"min_cosine": 0.999999, "max_exclusions": 0, "accuracy_level": 0})
    assert not result.modified
    assert any("max_exclusions is 0" in m.reason for m in result.non_matches)


def test_quantize_int4_is_refused_when_no_matmul_has_a_constant_weight():
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "y"], ["z"], name="mm")],
        "no_weights",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 32]) for n in ("x",)]
        + [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 32])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 32])],
    )
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    result = QuantizeInt4()(model, PassContext())
    assert not result.modified and result.counts == {"nodes_quantized": 0}
    assert "no MatMul with a constant 2-D weight" in result.non_matches[-1].reason


def test_quantize_int4_is_refused_when_the_only_weight_matmul_is_the_lm_head():
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"], name="head")],
        "head_only",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 64])],
        [numpy_helper.from_array(rng.standard_normal((32, 64)).astype(np.float32), "w")],
    )
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    result = QuantizeInt4()(model, PassContext())
    assert not result.modified and result.notes["lm_head"] == ["head"]
    assert "lm_head aside" in result.non_matches[-1].reason


def test_quantize_int4_is_refused_when_nodes_to_exclude_names_no_node():
    _, result = quantize("llama_past_ts", {"nodes_to_exclude": ["model.layers.0.self_attn.q_proj"]})
    assert not result.modified and result.notes["decision"] == "refused"
    assert "close node names" in result.non_matches[0].reason


def test_quantize_int4_quantizes_with_hqq_when_torch_imports():
    pytest.importorskip("torch")
    _, result = quantize("qwen2_past_dynamo", {"algorithm": "hqq", "accuracy_level": 0, "lm_head": "float", **NO_GATE})
    assert result.modified and result.notes["algorithm"] == "hqq" and not result.notes["symmetric"]
    nbits = [n for n in result.model.graph if n.op_type == "MatMulNBits"]
    assert len(nbits) == 14 and all(len(n.inputs) >= 4 for n in nbits)  # asymmetric: zero points


def test_prefill_empties_the_cache_and_counts_positions_from_0_when_the_sample_is_a_decode_step():
    # setup: a decode-shaped sample (3 new tokens on a random past of 6)
    path = OUT / "llama_past_ts.onnx"
    signature = Signature.of(path)
    sample = decoder_feeds(signature, 2, 3, 6, seed=5)
    sess = session(path)
    roles = analyze(ir.load(path)).roles
    # execute
    feed = _accuracy.prefill(sess, sample, roles)
    # assert: the same tokens on an empty cache, as a fresh prompt would run
    expected = decoder_feeds(signature, 2, 3, 0, tokens=sample["input_ids"])
    assert feed.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(feed[name], value, err_msg=name)
    assert sess.run(["logits"], feed)[0].shape == (2, 3, signature.vocab)
    # a prefill sample is fed as it is; a sample without token ids is not a sequence
    as_is = _accuracy.prefill(sess, expected, roles)
    assert as_is.keys() == expected.keys() and all(as_is[k] is v for k, v in expected.items())
    assert _accuracy.prefill(sess, {k: v for k, v in sample.items() if k != "input_ids"}, roles) is None


def test_prefill_finds_a_cache_by_its_role_when_no_input_is_named_past(tmp_path):
    """A cache named ``key_cache.N`` / ``value_cache.N`` (hand-written exports, other runtimes' conventions) is a
    key/value cache to the graph's input analysis; the prefill empties it as it empties ``past_key_values.*``."""
    proto = onnx.load(str(OUT / "llama_past_ts.onnx"))
    renamed = {}
    for value in proto.graph.input:
        if value.name.startswith("past_key_values."):
            _, layer, kind = value.name.split(".")
            renamed[value.name] = f"{kind}_cache.{layer}"
            value.name = renamed[value.name]
    for node in proto.graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    path = tmp_path / "llama_cache_names.onnx"
    onnx.save(proto, str(path))
    sess = session(path)
    roles = analyze(ir.load(path)).roles
    assert all(roles[name].role == "past_key_values" for name in renamed.values())
    signature = Signature.of(OUT / "llama_past_ts.onnx")
    sample = {renamed.get(k, k): v for k, v in decoder_feeds(signature, 2, 3, 6, seed=5).items()}
    feed = _accuracy.prefill(sess, sample, roles)
    assert all(feed[name].shape[2] == 0 for name in renamed.values())  # the caches emptied, the mask cut to 3
    assert feed["attention_mask"].shape == (2, 3) and (feed["position_ids"] == np.arange(3)).all()
    assert sess.run(["logits"], feed)[0].shape == (2, 3, signature.vocab)


def test_assemble_gives_the_model_a_direct_quantization_gives_when_some_matmuls_are_taken_from_the_8bit_one():
    # setup: full int4 and full 8-bit from one model; two MatMuls to take from the 8-bit one
    from passes.precision._quantization import assemble
    from passes.precision.quantize_int4 import QuantizeInt4Options, quantize_proto

    model = ir.load(OUT / "llama_past_ts.onnx")
    heads = lm_heads(model)
    names = [n.name for n in model.graph if n.op_type == "MatMul" and n.inputs[1].const_value is not None]
    names = [n for n in names if n not in heads]
    options = QuantizeInt4Options(block_size=16)
    proto = ir.serde.serialize_model(model)

    def quantized(int8):
        fresh = onnx.ModelProto.FromString(proto.SerializeToString())  # ORT's quantizer edits its input
        out = quantize_proto(fresh, options, 0, [*heads, *int8])
        if int8:
            others = [n.name for n in out.graph.node if n.op_type == "MatMul" and n.name not in int8]
            out = quantize_proto(out, options, 0, others, bits=8, include=int8)
        return out

    int8 = names[2:4]
    outputs = {n.name: n.output[0] for n in proto.graph.node}
    # execute
    mixed = assemble(quantized([]), quantized(names), {outputs[n] for n in int8})
    # assert: same nodes, same initializers, same logits as quantizing the mix directly
    direct = quantized(int8)
    assert [n.name for n in mixed.graph.node] == [n.name for n in direct.graph.node]
    assert {i.name for i in mixed.graph.initializer} == {i.name for i in direct.graph.initializer}
    bits = {n.name: n.attribute for n in mixed.graph.node if n.op_type == "MatMulNBits"}
    assert sorted(k for k, v in bits.items() if any(a.name == "bits" and a.i == 8 for a in v)) == sorted(
        f"{n}_Q8" for n in int8
    )
    feeds = samples_for(OUT / "llama_past_ts.onnx")[0]
    got = session(ir.serde.deserialize_model(mixed)).run(["logits"], feeds)[0]
    want = session(ir.serde.deserialize_model(direct)).run(["logits"], feeds)[0]
    np.testing.assert_array_equal(got, want)


def tied_toy(vocab=50, hidden=40):
    """ids -> Gather(E) -> Tanh -> MatMul(., E^T as its own initializer) -> logits: a tied head, as exporters
    write it (the head's copy transposed), with a hidden size that is no multiple of the block."""
    table = np.random.default_rng(5).standard_normal((vocab, hidden)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["E", "input_ids"], ["embedded"], name="embed"),
            helper.make_node("Tanh", ["embedded"], ["hidden"], name="act"),
            helper.make_node("MatMul", ["hidden", "W"], ["logits"], name="lm_head"),
        ],
        "toy",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab])],
        [numpy_helper.from_array(table, "E"), numpy_helper.from_array(table.T.copy(), "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), table


@pytest.mark.parametrize(("bits", "symmetric"), [(8, True), (4, False)])
def test_quantize_tables_reads_the_quantized_heads_weights_when_the_table_is_tied_to_the_head(bits, symmetric):
    # setup: the head quantized alone (block 16: 40 columns pad to 48)
    from passes.precision.quantize_int4 import QuantizeInt4Options, quantize_proto, quantize_tables

    proto, table = tied_toy()
    options = QuantizeInt4Options(block_size=16, symmetric=symmetric)
    quantized = quantize_proto(proto, options, 0, [], bits=bits)
    # execute
    done = quantize_tables(quantized, {"lm_head": table.T.copy()}, bits=8, block_size=32, symmetric=True)
    # assert: one table, read from the head's packed weights at the head's bits and block; E is gone
    assert done == [
        {
            "gather": "embed",
            "table": [50, 40],
            "bits": bits,
            "block_size": 16,
            "shared_with": "lm_head",
            "bytes_before": 50 * 40 * 4,
            "bytes_after": 0,
        }
    ]
    nodes = {n.op_type: n for n in quantized.graph.node}
    assert "Gather" not in nodes and "E" not in {i.name for i in quantized.graph.initializer}
    gbq, head, reshape = nodes["GatherBlockQuantized"], nodes["MatMulNBits"], nodes["Reshape"]
    assert reshape.input[0] == head.input[1] and gbq.input[0] == reshape.output[0]
    assert list(gbq.input[2:]) == list(head.input[2:])  # the head's scales (and zero points)
    assert nodes["Slice"].output[0] == "embedded"
    # the rows the Gather gives are the head's dequantized weights: the head applied to unit vectors
    ids = np.array([[0, 7, 49], [3, 3, 12]], dtype=np.int64)
    probe = onnx.ModelProto()
    probe.CopyFrom(quantized)
    probe.graph.output.append(helper.make_tensor_value_info("embedded", TensorProto.FLOAT, None))
    embedded = session(ir.serde.deserialize_model(probe)).run(["embedded"], {"input_ids": ids})[0]
    head_only = tied_toy()[0]
    del head_only.graph.node[:2]  # the head alone, on a float input
    head_only.graph.input[0].CopyFrom(helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [40, 40]))
    head_only = quantize_proto(head_only, options, 0, [], bits=bits)
    unit = {"hidden": np.eye(40, dtype=np.float32)}
    dequantized = session(ir.serde.deserialize_model(head_only)).run(["logits"], unit)[0]
    np.testing.assert_array_equal(embedded, dequantized.T[ids])
    assert 0 < np.abs(embedded - table[ids]).max() < (0.05 if bits == 8 else 0.5)


def test_quantize_int4_stores_a_tied_table_once_and_an_untied_one_8bit_when_embeddings_is_auto():
    # setup / execute: GPT-2 ties wte to its head; Llama's table is its own
    tied_original, tied = quantize("gpt2_past_ts", {"lm_head": "int8", **NO_GATE})
    untied_original, untied = quantize("llama_past_dynamo", {"lm_head": "float", **NO_GATE})
    # assert
    for original, result, shared in ((tied_original, tied, "/model/lm_head/MatMul"), (untied_original, untied, None)):
        entry = result.notes["embeddings"]
        assert entry["decision"] == "quantized: within the budget"
        token = entry["tables"][0]
        assert token["bits"] == 8 and token["shared_with"] == shared
        assert (token["bytes_after"] == 0) == (shared is not None)
        gathers = {n.name for n in result.model.graph if n.op_type == "GatherBlockQuantized"}
        assert f"{token['gather']}_Q8" in gathers
        assert not any(n.name == token["gather"] for n in result.model.graph)
        # the logits at shapes other than the export's, graph optimizations off and on
        for feeds in samples_for(OUT / f"{'gpt2_past_ts' if shared else 'llama_past_dynamo'}.onnx", seed=7):
            want = session(original).run(["logits"], feeds)[0]
            got = session(result.model).run(["logits"], feeds)[0]
            assert cosine(got, want) > 0.98
            np.testing.assert_allclose(session(result.model, optimized=True).run(["logits"], feeds)[0], got, atol=1e-4)
    assert tied.notes["weight_bytes"]["after"] < 0.35 * tied.notes["weight_bytes"]["before"]
    # the pipeline still reads input_ids as token ids below the vocabulary through the shared table's Reshape
    from core.inputs.graph import analyze

    role = analyze(tied.model).roles["input_ids"]
    assert (role.role, role.high) == ("token_ids", 256)


def test_quantize_int4_leaves_the_token_tables_float_when_embeddings_is_float():
    _, result = quantize("llama_past_ts", {"embeddings": "float", "lm_head": "float", **NO_GATE})
    assert result.notes["embeddings"] == {"decision": "float (option)"}
    assert not any(n.op_type == "GatherBlockQuantized" for n in result.model.graph)
    assert any(n.op_type == "Gather" and n.inputs[0].name == "model.embed_tokens.weight" for n in result.model.graph)


# What bench/decoders_genai.py sends to match onnxruntime-genai's int4 builder: block 32, int8 activations, the
# head int4 too, every MatMul int4 whatever the accuracy (the greedy gate and the cosine budget off).
BUILDER_MATCHED = {
    "block_size": 32,
    "accuracy_level": 4,
    "lm_head": "int4",
    "min_top1_agreement": None,
    "min_cosine": -1,
    "max_exclusions": 0,
    "embeddings": "float",
}


@pytest.mark.parametrize("name", ["llama_past_ts", "qwen2_past_dynamo"])
def test_quantize_int4_makes_every_weight_matmul_int4_when_the_decoder_is_fused_and_options_match_the_builder(name):
    # setup: the int4 preset's fusions first (RotaryEmbedding, GroupQueryAttention)
    rotary = pytest.importorskip("passes.fusion.fuse_rotary")
    from passes.fusion.fuse_gqa import FuseGqa

    path = OUT / f"{name}.onnx"
    fused = FuseGqa()(rotary.FuseRotary()(ir.load(path)).model).model
    weights = [n.name for n in fused.graph if n.op_type == "MatMul" and n.inputs[1].const_value is not None]
    # execute
    result = QuantizeInt4(BUILDER_MATCHED)(fused, PassContext(samples=samples_for(path)))
    # assert: attention still fused, every weight MatMul (the head included) 4-bit at block 32, level 4
    assert result.modified
    ops = [n.op_type for n in result.model.graph]
    assert ops.count("GroupQueryAttention") == 2
    nbits = {n.name.rsplit("_Q", 1)[0]: n for n in result.model.graph if n.op_type == "MatMulNBits"}
    assert sorted(nbits) == sorted(weights) and set(result.notes["precision"].values()) == {"int4"}
    for node in nbits.values():
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (4, 32, 4)
    assert "GatherBlockQuantized" not in ops
    signature = Signature.of(path)
    reference, candidate = session(path), session(result.model, optimized=True)
    for index, (batch, seq, past) in enumerate(((1, 6, 0), (1, 1, 11))):
        feeds = decoder_feeds(signature, batch, seq, past, seed=20 + index)
        assert cosine(candidate.run(["logits"], feeds)[0], reference.run(["logits"], feeds)[0]) > 0.95


@pytest.mark.parametrize("exporter", ["ts", "dynamo"])
@pytest.mark.parametrize("arch", ["bart", "t5"])
def test_quantize_int4_judges_the_greedy_tokens_with_the_encoders_context_when_seq2seq_decoder_with_past(
    arch, exporter
):
    # setup: decoder_with_past's generated sets (the self-attention cache empty in one, longer in others). The
    # probe emptied every cache, the encoder's too: TorchScript's exports (the encoder mask added to the cross
    # scores) failed in ORT, dynamo's ran without the source
    from core.inputs import generate_input_sets
    from tests.models.build_seq2seq import OUT as SEQ2SEQ
    from tests.models.build_seq2seq import folder

    path = SEQ2SEQ / folder(arch, exporter) / "decoder_with_past_model.onnx"
    original = ir.load(path)
    ctx = PassContext(samples=[s.feeds for s in generate_input_sets(original, 3)])
    # execute
    result = QuantizeInt4({"lm_head": "float", "accuracy_level": 0})(original, ctx)
    # assert: quantized, judged on prefills of the samples' tokens over their whole encoder side
    assert result.modified and result.counts["nodes_quantized"] > 0
    positions = sum(int(np.asarray(f["input_ids"]).size) for f in ctx.samples)
    sequences = result.notes["next_token"]["sequences"]
    assert f" {positions} token(s), each fed as a prefill (empty self-attention cache, the encoder's" in sequences
    assert "the encoder's context whole: 5 input(s) over its sequence" in sequences, sequences  # mask, 2 x (k, v)
    accuracy = result.notes["accuracy"]["logits (teacher forcing)"]
    assert accuracy["flipped"] == 0 and accuracy["positions"] == positions
    # numerics at generated sets of another seed
    want_sess, got_sess = session(original), session(result.model)
    for sample in generate_input_sets(original, 3, seed=5):
        want, got = want_sess.run(["logits"], sample.feeds)[0], got_sess.run(["logits"], sample.feeds)[0]
        assert cosine(want, got) > 0.98
