"""Encoder-decoders as users upload them for generation (issue 19 item 1): the committed Whisper, T5 and BART
files in Optimum's seq2seq-with-past layout (tests/models/seq2seq, built by tests.models.build_seq2seq).

The files: unchanged since the build, Optimum's names, and their caches consistent in ONNX Runtime alone (a
greedy generation through encoder, decoder and decoder_with_past gives the logits of the cache-free decoder
on the whole sequence). The roles: read from the graph (encoder states, the fixed cross-attention cache, the
mask over the encoder's sequence), names being only a hint. The structure fuse_rotary reports: layers counted
once (a layer's cross attention is no layer of its own), self and cross caches and attention told apart by the
graph, whatever the names. The generated sets: one encoder length across
the states, the mask and the cross-attention cache; the self-attention cache empty in one set and longer in
a later one. The pipeline: a no-sample ``fast`` job on each file completes and stays exact, the artifacts
chained through generation included; one job through the HTTP API and the CLI. No torch."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx_ir.passes.common import ShapeInferencePass

from core.config import JobConfig
from core.inputs import InputSynthesis, analyze
from core.settings import PipelineSettings
from passes._infra import PassContext
from passes.fusion import _concat_shape as concat_shape
from passes.fusion import _fusion_families as fam
from passes.fusion import _layer_reasons as layer_reasons
from passes.fusion import fuse_transformer
from passes.fusion.fuse_rotary import FuseRotary
from passes.fusion.fuse_transformer import FuseTransformer
from tests.conftest import FAST_PIPELINE, ROOT, service_env
from tests.integration._flow import submit, wait
from tests.models.build_seq2seq import (
    ARCHS,
    EXPORTERS,
    KINDS,
    OUT,
    enc_dim,
    filename,
    folder,
    greedy_chain,
    input_names,
    output_names,
    seq2seq_feeds,
)
from tests.numerics import reference_session, run_named
from workers.pipeline import PipelineRequest, run_pipeline

MANIFEST = json.loads((OUT / "manifest.json").read_text())
ENTRIES = {e["file"]: e for e in MANIFEST["files"] if "error" not in e}
FILES = sorted(ENTRIES)
DECODERS = [f for f in FILES if ENTRIES[f]["kind"] != "encoder"]
CHAINS = sorted({(e["arch"], e["exporter"]) for e in ENTRIES.values()})
ATOL = 1e-4


def arch_kind(file: str) -> tuple[str, str]:
    return ENTRIES[file]["arch"], ENTRIES[file]["kind"]


def path_of(arch: str, exporter: str, kind: str) -> Path:
    return OUT / folder(arch, exporter) / filename(kind)


# ------------------------------------------------------------------------------------------------ files


def test_seq2seq_corpus_has_three_files_per_architecture_and_exporter_when_built():
    built = {(e["arch"], e["kind"], e["exporter"]) for e in ENTRIES.values()}
    assert built == {(a, k, x) for a in ARCHS for k in KINDS for x in EXPORTERS}
    assert sum((OUT / f).stat().st_size for f in FILES) < 4_000_000  # small enough to commit


@pytest.mark.parametrize("file", FILES)
def test_seq2seq_file_matches_manifest_and_optimum_signature_when_loaded(file):
    entry = ENTRIES[file]
    path = OUT / file
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
    arch, kind = ARCHS[entry["arch"]], entry["kind"]
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == input_names(arch, kind)
    assert [o.name for o in model.graph.output] == output_names(arch, kind)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    if kind == "decoder":
        assert dims["encoder_hidden_states"] == ["batch_size", enc_dim(arch), arch.hidden]
    if kind == "decoder_with_past":
        assert dims["past_key_values.0.decoder.key"] == ["batch_size", arch.heads, "past_decoder_sequence_length", 8]
        assert dims["past_key_values.1.encoder.value"][2] == "encoder_sequence_length_out"
        assert "encoder_hidden_states" not in dims  # as Optimum: the cross-attention cache replaces them


@pytest.mark.parametrize(("name", "exporter"), CHAINS)
def test_cache_chain_gives_the_cache_free_decoder_logits_when_generating_greedily(name, exporter):
    # setup: the three files of one architecture and exporter; an encoder batch of 2 (row 1 padded for T5/BART)
    arch = ARCHS[name]
    sessions = {kind: reference_session(path_of(name, exporter, kind)) for kind in KINDS}
    encoder_feeds = seq2seq_feeds(arch, "encoder", 2, enc=10, seed=3)
    # execute: encoder, decoder on the start token, then 5 decode steps on the returned caches
    tokens, logits = greedy_chain(arch, sessions, encoder_feeds)
    # assert: the cache-free decoder on the whole generated sequence gives every step's logits
    states = run_named(sessions["encoder"], encoder_feeds)["last_hidden_state"]
    feeds = {"input_ids": tokens, "encoder_hidden_states": states}
    if not arch.audio:
        feeds["encoder_attention_mask"] = encoder_feeds["attention_mask"]
    whole = run_named(sessions["decoder"], feeds)
    np.testing.assert_allclose(logits, whole["logits"], atol=1e-5, rtol=0)
    assert whole["present.0.encoder.key"].shape == (2, arch.heads, states.shape[1], arch.head_dim)


# ------------------------------------------------------------------------------------------------ roles


@pytest.mark.parametrize("file", DECODERS)
def test_roles_of_a_seq2seq_decoder_are_read_from_the_graph_when_analyzed(file):
    facts = analyze(onnx.load(str(OUT / file)))
    roles = {n: r.role for n, r in facts.roles.items()}
    assert facts.encoder_decoder and not facts.causal_lm
    assert roles["input_ids"] == "token_ids"
    for name, role in roles.items():
        if ".decoder." in name:
            assert role == "past_key_values", name
        elif ".encoder." in name:
            assert role == "cross_key_values", name
    if "encoder_hidden_states" in roles:
        assert roles["encoder_hidden_states"] == "encoder_states"
    if "encoder_attention_mask" in roles:
        assert facts.roles["encoder_attention_mask"].cross


def test_cross_attention_roles_follow_the_graph_not_the_names_when_inputs_are_renamed():
    # setup: BART's decoder_with_past with neutral input names (no "encoder", no "past", no "mask")
    model = onnx.load(str(path_of("bart", "ts", "decoder_with_past")))
    rename = {"encoder_attention_mask": "mask_b"}
    for i in range(2):
        for side, new in (("decoder", "cache_self"), ("encoder", "cache_other")):
            for kv in ("key", "value"):
                rename[f"past_key_values.{i}.{side}.{kv}"] = f"{new}.{i}.{kv}"
    for value in model.graph.input:
        value.name = rename.get(value.name, value.name)
    for node in model.graph.node:
        node.input[:] = [rename.get(n, n) for n in node.input]
    # execute
    facts = analyze(model)
    # assert: the self cache grows by Concat, the other is only read: cross; the mask reaches its scores
    assert facts.roles["cache_self.0.key"].role == "past_key_values"
    assert facts.roles["cache_other.1.value"].role == "cross_key_values"
    assert facts.roles["mask_b"].role == "attention_mask" and facts.roles["mask_b"].cross


def test_a_cache_concatenated_onto_an_empty_constant_is_still_read_as_is_when_analyzed():
    # setup: every cache input first joined onto an empty tensor, as transformers' DynamicCache traces
    model = onnx.load(str(path_of("t5", "ts", "decoder_with_past")))
    empty = onnx.numpy_helper.from_array(np.zeros((1, 4, 0, 8), dtype=np.float32), "empty_cache")
    model.graph.initializer.append(empty)
    joined = []
    for value in model.graph.input:
        if value.name.startswith("past_key_values."):
            joined.append(
                onnx.helper.make_node("Concat", ["empty_cache", value.name], [value.name + ".joined"], axis=2)
            )
            for node in model.graph.node:
                node.input[:] = [value.name + ".joined" if n == value.name else n for n in node.input]
    nodes = [*joined, *model.graph.node]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.checker.check_model(model)
    # execute
    roles = analyze(model).roles
    # assert: such a Concat is no growth; the cross cache is still the one the attention reads as it is
    assert roles["past_key_values.0.encoder.key"].role == "cross_key_values"
    assert roles["past_key_values.1.decoder.value"].role == "past_key_values"
    assert roles["encoder_attention_mask"].cross


@pytest.mark.parametrize(
    "path",
    [
        "decoders/llama_past_ts.onnx",
        "decoders/gpt2_past_dynamo.onnx",
        "roles_gpt2_past.onnx",
        "roles_bart_cls.onnx",
        "seq2seq/t5/encoder_model.onnx",
        "seq2seq/whisper/dynamo/encoder_model.onnx",
    ],
)
def test_models_without_cross_attention_get_no_cross_roles_when_analyzed(path):
    assert fam.count_cross_attention(ir.load(OUT.parent / path)) == 0
    facts = analyze(onnx.load(str(OUT.parent / path)))
    assert not facts.encoder_decoder
    assert not any(r.cross or r.role in ("encoder_states", "cross_key_values") for r in facts.roles.values())


# ------------------------------------------------------------------------------------------------ structure


def _structure(model: onnx.ModelProto | Path) -> dict:
    """The structure fuse_rotary reports (``notes["decoder"]``, ``_decoder_structure.detect``)."""
    loaded = ir.load(model) if isinstance(model, Path) else ir.serde.deserialize_model(model)
    return FuseRotary()(loaded).notes["decoder"]


@pytest.mark.parametrize("file", FILES)
def test_structure_counts_layers_once_and_splits_self_from_cross_caches_when_read_from_the_graph(file):
    # setup
    arch, kind = ARCHS[ENTRIES[file]["arch"]], ENTRIES[file]["kind"]
    # execute
    found = _structure(OUT / file)
    # assert: a layer's cross attention is not another layer; every field the graph fixes is there
    assert {k: found[k] for k in ("layers", "heads", "kv_heads", "head_size", "hidden")} == {
        "layers": arch.layers,
        "heads": arch.heads,
        "kv_heads": arch.heads,
        "head_size": arch.head_dim,
        "hidden": arch.hidden,
    }
    assert found["vocab"] == (None if arch.audio and kind == "encoder" else arch.vocab)  # no LM head, no table
    assert found["rotary"] == "no rotary"
    assert found["norm"] == ("rms" if arch.name == "t5" else "layernorm")
    # the learned table indexed from the past length on (BART's from row 2); T5's buckets are relative
    learned = arch.name == "bart" or (arch.audio and kind != "encoder")
    assert found["max_positions"] == (arch.positions if learned else None)
    if kind == "encoder":
        assert found["attention"] == {"self": arch.layers, "cross": 0}
        assert found["cache"] is None
        return
    assert found["attention"] == {"self": arch.layers, "cross": arch.layers}
    prefix = "present" if kind == "decoder" else "past_key_values"
    layout = {"layout": "BNSH", "kv_heads": arch.heads, "head_size": arch.head_dim}
    assert found["cache"] == {
        **layout,
        "names": f"{prefix}.{{layer}}.decoder.{{key|value}}",
        "cross": {**layout, "names": f"{prefix}.{{layer}}.encoder.{{key|value}}"},
    }


@pytest.mark.parametrize("kind", ["decoder", "decoder_with_past"])
def test_structure_reads_self_and_cross_caches_from_the_graph_when_names_say_nothing(kind):
    # setup: T5's decoder with every cache renamed to neutral names, the cross caches listed first
    model = onnx.load(str(path_of("t5", "ts", kind)))
    rename = {}
    for i in range(ARCHS["t5"].layers):
        for side, new in (("decoder", "mem_a"), ("encoder", "mem_b")):
            for kv in ("key", "value"):
                rename[f"past_key_values.{i}.{side}.{kv}"] = f"cache_{new}.{i}.{kv}"  # analyze: a cache by name
                rename[f"present.{i}.{side}.{kv}"] = f"out_{new}.{i}.{kv}"
    for value in [*model.graph.input, *model.graph.output]:
        value.name = rename.get(value.name, value.name)
    for node in model.graph.node:
        node.input[:] = [rename.get(n, n) for n in node.input]
        node.output[:] = [rename.get(n, n) for n in node.output]
    outputs = sorted(model.graph.output, key=lambda o: "mem_a" in o.name)  # cross first
    del model.graph.output[:]
    model.graph.output.extend(outputs)
    onnx.checker.check_model(model)
    # execute
    found = _structure(model)
    # assert: self caches are those the decoder's own tokens reach (or that grow), whatever their names
    layers = ARCHS["t5"].layers
    stem = "out" if kind == "decoder" else "cache"
    assert found["layers"] == layers and found["attention"] == {"self": layers, "cross": layers}
    assert found["cache"]["names"] == f"{stem}_mem_a.{{layer}}.{{key|value}}"
    assert found["cache"]["cross"]["names"] == f"{stem}_mem_b.{{layer}}.{{key|value}}"


@pytest.mark.parametrize(("name", "exporter"), [("t5", "ts"), ("whisper", "dynamo")])
def test_unfused_attention_is_named_self_or_cross_with_its_decoder_layer_when_seq2seq(name, exporter):
    # setup: a decoder_with_past as uploaded, every attention unfused
    model = ir.load(path_of(name, exporter, "decoder_with_past"))
    # execute
    reasons = layer_reasons.layer_reasons(model, model, "t5", {"attention"})
    # assert: per decoder layer a self and a cross attention, numbered as the decoder's layers, in graph order
    heads = [r.reason.split(" (")[0] for r in reasons]
    layers = range(ARCHS[name].layers)
    assert heads == [f"attention: {kind}-attention layer {i}" for i in layers for kind in ("self", "cross")]


def test_t5_torchscript_decoder_with_past_fuses_every_attention_with_its_cache_when_fast():
    """TorchScript's T5 reads layer 0's key length off the grown cache, ``Shape(Concat(past, key))``, for the
    position bias; the with-past MHA rule took that Concat into the attention, the Shape then read the
    attention's own output (a cycle), onnxscript's candidate was refused and nothing fused (_concat_shape)."""
    # setup: the decoder as uploaded, its generated sets (an empty self cache among them) as the samples
    path = path_of("t5", "ts", "decoder_with_past")
    samples = [s.feeds for s in InputSynthesis(onnx.load(str(path))).generate(3)]
    # execute
    result = FuseTransformer()(ir.load(path), PassContext(samples=samples))
    # assert: the onnxscript candidate verified; every self attention reads and writes its cache itself
    arch = ARCHS["t5"]
    assert result.notes["chosen"] == "onnxscript", result.notes["candidates"]["onnxscript"].get("error")
    assert result.counts["fused_attention"] == 2 * arch.layers
    assert result.counts["fused_skip_layer_norm"] == 3 * arch.layers
    assert result.notes["family"] == "t5" and result.notes["missing"] == {}  # all that a T5 decoder can fuse
    attentions = [n for n in result.model.graph if n.op_type == "MultiHeadAttention"]
    presents = {o.name for n in attentions for o in n.outputs[1:] if o is not None}
    assert presents == {f"present.{i}.decoder.{kv}" for i in range(arch.layers) for kv in ("key", "value")}
    assert not any(n.op_type == "Concat" and n.outputs[0].shape and len(n.outputs[0].shape) == 4 for n in
                   result.model.graph)  # fmt: skip
    # exact at shapes the samples never had: empty and longer pasts, several new tokens, another batch
    want, got = reference_session(path), reference_session(result.model)
    for batch, dec, past in ((1, 1, 0), (3, 2, 5), (2, 1, 17)):
        feeds = seq2seq_feeds(arch, "decoder_with_past", batch, dec=dec, past=past, enc=10, seed=past)
        expected, actual = run_named(want, feeds), run_named(got, feeds)
        for key, value in expected.items():
            np.testing.assert_allclose(actual[key], value, atol=ATOL, rtol=0, err_msg=f"past {past}: {key}")


def test_layers_a_refused_candidate_fused_say_why_it_was_refused_when_nothing_applied(monkeypatch):
    """Without _concat_shape the T5 decoder's onnxscript candidate is refused (the cycle above); with ORT's
    candidate refused too, nothing is applied: each attention the onnxscript candidate fused says so, with
    the error, instead of a rule's trace of another graph."""
    # setup: the rewrite off, so that the candidate is refused as it was; ORT's candidate refused as well (it
    # fused only norms here, and applied them once the RMS decomposition stopped writing untyped Tensor(None)
    # values); no cached result of another test

    def refused(*args, **kwargs):
        raise RuntimeError("ORT's candidate refused by the test")

    monkeypatch.setattr(concat_shape, "split_concat_shapes", lambda model: 0)
    monkeypatch.setattr(fuse_transformer, "_ort", refused)
    monkeypatch.setattr(fuse_transformer, "_LAST", {})
    path = path_of("t5", "ts", "decoder_with_past")
    samples = [s.feeds for s in InputSynthesis(onnx.load(str(path))).generate(3)]
    # execute
    result = FuseTransformer()(ir.load(path), PassContext(samples=samples))
    # assert: not applied; per decoder layer a self and a cross attention, each fused there and refused
    assert not result.modified
    error = result.notes["candidates"]["onnxscript"]["error"]
    assert "topologically sorted" in error
    attention = [m.reason for m in result.non_matches if m.reason.startswith("attention: ") and m.node]
    layers = range(ARCHS["t5"].layers)
    heads = [f"attention: {kind}-attention layer {i} (t5" for i in layers for kind in ("self", "cross")]
    assert [r[: len(h)] for r, h in zip(attention, heads, strict=True)] == heads
    assert all("fused by the onnxscript candidate, which was not applied" in r for r in attention)
    assert all(" ".join(error.split()) in r and "candidate ort" not in r for r in attention)


