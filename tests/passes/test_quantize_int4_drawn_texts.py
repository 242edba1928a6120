"""The next-token check of a job sent without samples: sequences drawn from the original model, not random ids.

The engine's generated inputs hold uniform random token ids. On them the trained test decoder
(``tests/models/decoders/trained_llama_past_ts.onnx``, a byte-level Llama) flipped 3 of 44 greedy tokens with
every MatMul 8-bit, so an ``int4`` job without samples was refused. ``_accuracy.sample_texts`` draws each
position from the model's own next-token distribution instead (seeded), and the job's int4 now keeps a mix
whose greedy tokens hold on those sequences."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.inputs import analyze
from passes.precision import _accuracy
from tests.models.build_decoders import OUT, Signature, decoder_feeds
from tests.models.build_heldout_mrope import mrope_feeds
from tests.passes.test_quantize_int4 import session
from tests.test_seq2seq import quick_job

TRAINED = OUT / "trained_llama_past_ts.onnx"


def perplexity(path, feeds):
    """The model's perplexity on the feeds' own next tokens (graph optimizations off)."""
    sess = session(path)
    nll, count = 0.0, 0
    for feed in feeds:
        logits = sess.run(["logits"], feed)[0].astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        ids = feed["input_ids"]
        nll -= float(np.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1).sum())
        count += ids[:, 1:].size
    return float(np.exp(nll / count))


def random_samples(shapes=((2, 16, 0), (1, 60, 0), (4, 1, 8)), seed=0):
    signature = Signature.of(TRAINED)
    return [decoder_feeds(signature, b, s, p, seed=seed + i) for i, (b, s, p) in enumerate(shapes)]


def test_sample_texts_draws_sequences_the_trained_decoder_finds_plausible_at_the_samples_batch_sizes():
    # setup: random ids at a prefill of 16, one of 60 and a decode step of one token after a past of 8
    samples = random_samples()
    roles = analyze(onnx.load(str(TRAINED))).roles
    # execute
    texts = _accuracy.sample_texts(TRAINED, "logits", samples, 8, roles)
    again = _accuracy.sample_texts(TRAINED, "logits", samples, 8, roles)
    # assert: one prefill (empty past) of TEXT_TOKENS per sample, its first token kept, the rest drawn; the
    # same for the same seed
    length = _accuracy.TEXT_TOKENS
    assert [f["input_ids"].shape for f in texts.feeds] == [(2, length), (1, length), (4, length)]
    for feed, sample in zip(texts.feeds, samples, strict=True):
        assert feed["past_key_values.0.key"].shape[2] == 0
        assert feed["attention_mask"].shape == feed["position_ids"].shape == feed["input_ids"].shape
        np.testing.assert_array_equal(feed["position_ids"][0], np.arange(length))
        np.testing.assert_array_equal(feed["input_ids"][:, 0], sample["input_ids"][:, 0])
    for a, b in zip(texts.feeds, again.feeds, strict=True):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    assert texts.how == f"3 sequence(s), {7 * length} token(s) drawn from the original model (seed 0)"
    # the model's own text: far more likely to it than the random ids were
    as_prefills = [_accuracy.prefill(session(TRAINED), s, roles) for s in samples[:2]]
    assert perplexity(TRAINED, texts.feeds) < 0.1 * perplexity(TRAINED, as_prefills)


def test_sample_texts_keeps_the_samples_lengths_when_the_position_table_refuses_the_drawn_length():
    # setup: GPT-2's learned position table has 128 rows (tests/models/build_decoders.py); 200 tokens asked
    path = OUT / "gpt2_past_ts.onnx"
    signature = Signature.of(path)
    samples = [decoder_feeds(signature, 2, 12, 0, seed=1)]
    roles = analyze(onnx.load(str(path))).roles
    # execute
    texts = _accuracy.sample_texts(path, "logits", samples, 8, roles, length=200)
    # assert
    assert [f["input_ids"].shape for f in texts.feeds] == [(2, 12)]
    assert texts.how == "1 sequence(s), 24 token(s) drawn from the original model (seed 0)"


def bidirectional_lm(vocab=32, hidden=16, seed=0):
    """Each position's logits read the mean over the whole sequence: a masked LM's dependence on later tokens."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["h"]),
        helper.make_node("ReduceMean", ["h", "axis"], ["context"], keepdims=1),
        helper.make_node("Add", ["h", "context"], ["mixed"]),
        helper.make_node("MatMul", ["mixed", "head"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "bidirectional",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", vocab])],
        [
            numpy_helper.from_array(rng.standard_normal((vocab, hidden)).astype(np.float32), "table"),
            numpy_helper.from_array(rng.standard_normal((hidden, vocab)).astype(np.float32), "head"),
            numpy_helper.from_array(np.array([1], np.int64), "axis"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_sample_texts_draws_nothing_when_a_position_reads_later_tokens(tmp_path):
    # setup
    path = tmp_path / "bidirectional.onnx"
    onnx.save(bidirectional_lm(), str(path))
    samples = [{"input_ids": np.arange(12, dtype=np.int64).reshape(2, 6)}]
    # execute
    texts = _accuracy.sample_texts(path, "logits", samples, 8, {})
    # assert
    assert texts.feeds == []
    assert texts.how == "not a causal language model: a position's logits depend on later tokens"


@pytest.fixture(scope="module")
def trained_int4_job(tmp_path_factory):
    # rollback_slower off (quick_job): int4 of a 90k-weight decoder is a timing question; this asks what was verified
    _, report = quick_job(TRAINED, tmp_path_factory.mktemp("job") / "out", preset="int4")
    return next(p for p in report["passes"] if p["name"] == "quantize_int4")


def test_int4_job_without_samples_judges_the_greedy_tokens_on_drawn_sequences_and_keeps_a_mix(trained_int4_job):
    # assert: the sequences are the drawn ones, the budget held on them, and the ledger verified the mix
    entry = trained_int4_job
    notes = entry["notes"]
    assert "drawn from the original model" in notes["next_token"]["sequences"]
    assert notes["next_token_texts"].endswith("drawn from the original model (seed 0)")
    assert entry["status"] == "applied", entry["reason"]
    figures = notes["accuracy"]["logits (teacher forcing)"]
    assert figures["top1_agreement"] >= 0.99 and figures["positions"] >= 32
    assert notes["int4_share"]["weights"].get("int4", 0) > 0


def test_sample_texts_resizes_positions_with_one_row_per_rope_section():
    # setup: a multimodal-rope language model (Qwen3-VL's, position_ids [3, batch, sequence])
    path = OUT.parent / "heldout" / "qwen3vl_text_ts.onnx"
    samples = [mrope_feeds(2, 9, seed=1, grid=True)]
    roles = analyze(onnx.load(str(path))).roles
    # execute
    texts = _accuracy.sample_texts(path, "logits", samples, 8, roles)
    # assert: drawn at TEXT_TOKENS, each section's row the text positions 0..47
    length = _accuracy.TEXT_TOKENS
    (feed,) = texts.feeds
    assert feed["input_ids"].shape == feed["attention_mask"].shape == (2, length)
    assert feed["position_ids"].shape == (3, 2, length)
    assert (feed["position_ids"] == np.arange(length)).all()


def test_a_decoder_with_a_cache_is_drawn_one_decode_step_per_token_as_its_prefills_would_draw_it():
    # setup: the trained decoder's prefills, drawn both ways from one seed
    samples = random_samples()
    roles = analyze(onnx.load(str(TRAINED))).roles
    sess = session(TRAINED)
    prefill = _accuracy._resized(_accuracy.prefill(sess, samples[0], roles), "input_ids", 24, roles)
    pasts = [n for n in prefill if n.startswith("past_key_values")]
    pairs = {p: p.replace("past_key_values", "present") for p in pasts}
    # execute
    stepped = _accuracy._drawn_on_cache(
        sess, "logits", prefill, "input_ids", roles=roles, pairs=pairs, rng=np.random.default_rng(3), until=math.inf
    )
    whole = _accuracy._drawn_by_prefills(sess, "logits", prefill, "input_ids", np.random.default_rng(3), until=math.inf)
    # assert: the same tokens (each position's distribution is the same function of the tokens before it)
    assert stepped is not None
    np.testing.assert_array_equal(stepped, whole)


@pytest.mark.parametrize("cached", [True, False])
def test_sample_texts_cuts_every_sequence_to_what_it_drew_when_the_drawing_budget_runs_out(cached):
    # setup: the trained decoder (a cache) or its prefills with the cache inputs withheld from the pairing
    samples = random_samples()
    roles = analyze(onnx.load(str(TRAINED))).roles
    if not cached:
        roles = {n: r for n, r in roles.items() if r.role != "past_key_values"}
    # execute: no time at all: the first sequence gets its first drawn token, the rest none
    texts = _accuracy.sample_texts(TRAINED, "logits", samples, 8, roles, seconds=0.0)
    # assert
    (feed,) = texts.feeds
    assert feed["input_ids"].shape == feed["attention_mask"].shape == feed["position_ids"].shape == (2, 2)
    assert (
        texts.how == "1 sequence(s), 4 token(s) drawn from the original model (seed 0); cut at the 0 s drawing budget"
    )
