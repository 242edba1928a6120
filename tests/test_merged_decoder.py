"""Optimum's merged decoders (issue 19 item 1): ``decoder_model_merged.onnx``, one ``If`` on ``use_cache_branch``
whose then-branch is decoder_with_past and else-branch the decoder, the weights shared from the outer graph
(tests/models/seq2seq/<arch>[/dynamo]/, merged by tests.models.build_seq2seq as Optimum's ``merge_decoders``).

The files: Optimum's layout (one If, every input of both decoders plus the flag, the weights once in the outer
graph), each branch giving its separate file's outputs. The roles: the flag read from the graph (the If's
condition, the branch reading the cache), whatever its name; the rest as in the separate files, read through
the branches. The generated sets: both branches, the no-cache one on dummy caches as Optimum's runtime feeds
it, the cache one on a growing cache, each set saying which branch it runs. The pipeline: a no-sample
``fast`` job per exporter succeeds, fused inside both branches, verified exactly on both. No torch."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from core.inputs import InputSynthesis, analyze
from tests.models.build_seq2seq import (
    ARCHS,
    MERGED,
    NO_CACHE_PAST,
    OUT,
    USE_CACHE,
    folder,
    merge_decoders,
    merged_feeds,
    merged_input_names,
    output_names,
    verify_merged,
)
from tests.numerics import reference_session, run_named
from tests.test_seq2seq import quick_job

MANIFEST = json.loads((OUT / "manifest.json").read_text())
MERGED_ENTRIES = {e["file"]: e for e in MANIFEST.get("merged", [])}
BUILT = sorted((e["arch"], e["exporter"]) for e in MERGED_ENTRIES.values())
ATOL = 1e-4


def merged_path(arch: str, exporter: str) -> Path:
    return OUT / folder(arch, exporter) / MERGED


# ------------------------------------------------------------------------------------------------ files


def test_merged_decoder_exists_for_every_architecture_and_exporter_when_built():
    assert set(BUILT) == {(a, x) for a in ARCHS for x in ("ts", "dynamo")}
    assert sum(e["bytes"] for e in MERGED_ENTRIES.values()) < 2_500_000  # small enough to commit


@pytest.mark.parametrize(("arch", "exporter"), BUILT)
def test_merged_decoder_has_optimums_layout_when_loaded(arch, exporter):
    # setup
    path = merged_path(arch, exporter)
    entry = MERGED_ENTRIES[f"{folder(arch, exporter)}/{MERGED}"]
    # execute
    model = onnx.load(str(path))
    # assert: unchanged since the build; one If on the flag; every input of both decoders; the weights outside
    assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    (node,) = model.graph.node
    assert node.op_type == "If" and list(node.input) == [USE_CACHE]
    branches = {a.name: a.g for a in node.attribute}
    assert {g.name for g in branches.values()} == {"with_past", "no_past"}
    assert branches["then_branch"].name == "with_past"
    assert [i.name for i in model.graph.input] == merged_input_names(ARCHS[arch])
    assert [o.name for o in model.graph.output] == output_names(ARCHS[arch], "decoder")
    flag = model.graph.input[-1]
    assert flag.type.tensor_type.elem_type == onnx.TensorProto.BOOL
    assert [d.dim_value for d in flag.type.tensor_type.shape.dim] == [1]
    assert model.graph.initializer and all("_merged_" in i.name for i in model.graph.initializer)
    for graph in branches.values():  # only scalars and 1-D ints stay in a branch
        assert all(len(t.dims) == 0 or (len(t.dims) == 1 and t.data_type in (6, 7)) for t in graph.initializer)


@pytest.mark.parametrize(("arch", "exporter"), BUILT)
def test_each_branch_gives_its_separate_files_outputs_when_run(arch, exporter):
    assert verify_merged(ARCHS[arch], OUT / folder(arch, exporter)) <= ATOL


def test_merging_shares_each_weight_once_when_both_decoders_hold_it():
    # setup: the separate files hold the decoder's weights twice
    where = OUT / folder("bart", "ts")
    decoder = onnx.load(str(where / "decoder_model.onnx"))
    with_past = onnx.load(str(where / "decoder_with_past_model.onnx"))
    # execute
    merged = merge_decoders(decoder, with_past)
    # assert: the outer graph holds no two equal weights, and the inputs were not changed
    digests = [(t.data_type, tuple(t.dims), onnx.numpy_helper.to_array(t).tobytes()) for t in merged.graph.initializer]
    assert len(digests) == len(set(digests))
    alone = {(t.data_type, tuple(t.dims), onnx.numpy_helper.to_array(t).tobytes())
             for m in (decoder, with_past) for t in m.graph.initializer if len(t.dims) > 1}  # fmt: skip
    assert alone <= set(digests)  # every weight of either file is there
    assert len(with_past.graph.initializer) > 0 and len(decoder.graph.initializer) > 0


# ------------------------------------------------------------------------------------------------ roles


@pytest.mark.parametrize(("arch", "exporter"), BUILT)
def test_roles_of_a_merged_decoder_are_read_through_its_branches_when_analyzed(arch, exporter):
    # setup
    separate = {}
    for kind in ("decoder", "decoder_with_past"):
        separate.update(analyze(onnx.load(str(OUT / folder(arch, exporter) / f"{kind}_model.onnx"))).roles)
    # execute
    facts = analyze(onnx.load(str(merged_path(arch, exporter))))
    # assert: the flag is the If's condition and True reads the cache; every other role as in the separate files
    flag = facts.roles[USE_CACHE]
    assert flag.role == "use_cache_branch" and flag.cache_value is True
    assert facts.has_past and facts.encoder_decoder and not facts.causal_lm
    for name, role in facts.roles.items():
        if name != USE_CACHE:
            assert (role.role, role.cross, role.high) == (
                separate[name].role,
                separate[name].cross,
                separate[name].high,
            ), name


def test_the_flag_is_found_by_the_graph_not_the_name_when_renamed():
    # setup: the flag renamed, and the branches swapped (the cache branch on False)
    model = onnx.load(str(merged_path("whisper", "ts")))
    node = model.graph.node[0]
    for attr in node.attribute:  # swap the two branches
        attr.name = {"then_branch": "else_branch", "else_branch": "then_branch"}[attr.name]
    model.graph.input[-1].name = "branch"
    node.input[0] = "branch"
    # execute
    facts = analyze(model)
    sets = InputSynthesis(model).generate(3)
    # assert: the flag found, its value for the cache branch inverted, and each set still runs the branch it names
    assert facts.roles["branch"].role == "use_cache_branch" and facts.roles["branch"].cache_value is False
    sess = reference_session(model)
    for input_set in sets:
        cache = "the cache branch" in input_set.name
        assert bool(input_set.feeds["branch"][0]) is (not cache)
        out = run_named(sess, input_set.feeds)
        past = input_set.feeds["past_key_values.0.decoder.key"].shape[2]
        new = input_set.feeds["input_ids"].shape[1]
        assert out["present.0.decoder.key"].shape[2] == (past + new if cache else new)


# ------------------------------------------------------------------------------------------ generated sets


@pytest.mark.parametrize(("arch", "exporter"), [("t5", "ts"), ("whisper", "dynamo")])
def test_generated_sets_run_both_branches_and_say_which_when_synthesized(arch, exporter):
    # setup
    path = merged_path(arch, exporter)
    synthesis = InputSynthesis(onnx.load(str(path)))
    sess = reference_session(path)
    # execute
    sets = synthesis.generate(4)
    # assert
    pasts = []
    for input_set in sets:
        feeds = input_set.feeds
        cache = bool(feeds[USE_CACHE][0])
        branch = "the cache branch" if cache else "the no-cache branch"
        assert f"{USE_CACHE}={cache}: {branch}" in input_set.name
        assert input_set.provenance["why"].startswith(f"merged decoder, {USE_CACHE}={cache}: {branch}")
        out = run_named(sess, feeds)
        past = feeds["past_key_values.0.decoder.key"].shape[2]
        cross = feeds["past_key_values.0.encoder.key"].shape[2]
        states = feeds["encoder_hidden_states"].shape[1]
        new = feeds["input_ids"].shape[1]
        if cache:  # the real caches: the cross one as long as the encoder's states, the self one grows
            assert cross == states > 0
            assert out["present.0.decoder.key"].shape[2] == past + new
            assert out["present.0.encoder.key"].size == 0  # Optimum's empty constant
            pasts.append((past, new, feeds["input_ids"].shape[0]))
        else:  # dummy caches the branch never reads; the cross presents come from the encoder's states
            assert past == cross == NO_CACHE_PAST
            assert out["present.0.encoder.key"].shape[2] == states
            assert out["present.0.decoder.key"].shape[2] == new
    assert [bool(s.feeds[USE_CACHE][0]) for s in sets] == [False, True, True, False]
    assert 0 < pasts[0][0] < pasts[1][0]  # the cache grows from set to set
    assert all(new == 1 and batch > 1 for _, new, batch in pasts)  # a batch decoding one token per row


def test_sizes_with_an_empty_past_run_the_no_cache_branch_when_fed_for_sizes():
    # setup: a prefill as the decoder benchmark and the shape profile bind it
    path = merged_path("bart", "ts")
    synthesis = InputSynthesis(onnx.load(str(path)))
    sizes = {"batch_size": 2, "past_decoder_sequence_length": 0, "decoder_sequence_length": 6}
    # execute
    feeds = synthesis.feeds_for_sizes({**sizes, "encoder_sequence_length": 9}, np.random.default_rng(0))
    # assert: the first step, on the no-cache branch; the cross presents come from the encoder's states
    assert bool(feeds[USE_CACHE][0]) is False
    out = run_named(reference_session(path), feeds)
    assert out["present.0.decoder.key"].shape == (2, 4, 6, 8)
    assert out["present.0.encoder.key"].shape == (2, 4, 9, 8)


def test_sizes_a_caller_binds_run_the_cache_branch_when_fed_for_sizes():
    synthesis = InputSynthesis(onnx.load(str(merged_path("bart", "ts"))))
    feeds = synthesis.feeds_for_sizes(
        {"batch_size": 3, "past_decoder_sequence_length": 5, "decoder_sequence_length": 1}, np.random.default_rng(0)
    )
    assert bool(feeds[USE_CACHE][0]) is True
    assert feeds["past_key_values.1.decoder.value"].shape[2] == 5
    out = run_named(reference_session(merged_path("bart", "ts")), feeds)
    assert out["present.1.decoder.value"].shape == (3, 4, 6, 8)


# -------------------------------------------------------------------------------------------- pipeline


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "exporter"), [("whisper", "ts"), ("t5", "dynamo")])
def test_fast_job_on_a_merged_decoder_is_exact_on_both_branches_when_no_samples(arch, exporter, tmp_path):
    # setup
    source = merged_path(arch, exporter)
    # execute
    artifact, report = quick_job(source, tmp_path / "job")
    # assert: verified on sets of both branches, named in the report
    assert report["verification"]["ok"] is True, report["verification"]
    names = [s["name"] for s in report["input_sets"]]
    assert any("the no-cache branch" in n for n in names) and any("the cache branch" in n for n in names)
    assert all(s["inputs"]["source"] == "generated" for s in report["input_sets"])
    # fused and verified inside both branches (passes._subgraphs): self and cross attention of each layer
    fused = next(p for p in report["passes"] if p["name"] == "fuse_transformer")
    assert fused["status"] == "applied", fused
    assert fused["counts"]["fused_attention"] == 2 * 2 * ARCHS[arch].layers
    assert {n["reason"].split(":")[0] for n in fused["non_matches"]} <= {
        "inside If optimum::if then_branch (with_past)",
        "inside If optimum::if else_branch (no_past)",
    }
    # the artifact: the fused model, or the upload when the final gate times it slower (tiny models, timing
    # noise); Optimum's one If either way
    proto = onnx.load(str(artifact))
    (node,) = proto.graph.node
    if report["decision"]["result"] != "original":
        for attr in node.attribute:
            assert any(n.op_type == "MultiHeadAttention" for n in attr.g.node), attr.g.name
    # exact on both branches at shapes the job never generated
    want_sess, got_sess = reference_session(source), reference_session(artifact)
    for use_cache, (batch, dec, past, enc) in ((False, (3, 2, 0, 10)), (True, (3, 1, 5, 10))):
        feeds = merged_feeds(ARCHS[arch], use_cache, batch, dec=dec, past=past, enc=enc, seed=9)
        want, got = run_named(want_sess, feeds), run_named(got_sess, feeds)
        assert want.keys() == got.keys()
        for key, expected in want.items():
            np.testing.assert_allclose(got[key], expected, atol=ATOL, rtol=0, err_msg=f"{use_cache}: {key}")