@pytest.mark.parametrize("file", FILES)
def test_expected_fusions_count_a_layer_once_and_its_cross_attention_apart_when_seq2seq(file):
    """A decoder layer holds a self and a cross attention: counted as two layers, its decoder was expected
    to reach 2 residual norms and a GELU per attention (8 and 4 here, where a full fusion gives 6 or 7 and 2)
    and T5's was labelled a llama. Encoders keep their family and counts."""
    # setup
    arch, kind = ARCHS[ENTRIES[file]["arch"]], ENTRIES[file]["kind"]
    model = ir.load(OUT / file)
    ShapeInferencePass()(model)
    # execute
    family, evidence = fam.detect_family(model)
    attention, cross = fam.count_layers(model), fam.count_cross_attention(model)
    expected = fam.expected_fusions(family, attention, cross)
    # assert
    n = arch.layers
    if kind == "encoder":
        assert (family, cross) == ("whisper" if arch.audio else arch.name, 0), evidence
        assert expected == fam.expected_fusions(family, attention)
        return
    assert family == ("t5" if arch.name == "t5" else "bart"), evidence
    assert "encoder-decoder's decoder" in evidence and (attention, cross) == (2 * n, n)
    if arch.name == "t5":  # pre-RMS-norm, no positions: every norm but the first follows a residual Add
        assert expected == {"attention": 2 * n, "skip_layer_norm": 3 * n}
    else:  # three norms per layer and the embedding sum's (post-norm BART) or the final one (pre-norm Whisper)
        assert expected == {"attention": 2 * n, "skip_layer_norm": 3 * n + 1, "gelu": n}


