"""fuse_gqa on the decoder corpus (tests/models/decoders: Llama, Qwen2, Phi-3, Mistral, GPT-2; TorchScript and
dynamo; with and without a KV cache; and the trained Llama): structure (one GroupQueryAttention per layer, no
Softmax left, the graph's present outputs produced by GQA under their own names, Mistral's window as
local_window_size) and numerics against the original under ORT with graph optimizations off, at prompt
lengths and cache lengths other than the export's (2 x 3 after 4): prefill on an empty cache, decode after
caches of 3 and 17, a prompt after a cache, a prompt past Mistral's window, and a greedy decode loop on the
fused model's own presents. The MultiHeadAttention fallback is checked on uploaded samples GQA cannot be
verified on (left-padded masks, a batch of prompts after a cache), where it must be exact everywhere, and
the pipeline's own generated sets (unpadded generation calls) are checked to leave GQA in place; an
encoder is left alone with its reason."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from core.inputs import generate_input_sets
from passes import registry
from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_gqa import FuseGqa
from tests.models.build_decoders import OUT, Signature, decoder_feeds, presents_as_past
from tests.numerics import reference_session, run_named
from tests.passes._util import MODELS

MANIFEST = json.loads((OUT / "manifest.json").read_text())
FILES = [e["file"].removesuffix(".onnx") for e in MANIFEST["files"] if "error" not in e]
# (batch, new tokens, past): none of them the export's (2, 3, 4)
PREFILL = ((2, 5, 0), (1, 11, 0), (1, 70, 0))  # 70 reaches past Mistral's window of 64
DECODE = ((2, 1, 3), (1, 1, 17), (1, 4, 9))
ATOL = 1e-4


# The reference (optimizations off) and a run by output name: tests/numerics, under the names the GQA tests use.
session, run = reference_session, run_named


def family(name: str) -> dict:
    return MANIFEST["families"][name.rsplit("_", 2)[0]]


@pytest.fixture(scope="module")
def fused():
    """Each corpus decoder and its fuse_gqa result (no samples: GroupQueryAttention wherever it fits)."""
    cache: dict[str, tuple[ir.Model, object]] = {}

    def get(name: str):
        if name not in cache:
            model = ir.load(OUT / f"{name}.onnx")
            cache[name] = (model, FuseGqa()(model, PassContext()))
        return cache[name]

    return get


@pytest.mark.parametrize("name", FILES)
def test_fuse_gqa_makes_one_groupqueryattention_per_layer_when_corpus_decoder(name, fused):
    # setup / execute
    model, result = fused(name)
    # assert
    layers = family(name)["layers"]
    ops = op_histogram(result.model)
    assert result.modified and result.model is model  # in place
    assert result.counts["fused_gqa"] == ops["com.microsoft::GroupQueryAttention"] == layers
    assert "Softmax" not in ops and not result.non_matches
    original = ir.load(OUT / f"{name}.onnx")
    assert [v.name for v in result.model.graph.inputs] == [v.name for v in original.graph.inputs]
    assert [v.name for v in result.model.graph.outputs] == [v.name for v in original.graph.outputs]
    spec = family(name)
    head_size = spec["hidden"] // spec["heads"]
    for node in (n for n in result.model.graph if n.op_type == "GroupQueryAttention"):
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert (attrs["num_heads"], attrs["kv_num_heads"]) == (spec["heads"], spec["kv_heads"])
        assert attrs["scale"] == pytest.approx(head_size**-0.5)
        assert attrs.get("local_window_size", -1) == (64 if name.startswith("mistral") else -1)
    for output in result.model.graph.outputs[1:]:  # the presents: GQA's own, through Mistral's cache Slice
        producer = output.producer()
        if producer.op_type == "Slice":
            producer = producer.inputs[0].producer()
        assert producer.op_type == "GroupQueryAttention", output.name


@pytest.mark.parametrize("name", FILES)
def test_fuse_gqa_matches_the_original_when_prefill_and_decode_at_other_lengths(name, fused):
    # setup
    _, result = fused(name)
    path = OUT / f"{name}.onnx"
    signature = Signature.of(path)
    reference, candidate = session(str(path)), session(result.model)
    shapes = PREFILL + (DECODE if signature.layers else ())
    for index, (batch, seq, past) in enumerate(shapes):
        feeds = decoder_feeds(signature, batch, seq, past, seed=index)
        # execute
        want, got = run(reference, feeds), run(candidate, feeds)
        # assert
        for key, expected in want.items():
            np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=f"{key} at {batch}x{seq}+{past}")


def test_fuse_gqa_decodes_greedily_like_the_original_when_fed_its_own_presents(fused):
    # setup: the trained Llama, a prompt of 6 then 5 greedy steps, each model on its own cache
    name = "trained_llama_past_ts"
    _, result = fused(name)
    signature = Signature.of(OUT / f"{name}.onnx")
    prompt = np.load(OUT / "trained_llama_heldout.npy")[:1, :6]
    tokens = {}
    for label, sess in (("original", session(str(OUT / f"{name}.onnx"))), ("fused", session(result.model))):
        # execute
        out = run(sess, decoder_feeds(signature, 1, 6, 0, tokens=prompt))
        steps, logits = [], [out["logits"][:, -1]]
        for pos in range(6, 11):
            token = logits[-1].argmax(-1)[:, None]
            steps.append(int(token[0, 0]))
            feeds = decoder_feeds(signature, 1, 1, pos, tokens=token, past_values=presents_as_past(out))
            out = run(sess, feeds)
            logits.append(out["logits"][:, -1])
        tokens[label] = (steps, np.stack(logits))
    # assert
    assert tokens["fused"][0] == tokens["original"][0]
    np.testing.assert_allclose(tokens["fused"][1], tokens["original"][1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama_past_ts", "qwen2_past_dynamo", "gpt2_past_ts", "gpt2_nopast_dynamo"])
def test_fuse_gqa_falls_back_to_multiheadattention_exactly_when_samples_are_padded(name):
    # setup: samples a user uploads: a left-padded batch of prompts (and, with a cache, a batch of prompts
    # after it, row 1 left-padded there too), which GroupQueryAttention cannot compute like the graph
    model = ir.load(OUT / f"{name}.onnx")
    signature = Signature.of(OUT / f"{name}.onnx")
    prompt = decoder_feeds(signature, 3, 7, 0, seed=1)
    prompt["attention_mask"][1, :3] = 0
    prompt["attention_mask"][2, :1] = 0
    sets = [prompt]
    if signature.layers:
        after = decoder_feeds(signature, 2, 4, 6, seed=2)
        after["attention_mask"][1, :2] = 0
        sets.append(after)
    reference = session(str(OUT / f"{name}.onnx"))
    # execute
    result = FuseGqa()(model, PassContext(samples=sets))
    # assert
    ops = op_histogram(result.model)
    assert ops["com.microsoft::MultiHeadAttention"] == result.counts["fused_mha"] == family(name)["layers"]
    assert "Softmax" not in ops and "com.microsoft::GroupQueryAttention" not in ops
    assert all("MultiHeadAttention" in m.reason and "padded" in m.reason for m in result.non_matches)
    candidate = session(result.model)
    for feeds in sets:
        want, got = run(reference, feeds), run(candidate, feeds)
        for key, expected in want.items():
            np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=key)


@pytest.mark.parametrize("name", ["llama_past_ts", "mistral_past_dynamo", "phi3_nopast_ts"])
def test_fuse_gqa_keeps_groupqueryattention_exact_when_samples_are_the_generated_decoder_sets(name):
    # setup: the pipeline's own sets for a decoder: a batch-1 prompt after a past, a batch-2 prefill on an
    # empty past, batch 4 decoding one token on a past of 32 (prefills only without a cache); all unpadded
    model = ir.load(OUT / f"{name}.onnx")
    sets = [s.feeds for s in generate_input_sets(model, 3)]
    assert not any((s["attention_mask"] == 0).any() for s in sets)
    reference = session(str(OUT / f"{name}.onnx"))
    # execute
    result = FuseGqa()(model, PassContext(samples=sets))
    # assert
    assert result.counts["fused_gqa"] == family(name)["layers"] and result.counts["fused_mha"] == 0
    candidate = session(result.model)
    for feeds in sets:
        want, got = run(reference, feeds), run(candidate, feeds)
        for key, expected in want.items():
            np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=key)


def test_fuse_gqa_leaves_the_window_to_multiheadattention_when_local_window_is_off():
    # setup
    model = ir.load(OUT / "mistral_past_dynamo.onnx")
    # execute
    result = FuseGqa({"local_window": False})(model)
    # assert
    assert result.counts["fused_mha"] == 2 and result.counts["fused_gqa"] == 0
    assert all("sliding window of 64 keys" in m.reason for m in result.non_matches)
    signature = Signature.of(OUT / "mistral_past_dynamo.onnx")
    feeds = decoder_feeds(signature, 1, 70, 0)
    want, got = run(session(str(OUT / "mistral_past_dynamo.onnx")), feeds), run(session(result.model), feeds)
    np.testing.assert_allclose(got["logits"], want["logits"], atol=ATOL, rtol=0)


def test_fuse_gqa_declines_every_layer_with_its_reason_when_attention_is_not_causal():
    # setup: a DistilBERT encoder: bidirectional attention under a padding mask, left to fuse_transformer
    model = ir.load(MODELS / "dynamo_distilbert.onnx")
    before = op_histogram(model)
    # execute
    result = FuseGqa()(model)
    # assert
    assert not result.modified and op_histogram(result.model) == before
    assert len(result.non_matches) == before["Softmax"]
    for layer, declined in enumerate(result.non_matches):
        assert declined.op_type == "Softmax"
        assert declined.reason.startswith(f"attention layer {layer} ")
        assert "not causal self-attention: mask probe: the mask is not causal plus key padding" in declined.reason


def test_fuse_gqa_names_the_blocking_pattern_when_a_layer_differs():
    # setup: layer 0's attention output passes an Identity before its head-merging Transpose
    model = ir.load(OUT / "llama_past_dynamo.onnx")
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    context = next(iter(softmax.outputs[0].uses())).node
    identity = ir.node("Identity", [context.outputs[0]], name="extra")
    model.graph.insert_after(context, identity)
    for use in list(context.outputs[0].uses()):
        if use.node is not identity:
            use.node.replace_input_with(use.idx, identity.outputs[0])
    # execute
    result = FuseGqa()(model)
    # assert
    assert result.counts["fused_gqa"] == 1
    (reason,) = [m.reason for m in result.non_matches]
    assert reason.startswith("attention layer 0") and "to feed one Transpose; found Identity" in reason
    assert "left-padded" in result.notes["padding"]


@pytest.mark.parametrize("name", ["llama_past_ts", "qwen2_past_dynamo", "mistral_past_ts", "gpt2_past_ts"])
def test_fuse_gqa_fuses_every_layer_when_run_after_the_fast_presets_earlier_passes(name):
    # setup: the passes `fast` runs before fuse_gqa (CSE leaves dead Identity copies on the probabilities)
    model = ir.load(OUT / f"{name}.onnx")
    specs = registry.PRESETS["fast"].specs
    for p in registry.build_passes(specs[: [s.name for s in specs].index("fuse_gqa")]):
        model = p(model, PassContext()).model
    # execute
    result = FuseGqa()(model, PassContext())
    # assert
    ops = op_histogram(result.model)
    assert ops["com.microsoft::GroupQueryAttention"] == family(name)["layers"] and "Softmax" not in ops
    signature = Signature.of(OUT / f"{name}.onnx")
    reference, candidate = session(str(OUT / f"{name}.onnx")), session(result.model)
    for index, (batch, seq, past) in enumerate(((2, 5, 0), (1, 1, 17))):
        feeds = decoder_feeds(signature, batch, seq, past, seed=index)
        want, got = run(reference, feeds), run(candidate, feeds)
        for key, expected in want.items():
            np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=key)
