"""fuse_transformer's job-time savings: ORT's optimizer alone is not run once a verified candidate has every
expected fusion, and a second run on the same model bytes, options, target and samples (the gate's pass-by-pass
retry, a group's fallback) replays the first run's outcome instead of building the candidates again."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes._infra import PassContext, op_histogram
from passes.fusion import fuse_transformer as ft
from passes.fusion.fuse_transformer import FuseTransformer, pack_qkv
from tests.passes._util import MODELS, assert_same_outputs
from workers import artifacts


def load(name: str) -> ir.Model:
    return ir.load(MODELS / f"hf_{name}.onnx")


def test_fuse_transformer_skips_ort_alone_when_a_candidate_has_every_expected_fusion():
    ft._LAST.clear()
    result = FuseTransformer()(load("gpt2"))
    candidates = result.notes["candidates"]
    assert result.notes["missing"] == {}
    assert list(candidates) == ["onnxscript", "ort", "onnxscript+ort"]  # reported in the order of the option
    assert "skipped" in candidates["ort"] and "error" not in candidates["ort"]
    # 2 attention + 4 skip norms + 2 GELU: all expected, by onnxscript alone and by onnxscript+ort, which tie on
    # size too since identity Reshapes are dropped before fusion (``_identity_reshape``): either may win the tie.
    chosen = result.notes["chosen"]
    other = ({"onnxscript", "onnxscript+ort"} - {chosen}).pop()
    assert candidates["ort"]["skipped"] == f"{chosen} verified with score 8, the most ORT alone could reach"
    assert candidates["ort"]["verified"] is None and "unchecked" not in candidates["ort"]  # skipped: never built
    assert candidates[chosen]["verified"] is True
    assert candidates[other]["verified"] is None and "unchecked" in candidates[other]
    assert not [m for m in result.non_matches if "candidate ort" in m.reason]  # a skip is not a rejection
    assert_same_outputs("gpt2", result.model)


def test_fuse_transformer_builds_ort_alone_when_an_expected_fusion_is_missing():
    """BERT's position Slice defeats EmbedLayerNormalization in both engines: nothing is complete, so every
    candidate is built and checked, as before."""
    ft._LAST.clear()
    result = FuseTransformer()(load("bert_encoder"))
    candidates = result.notes["candidates"]
    assert "embed_layer_norm" in result.notes["missing"]
    assert "skipped" not in candidates["ort"] and candidates["ort"]["achieved"]["attention"] == 0
    # Ranked below the chosen one, which verified: built and counted, not verified for nothing.
    assert candidates["ort"]["verified"] is None and "unchecked" in candidates["ort"]
    assert candidates[result.notes["chosen"]]["verified"] is True
    assert_same_outputs("bert_encoder", result.model)


def test_fuse_transformer_verifies_the_next_candidate_when_the_best_one_fails(monkeypatch):
    """The choice is the verified candidate with the most fusions: a best one that fails its check hands the
    choice to the next one down, which is then verified."""
    ft._LAST.clear()
    real = ft._verify
    checked = []

    def verify(proto, *args, **kwargs):
        checked.append(len(proto.graph.node))
        if len(checked) == 1:
            raise ValueError("output 'x' differs: max |diff| 1.0 (a test's refusal)")
        return real(proto, *args, **kwargs)

    monkeypatch.setattr(ft, "_verify", verify)
    result = FuseTransformer({"engines": ["onnxscript", "ort"]})(load("bert_encoder"))
    candidates = result.notes["candidates"]
    assert len(checked) == 2
    assert candidates["onnxscript"]["verified"] is False and "a test's refusal" in candidates["onnxscript"]["error"]
    assert result.notes["chosen"] == "ort" and candidates["ort"]["verified"] is True
    assert any("candidate onnxscript rejected" in m.reason for m in result.non_matches)
    assert_same_outputs("bert_encoder", result.model)


def test_fuse_transformer_bounds_ort_alone_by_the_packings_of_the_input_when_pack_qkv():
    """With pack_qkv the score counts packed projections too: ORT alone is skipped only when a candidate
    reaches every expected fusion plus every packing the input model allows."""
    ft._LAST.clear()
    gpt2 = FuseTransformer({"pack_qkv": True})(load("gpt2"))
    assert pack_qkv(load("gpt2")) == 0  # Conv1D Gemms: nothing to pack before the Gemm rewrite
    assert "skipped" in gpt2.notes["candidates"]["ort"]
    # BERT: the input's Q/K/V MatMuls pack, so ORT alone (which leaves them unfused) could score higher.
    bert = FuseTransformer({"pack_qkv": True})(load("bert_encoder"))
    assert pack_qkv(load("bert_encoder")) > 0
    assert "skipped" not in bert.notes["candidates"]["ort"]
    assert bert.notes["candidates"]["ort"]["packed_qkv"] > 0


def test_fuse_transformer_replays_its_result_when_run_again_on_the_same_model_read_back(tmp_path, monkeypatch):
    ft._LAST.clear()
    first = FuseTransformer()(load("gpt2"))
    assert "reused" not in first.notes
    # The gate's retry reads each stage back from its file: the same bytes, so the same key.
    path = tmp_path / "stage.onnx"
    artifacts.save_ir(load("gpt2"), path)
    calls = []
    monkeypatch.setattr(ft, "_onnxscript", lambda *a, **k: calls.append(a))  # would fail the run if reached
    second = FuseTransformer()(artifacts.load_ir(path))
    assert not calls
    assert "reused" in second.notes
    assert second.modified and second.counts == first.counts
    assert op_histogram(second.model) == op_histogram(first.model)
    assert ir.serde.serialize_model(second.model) == ir.serde.serialize_model(first.model)
    assert second.model is not first.model  # a fresh model: later passes may change it in place
    assert_same_outputs("gpt2", second.model)


def test_fuse_transformer_runs_again_when_options_or_samples_differ(monkeypatch):
    ft._LAST.clear()
    FuseTransformer()(load("gpt2"))
    other_options = FuseTransformer({"attention": "mha"})(load("gpt2"))
    assert "reused" not in other_options.notes
    ids = np.arange(16, dtype=np.int64).reshape(2, 8) % 50
    sample = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    other_samples = FuseTransformer({"attention": "mha"})(load("gpt2"), PassContext(samples=[sample]))
    assert "reused" not in other_samples.notes
    again = FuseTransformer({"attention": "mha"})(load("gpt2"), PassContext(samples=[sample]))
    assert "reused" in again.notes