# ---------------------------------------------------------------------------------------- generated sets


@pytest.mark.parametrize("file", DECODERS)
def test_generated_sets_share_one_encoder_length_and_grow_the_self_cache_when_synthesized(file):
    # setup
    arch, kind = arch_kind(file)
    path = OUT / file
    synthesis = InputSynthesis(onnx.load(str(path)))
    sess = reference_session(path)
    # execute
    sets = synthesis.generate(3)
    # assert: every set runs on the original; its encoder-side inputs agree on one nonzero length
    pasts = []
    for input_set in sets:
        feeds = input_set.feeds
        out = run_named(sess, feeds)
        assert input_set.provenance["why"].startswith("seq2seq decoder")  # the report says why
        lengths = set()
        if "encoder_hidden_states" in feeds:
            lengths.add(feeds["encoder_hidden_states"].shape[1])
            assert feeds["encoder_hidden_states"].shape[2] == ARCHS[arch].hidden  # from the graph
        if "encoder_attention_mask" in feeds:
            mask = feeds["encoder_attention_mask"]
            lengths.add(mask.shape[1])
            assert (mask[:, 0] == 1).all() and (np.diff(mask, axis=1) <= 0).all()  # right-padded, never empty
        cross = [v.shape[2] for n, v in feeds.items() if ".encoder." in n]
        lengths.update(cross)
        assert len(lengths) == 1 and min(lengths) > 0, (input_set.name, lengths)
        if kind == "decoder_with_past":
            past = feeds["past_key_values.0.decoder.key"].shape[2]
            new = feeds["input_ids"].shape[1]
            assert out["present.1.decoder.value"].shape[2] == past + new
            pasts.append((past, new, feeds["input_ids"].shape[0]))
    if kind == "decoder_with_past":
        assert pasts[1][0] == 0  # a prefill on an empty self-attention cache
        assert pasts[2][0] > pasts[0][0] > 0  # then longer pasts
        assert pasts[2][1] == 1 and pasts[2][2] > 1  # a batch decoding one token per row, as generation does
        assert len({s.name for s in sets}) == 3


