"""fuse_rotary on the committed decoder corpus (tests/models/decoders: Llama, Qwen2, Phi-3, Mistral and a
trained Llama, each exported by TorchScript and dynamo, with and without a KV cache) and on hand-written
graphs for the forms the corpus lacks (a folded cos/sin table) and the ones the pass must refuse.

Every fused model is compared with the original under ORT with graph optimizations off, at prompt and cache
lengths other than the export's (2 x 3 after a past of 4)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from passes import registry
from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_rotary import FuseRotary, cache_rows
from tests.models.build_decoders import OUT, Signature, decoder_feeds, presents_as_past

MANIFEST = json.loads((OUT / "manifest.json").read_text())
FILES = {e["file"]: e for e in MANIFEST["files"] if "error" not in e}
ROTARY = sorted(f for f, e in FILES.items() if e["family"] != "gpt2")
GPT2 = sorted(f for f, e in FILES.items() if e["family"] == "gpt2")
# (batch, prompt, past): none is the export's (2, 3, 4); 40 + 5 runs past every position the export saw
SHAPES = ((2, 7, 0), (2, 1, 9), (1, 4, 6), (3, 5, 40))


def layers_of(name: str) -> int:
    return MANIFEST["families"][FILES[name]["family"]]["layers"]


def session(model: ir.Model | str, optimized: bool = False) -> ort.InferenceSession:
    data = str(model) if isinstance(model, str) else ir.serde.serialize_model(model).SerializeToString()
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def assert_same(name: str, fused: ir.Model, shapes=SHAPES) -> None:
    signature = Signature.of(OUT / name)
    reference, candidate = session(str(OUT / name)), session(fused)
    names = [o.name for o in reference.get_outputs()]
    for i, (batch, prompt, past) in enumerate(shapes):
        feeds = decoder_feeds(signature, batch, prompt, past if signature.layers else 0, seed=i)
        for out, want, got in zip(names, reference.run(names, feeds), candidate.run(names, feeds), strict=True):
            where = f"{name} {out} at {batch, prompt, past}"
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=where)


def fuse(name: str, options=None):
    model = ir.load(OUT / name)
    return model, FuseRotary(options)(model)


@pytest.mark.parametrize("name", ROTARY)
def test_fuse_rotary_makes_one_rotary_embedding_per_q_and_k_when_decoder_uses_rope(name):
    model, result = fuse(name)
    ops = op_histogram(model)
    layers = layers_of(name)
    assert result.modified
    assert result.non_matches == []
    assert ops["com.microsoft::RotaryEmbedding"] == result.counts["rotary_embeddings"] == 2 * layers
    assert ops["Sin"] == ops["Cos"] == ops["Neg"] == 0  # no trigonometry, no rotate_half left in any layer
    assert result.notes["rotary_layers"] == list(range(layers))
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    assert_same(name, model)


@pytest.mark.parametrize("name", [f for f in ROTARY if "_past_" in f])
def test_fuse_rotary_decodes_token_by_token_like_the_original_when_cache_grows(name):
    model, _ = fuse(name)
    signature = Signature.of(OUT / name)
    reference, candidate = session(str(OUT / name)), session(model)
    names = [o.name for o in reference.get_outputs()]
    feeds = decoder_feeds(signature, 2, 6, 0, seed=3)
    for step in range(4):  # prefill 6, then one token at a time on each model's own cache
        want = dict(zip(names, reference.run(names, feeds), strict=True))
        got = dict(zip(names, candidate.run(names, feeds), strict=True))
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-5, err_msg=f"step {step}")
        past = presents_as_past(want)
        length = past["past_key_values.0.key"].shape[2]
        feeds = decoder_feeds(signature, 2, 1, length, seed=10 + step, past_values=past)


@pytest.mark.parametrize("name", ["llama_past_ts.onnx", "phi3_past_ts.onnx", "qwen2_past_dynamo.onnx"])
def test_fuse_rotary_fuses_every_layer_when_fast_cleanups_ran_first(name):
    """constant_folding rewrites TorchScript's run-time split points as Constant(value_ints) and CSE merges the
    per-layer cos/sin Unsqueezes: the forms fuse_rotary meets inside the ``fast`` preset."""
    model = ir.load(OUT / name)
    specs = registry.PRESETS["fast"].specs
    before = [s for s in specs[: [s.name for s in specs].index("fuse_rotary")] if s.name != "padding_elimination"]
    for p in registry.build_passes(before):
        model = p(model, PassContext()).model
    result = FuseRotary()(model, PassContext())
    ops = op_histogram(model)
    assert ops["com.microsoft::RotaryEmbedding"] == 2 * layers_of(name)
    assert ops["Sin"] == ops["Cos"] == ops["Neg"] == 0  # even where an earlier pass left a dead Identity on cos
    assert result.non_matches == []
    assert_same(name, model)


@pytest.mark.parametrize("name", GPT2)
def test_fuse_rotary_reports_no_rotary_and_changes_nothing_when_decoder_is_gpt2(name):
    model, result = fuse(name)
    assert not result.modified
    assert result.notes["decoder"]["rotary"] == "no rotary"
    assert len(list(model.graph)) == FILES[name]["nodes"]


def test_fuse_rotary_uses_the_max_positions_option_and_ort_refuses_positions_past_it():
    model, result = fuse("llama_past_dynamo.onnx", {"max_positions": 32})
    caches = cache_rows(model)
    assert sorted(caches) == ["rotary_emb.cos_cache", "rotary_emb.sin_cache"]
    assert all(table.shape == (32, 4) for table in caches.values())  # rotary_dim 8 / 2
    assert result.notes["max_positions"] == {"inv_freq": 32}
    signature = Signature.of(OUT / "llama_past_dynamo.onnx")
    fused = session(model)
    fused.run(None, decoder_feeds(signature, 1, 4, 28))  # positions 28..31: the last rows
    with pytest.raises(Exception, match="out of range"):  # never a silently wrong row
        fused.run(None, decoder_feeds(signature, 1, 4, 29))


@pytest.mark.parametrize("name", ROTARY)
def test_fuse_rotary_leaves_every_rms_norm_in_the_form_ort_fuses_when_either_exporter_wrote_it(name, tmp_path):
    """ORT's session fuses TorchScript's ``Div(1, Sqrt)`` norms into SimplifiedLayerNormalization but not
    dynamo's ``Reciprocal(Sqrt)``; after fuse_rotary every norm of every corpus decoder is fused (2 per layer
    and the final one), counted in the graph the session builds at its default level."""
    model, result = fuse(name)
    norms = 2 * layers_of(name) + 1
    assert result.counts["rms_norms_divided"] == (norms if FILES[name]["exporter"] == "dynamo" else 0)
    assert op_histogram(model)["Reciprocal"] == 0
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "session.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), options)
    fused_ops = Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)
    assert fused_ops["SimplifiedLayerNormalization"] == norms
    assert fused_ops["Pow"] == fused_ops["Sqrt"] == 0


# ------------------------------------------------------------------ hand-written forms


def rope_graph(*, table: bool, unsqueeze_axis: int = 1, interleaved_table: bool = False) -> onnx.ModelProto:
    """``Add(Mul(x, cos), Mul(rotate_half(x), sin))`` on x [B, 2, S, 8], cos/sin from inv_freq or from a folded
    table gathered by position_ids (older transformers' ``cos_cached[position_ids]``)."""
    rd, positions = 8, 64
    inv = (1.0 / 10000 ** (np.arange(0, rd, 2) / rd)).astype(np.float32)
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv[None, :]
    emb = np.concatenate([angles, angles], -1)
    if interleaved_table:
        emb = np.repeat(angles, 2, axis=-1)
    c = helper.make_tensor
    inits = [
        c("start0", TensorProto.INT64, [1], [0]),
        c("half", TensorProto.INT64, [1], [rd // 2]),
        c("end", TensorProto.INT64, [1], [2**63 - 1]),
        c("last", TensorProto.INT64, [1], [-1]),
        c("uaxis", TensorProto.INT64, [1], [unsqueeze_axis]),
        c("paxis", TensorProto.INT64, [1], [-1]),
    ]
    nodes = []
    if table:
        inits += [
            c("cos_cached", TensorProto.FLOAT, list(emb.shape), np.cos(emb).ravel()),
            c("sin_cached", TensorProto.FLOAT, list(emb.shape), np.sin(emb).ravel()),
        ]
        nodes += [
            helper.make_node("Gather", ["cos_cached", "position_ids"], ["cos3"]),
            helper.make_node("Gather", ["sin_cached", "position_ids"], ["sin3"]),
        ]
    else:
        inits.append(c("inv_freq", TensorProto.FLOAT, [rd // 2], inv))
        nodes += [
            helper.make_node("Unsqueeze", ["position_ids", "paxis"], ["p3"]),
            helper.make_node("Cast", ["p3"], ["pf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["pf", "inv_freq"], ["freqs"]),
            helper.make_node("Concat", ["freqs", "freqs"], ["emb"], axis=-1),
            helper.make_node("Cos", ["emb"], ["cos3"]),
            helper.make_node("Sin", ["emb"], ["sin3"]),
        ]
    nodes += [
        helper.make_node("Unsqueeze", ["cos3", "uaxis"], ["cos"]),
        helper.make_node("Unsqueeze", ["sin3", "uaxis"], ["sin"]),
        helper.make_node("Mul", ["x", "cos"], ["xc"]),
        helper.make_node("Slice", ["x", "start0", "half", "last"], ["x1"]),
        helper.make_node("Slice", ["x", "half", "end", "last"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["nx2"]),
        helper.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1),
        helper.make_node("Mul", ["rot", "sin"], ["rs"]),
        helper.make_node("Add", ["xc", "rs"], ["y"]),
    ]
    shape = ["B", 2, "S", rd] if unsqueeze_axis == 1 else ["B", "S", 2, rd]
    graph = helper.make_graph(
        nodes,
        "rope",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["B", "S"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def run_rope(model, batch=2, seq=5, start=50, heads_axis=1):
    rng = np.random.default_rng(0)
    shape = (batch, 2, seq, 8) if heads_axis == 1 else (batch, seq, 2, 8)
    x = rng.standard_normal(shape).astype(np.float32)
    positions = np.tile(np.arange(start, start + seq, dtype=np.int64), (batch, 1))
    sess = session(model) if isinstance(model, ir.Model) else ort.InferenceSession(model.SerializeToString())
    return sess.run(None, {"x": x, "position_ids": positions})[0]


@pytest.mark.parametrize("table", [False, True], ids=["inv_freq", "folded_table"])
def test_fuse_rotary_fuses_angles_and_folded_tables_when_hand_written(table):
    proto = rope_graph(table=table)
    model = ir.serde.deserialize_model(proto)
    result = FuseRotary()(model)
    assert result.counts["rotary_embeddings"] == 1
    assert [n.op_type for n in model.graph] == ["RotaryEmbedding"]  # table, angles and rotate_half all gone
    if table:
        assert result.notes["max_positions"] == {"table": 64}  # the folded table keeps its own rows
    for seq, start in ((5, 50), (1, 63), (9, 0)):
        np.testing.assert_allclose(run_rope(model, 2, seq, start), run_rope(proto, 2, seq, start), atol=1e-6)


@pytest.mark.parametrize("table", [False, True], ids=["inv_freq", "folded_table"])
def test_fuse_rotary_fuses_heads_last_rotation_flat_with_its_heads(table):
    """Gemma 3n rotates [B, S, N, D] (cos unsqueezed on axis 2): RotaryEmbedding on [B, S, N*D] with num_heads."""
    proto = rope_graph(table=table, unsqueeze_axis=2)
    model = ir.serde.deserialize_model(proto)
    result = FuseRotary()(model)
    assert result.counts["rotary_embeddings"] == 1
    (node,) = [n for n in model.graph if n.op_type == "RotaryEmbedding"]
    assert node.attributes.get_int("num_heads", 0) == 2
    assert not any(n.op_type in ("Cos", "Sin", "Neg") for n in model.graph)
    for seq, start in ((5, 50), (1, 63), (9, 0)):
        np.testing.assert_allclose(
            run_rope(model, 2, seq, start, heads_axis=2), run_rope(proto, 2, seq, start, heads_axis=2), atol=1e-6
        )


def test_fuse_rotary_declines_and_says_why_when_heads_last_heads_are_unknown():
    proto = rope_graph(table=False, unsqueeze_axis=2)
    for value in (*proto.graph.input, *proto.graph.output):  # heads symbolic, x a graph input: nothing says N
        if value.name in ("x", "y"):
            value.type.tensor_type.shape.dim[2].dim_param = "N"
    model = ir.serde.deserialize_model(proto)
    result = FuseRotary()(model)
    assert not result.modified
    assert len(list(model.graph)) == 15
    (reason,) = result.non_matches
    assert "heads of the [batch, sequence, heads, head_size] input" in reason.reason and reason.op_type == "Add"
    assert result.notes["decoder"]["rotary"] == "unmatched"


def test_fuse_rotary_declines_when_the_folded_table_is_interleaved():
    model = ir.serde.deserialize_model(rope_graph(table=True, interleaved_table=True))
    result = FuseRotary()(model)
    assert not result.modified
    assert "halves differ" in result.non_matches[0].reason


@pytest.mark.slow
def test_fuse_rotary_rotates_only_the_rotary_dims_when_phi3_has_partial_rotary_factor(tmp_path):
    """Phi-3 with ``partial_rotary_factor=0.5`` (rotary_dim 4 of head size 8), exported by TorchScript: the
    Slice/rotate/Concat becomes one RotaryEmbedding with ``rotary_embedding_dim`` over the whole head."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.models.build_decoders import Family, causal_lm, export, save, wrap

    family = Family(
        "phi3_partial",
        "Phi3Config",
        "Phi3ForCausalLM",
        extra=(("pad_token_id", 0), ("eos_token_id", 1), ("partial_rotary_factor", 0.5)),
    )
    path = tmp_path / "phi3_partial_past_ts.onnx"
    save(export(wrap(causal_lm(family), "past"), family, "past", "ts", path), path)
    model = ir.load(path)
    result = FuseRotary()(model)
    rotary = [n for n in model.graph if n.op_type == "RotaryEmbedding"]
    assert len(rotary) == result.counts["partial_rotary"] == 2 * family.layers
    assert {n.attributes["rotary_embedding_dim"].value for n in rotary} == {4}
    assert sorted(n.attributes["num_heads"].value for n in rotary) == [2, 2, 4, 4]  # k: kv heads, q: heads
    assert result.notes["decoder"]["rotary"]["partial_rotary_factor"] == 0.5
    assert op_histogram(model)["Neg"] == 0
    signature = Signature.of(path)
    reference, candidate = session(str(path)), session(model)
    for i, (batch, prompt, past) in enumerate(SHAPES):
        feeds = decoder_feeds(signature, batch, prompt, past, seed=i)
        for want, got in zip(reference.run(None, feeds), candidate.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["dynamo_llama", "ts_llama_eager", "ts_llama_sdpa"])
def test_fuse_rotary_gives_each_sequence_the_positions_when_the_model_computes_them_itself(name):
    """tests/models' Llama exports take no position_ids: the graph builds ``arange(S)`` ([1, S], or [S]
    unsqueezed on [0, 2] by dynamo) and broadcasts it over the batch; RotaryEmbedding wants [batch, S]."""
    from tests.models.build_torchscript import inputs

    path = OUT.parent / f"{name}.onnx"
    model = ir.load(path)
    result = FuseRotary()(model)
    assert result.counts["rotary_embeddings"] == 4 and result.non_matches == []
    assert op_histogram(model)["Sin"] == op_histogram(model)["Cos"] == 0
    reference, candidate = session(str(path)), session(model)
    for batch, seq in ((1, 5), (3, 37), (2, 64)):
        ids, mask = inputs(batch, seq, seed=seq)
        feeds = {"input_ids": ids, "attention_mask": mask}
        for want, got in zip(reference.run(None, feeds), candidate.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{name} at {batch}x{seq}")


def test_fuse_rotary_names_the_trigonometry_it_leaves_when_the_rotation_is_another_form():
    """No rotate_half (here x * cos(angle) alone, as an interleaved or otherwise unmatched rope would leave
    it): nothing changes and the report names the Cos, not silence."""
    nodes = [
        helper.make_node("Unsqueeze", ["position_ids", "paxis"], ["p3"]),
        helper.make_node("Cast", ["p3"], ["pf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["pf", "inv_freq"], ["angle"]),
        helper.make_node("Cos", ["angle"], ["c"], name="the_cos"),
        helper.make_node("Mul", ["x", "c"], ["y"]),
    ]
    inits = [
        helper.make_tensor("paxis", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("inv_freq", TensorProto.FLOAT, [4], [1.0, 0.1, 0.01, 0.001]),
    ]
    graph = helper.make_graph(
        nodes,
        "cos_only",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 4]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["B", "S"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", 4])],
        inits,
    )
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    result = FuseRotary()(model)
    assert not result.modified
    assert [(m.node, m.op_type) for m in result.non_matches] == [("the_cos", "Cos")]
    assert result.notes["decoder"]["rotary"] == "unmatched"