@pytest.mark.parametrize("file", ["t5/decoder_with_past_model.onnx", "whisper/decoder_model.onnx"])
def test_sizes_bound_by_a_caller_tie_every_encoder_side_input_when_fed_for_sizes(file):
    synthesis = InputSynthesis(onnx.load(str(OUT / file)))
    free = synthesis.free_dims()
    encoder_dims = [d for d in free if "encoder" in d]
    assert len(encoder_dims) == 1, free  # one free encoder length; the others follow it
    feeds = synthesis.feeds_for_sizes({encoder_dims[0]: 5, "batch_size": 3}, np.random.default_rng(0))
    lengths = {v.shape[1] for n, v in feeds.items() if n.startswith("encoder_")}
    lengths |= {v.shape[2] for n, v in feeds.items() if ".encoder." in n}
    assert lengths == {5}
    run_named(reference_session(OUT / file), feeds)


# -------------------------------------------------------------------------------------------- pipeline


def quick_job(source: Path, out: Path, preset: str = "fast") -> tuple[Path, dict]:
    """A no-sample job of ``preset`` on ``source`` with quick pipeline settings: (artifact, report)."""
    settings = PipelineSettings(
        verify_shape_sets=3, benchmark_warmup=1, benchmark_min_runs=5, benchmark_max_seconds=0.1, ledger_runs=5,
        intra_op_threads=1,
    )  # fmt: skip
    # rollback_slower off: which passes pay is a timing question; these tests ask what the ledger verified
    config = JobConfig(preset=preset, rollback_slower=False, benchmark=False)
    result = run_pipeline(PipelineRequest(source, out, config, settings))
    return result.model_path, result.report


@pytest.mark.slow
@pytest.mark.parametrize(("name", "exporter"), CHAINS)
def test_fast_jobs_without_samples_stay_exact_through_generation_when_seq2seq(name, exporter, tmp_path):
    # setup / execute: one no-sample fast job per file of the architecture and exporter
    arch = ARCHS[name]
    artifacts = {}
    for kind in KINDS:
        artifact, report = quick_job(path_of(name, exporter, kind), tmp_path / kind)
        assert report["verification"]["ok"] is True, (kind, report["verification"])
        assert all(s["inputs"]["source"] == "generated" for s in report["input_sets"])
        if kind != "encoder":
            assert all("seq2seq decoder" in s["inputs"]["why"] for s in report["input_sets"])
        fused = next(p for p in report["passes"] if p["name"] == "fuse_transformer")
        assert fused["status"] == "applied", (kind, fused)
        artifacts[kind] = artifact
        # the fused artifact (MultiHeadAttention reading the caches) keeps the roles the upload had
        roles = {n: (r.role, r.cross) for n, r in analyze(onnx.load(str(artifact))).roles.items()}
        assert roles == {
            n: (r.role, r.cross) for n, r in analyze(onnx.load(str(path_of(name, exporter, kind)))).roles.items()
        }
        # exact at shapes the job never generated
        feeds = seq2seq_feeds(arch, kind, 3, dec=2, past=5, enc=10, seed=9)
        want, got = (
            run_named(reference_session(path_of(name, exporter, kind)), feeds),
            run_named(reference_session(artifact), feeds),
        )
        assert want.keys() == got.keys()
        for key, expected in want.items():
            np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=f"{kind}: {key}")
    # assert: greedy generation through the three artifacts is generation through the three uploads
    encoder_feeds = seq2seq_feeds(arch, "encoder", 2, enc=10, seed=4)
    tokens, logits = greedy_chain(
        arch, {k: reference_session(path_of(name, exporter, k)) for k in KINDS}, encoder_feeds
    )
    got_tokens, got_logits = greedy_chain(arch, {k: reference_session(p) for k, p in artifacts.items()}, encoder_feeds)
    np.testing.assert_array_equal(got_tokens, tokens)
    np.testing.assert_allclose(got_logits, logits, atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.integration
def test_whisper_decoder_with_past_goes_through_the_http_api_and_the_cli_when_no_samples(services, tmp_path):
    # setup: the embedded service (SQLite, filesystem queue, its own workers)
    source = path_of("whisper", "ts", "decoder_with_past")
    config = {"preset": "fast", "rollback_slower": False}
    env = service_env(tmp_path / "data", **FAST_PIPELINE)
    api = services.serve(env, embedded=True)
    # execute
    job = wait(api.url, submit(api.url, source, config)["id"], timeout=240)
    # assert: succeeded and verified on generated sets that tie the encoder length and grow the self cache
    assert job["state"] == "succeeded", job.get("error")
    report = httpx.get(f"{api.url}/v1/jobs/{job['id']}/report", timeout=30).raise_for_status().json()
    assert report["verification"]["ok"] is True
    shapes = [s["shapes"] for s in report["input_sets"]]
    assert all(s["past_key_values.0.encoder.key"][2] > 0 for s in shapes)
    assert any(s["past_key_values.0.decoder.key"][2] == 0 for s in shapes)
    artifact = tmp_path / "api.onnx"
    artifact.write_bytes(httpx.get(f"{api.url}/v1/jobs/{job['id']}/artifact", timeout=60).content)
    arch = ARCHS["whisper"]
    feeds = seq2seq_feeds(arch, "decoder_with_past", 2, dec=1, past=6, enc=arch.frames // 2, seed=12)
    want, got = run_named(reference_session(source), feeds), run_named(reference_session(artifact), feeds)
    for key, expected in want.items():
        np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=key)
    # and the CLI on the same file and config completes, exact too
    (tmp_path / "config.json").write_text(json.dumps(config))
    local = tmp_path / "cli.onnx"
    argv = ["optimize", str(source), "-o", str(local), "--config", str(tmp_path / "config.json")]
    result = subprocess.run(
        [sys.executable, "-m", "onnxforge.cli", *argv],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    got = run_named(reference_session(local), feeds)
    for key, expected in want.items():
        np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=f"cli {key}")
