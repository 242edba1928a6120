"""The onnxscript adapter: every unexported name it reads resolves on the installed release, a renamed one
fails naming itself, and its replay of ``optimize_for_ort`` builds the very graph the exported function does."""

from __future__ import annotations

import tomllib
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
from onnx_ir.passes.common import ShapeInferencePass
from onnxscript.rewriter.ort_fusions import optimize_for_ort
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from passes._infra import op_histogram
from passes.fusion import _onnxscript_adapter as adapter
from passes.fusion.fuse_transformer import gemm_to_matmul
from tests.passes._util import MODELS, parse

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_check_api_resolves_every_unexported_name_when_onnxscript_in_pinned_range():
    names = adapter.check_api()
    assert "onnxscript.rewriter.ort_fusions.sdpa.sdpa_rules" in names
    assert "onnxscript.rewriter.ort_fusions.mha_bias.FuseBiasMHA" in names  # the class a stricter rule extends
    assert "onnxscript.rewriter.ort_fusions.sdpa.SDPA" in names  # the SDPA rule, with the kernels' fit checked
    assert len(names) == len(adapter._RULE_SETS) + len(adapter._RULE_CLASSES) + 1
    assert adapter.VERSION in SpecifierSet(adapter.SUPPORTED_VERSIONS), (
        f"onnxscript {adapter.VERSION} is outside {adapter.SUPPORTED_VERSIONS}: re-read its ort_fusions and update "
        "passes/fusion/_onnxscript_adapter.py"
    )


def test_supported_versions_match_pyproject_pin_when_read():
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    pin = next(Requirement(d) for d in dependencies if Requirement(d).name == "onnxscript")
    assert pin.specifier == SpecifierSet(adapter.SUPPORTED_VERSIONS)


@pytest.mark.parametrize(
    ("location", "message"),
    [
        (("onnxscript.rewriter.ort_fusions.sdpa", "sdpa_rules_v2"), "has no 'sdpa_rules_v2'"),
        (("onnxscript.rewriter.ort_fusions.sdpa_v2", "sdpa_rules"), "module onnxscript.rewriter.ort_fusions.sdpa_v2"),
        (("onnxscript.rewriter.ort_fusions.sdpa", "SDPA"), "not a RewriteRuleSet"),
    ],
)
def test_rule_set_raises_naming_the_dotted_name_when_onnxscript_renames_it(monkeypatch, location, message):
    monkeypatch.setitem(adapter._RULE_SETS, "sdpa", location)
    with pytest.raises(adapter.OnnxscriptAPIChangedError) as raised:
        adapter.check_api()
    text = str(raised.value)
    assert f"changed {'.'.join(location)}" in text and message in text
    assert adapter.SUPPORTED_VERSIONS in text


# The steps of ours the replay adds to onnxscript's sequence (each a no-op where onnxscript's rules already read
# the exporter's form).
OURS = (
    "merge_heads_split",
    "layer_norms_written_out",
    "rms_norms_opset17",
    "attention_biases_grouped",
    "concat_shapes_split",
    "folded_heads_mha",
    "scores_scale_copied",
    "key_transposes_exposed",
    "sdpa_keys_heads_first",
    "tanh_gelu",
    "erf_gelu_half_first",
    "noop_bias_expands",
    "heads_first_kv",
    "projection_biases_turned",
    "standing_mha_bias",
    "standing_attention",
    "constants_reattached",
)


@pytest.mark.parametrize(("name", "ours"), [("bert_encoder", {}), ("gpt2", {"tanh_gelu": 2})])
def test_fuse_for_ort_builds_the_graph_of_optimize_for_ort_when_attention_fused(name, ours):
    """The replay is step for step onnxscript's own sequence: if a release reorders or adds a step, the graphs
    differ here before the fast preset changes. Where none of our steps fires (BERT), the graph is the very
    one optimize_for_ort builds; on GPT-2 only our tanh GELU adds to it (FastGelu, which onnxscript misses)."""
    replayed, exported = (ir.load(MODELS / f"hf_{name}.onnx") for _ in range(2))
    for model in (replayed, exported):
        ShapeInferencePass()(model)
        gemm_to_matmul(model)
    counts = adapter.fuse_for_ort(replayed)
    exported, exported_counts = optimize_for_ort(exported)
    mine = {step: counts.pop(step) for step in OURS}
    assert {step: n for step, n in mine.items() if n} == ours
    assert counts == exported_counts
    assert counts["sdpa"] == 2
    if not ours:
        assert ir.serde.serialize_model(replayed) == ir.serde.serialize_model(exported)
    else:
        assert op_histogram(replayed)["com.microsoft::FastGelu"] == 2
        assert "com.microsoft::FastGelu" not in op_histogram(exported)


def test_fuse_for_ort_stops_at_multi_head_attention_when_stop_before_mha():
    model = ir.load(MODELS / "hf_bert_encoder.onnx")
    ShapeInferencePass()(model)
    counts = adapter.fuse_for_ort(model, stop_before="mha")
    ops = op_histogram(model)
    assert counts["attention"] == 0 and counts["mha2"] == 2
    assert ops["com.microsoft::MultiHeadAttention"] == 2 and "com.microsoft::Attention" not in ops


def test_closest_match_names_the_diverging_node_when_gelu_form_unknown():
    model = ir.load(MODELS / "hf_gpt2.onnx")
    reason = adapter.closest_match(model, "gelu")
    assert reason.startswith("closest onnxscript gelu match:") and "nodes matched at" in reason


def test_closest_match_names_no_node_when_only_a_patterns_first_node_matched():
    # Any MatMul is a root the SDPA rule tries; on a graph with no attention it named an FFN's MatMul as the
    # "closest match" (XLNet's and Funnel's reports did), which sent a reader to the wrong place.
    model = ir.serde.deserialize_model(
        parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[2,4,8] x) => (float[2,4,8] y) {
            w = Constant <value = float[8,8] {1,0,0,0,0,0,0,0, 0,1,0,0,0,0,0,0, 0,0,1,0,0,0,0,0, 0,0,0,1,0,0,0,0,
                                              0,0,0,0,1,0,0,0, 0,0,0,0,0,1,0,0, 0,0,0,0,0,0,1,0, 0,0,0,0,0,0,0,1}> ()
            h = MatMul (x, w)
            y = Relu (h)
        }
        """)
    )
    reason = adapter.closest_match(model, "sdpa")
    assert reason.startswith("onnxscript sdpa: no partial match beyond the pattern's first node (MatMul)")
    assert "matched at" not in reason  # no node named


def _residual_read_twice() -> ir.Model:
    """``LayerNorm(x + r) + 2 (x + r)``: the residual sum has a second reader listed before the norm (PEGASUS-X's
    encoder takes the Shape of its residual stream there)."""
    model = ir.serde.deserialize_model(
        parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[B, S, 8] x, float[B, S, 8] r) => (float[B, S, 8] y)
          <float[8] w = {1, 2, 1, 2, 1, 2, 1, 2}, float[8] b = {0, 1, 0, 1, 0, 1, 0, 1}, float two = {2}> {
            a = Add(x, r)
            d = Mul(a, two)
            n = LayerNormalization <axis = -1, epsilon = 1e-5> (a, w, b)
            y = Add(n, d)
        }
        """)
    )
    ShapeInferencePass()(model)
    return model


def test_fused_graph_stays_topologically_sorted_when_a_residual_sum_has_an_earlier_reader():
    """onnxscript puts SkipLayerNormalization where the norm stood, after the Shape that now reads its sum output:
    ORT sorts on load, but onnx's checker and onnx-ir's clone refused the candidate (PEGASUS-X's whole
    fuse_transformer failed in its per-layer reasons)."""
    model = _residual_read_twice()
    counts = adapter.fuse_for_ort(model)
    assert counts["skip_layer_normalization"] == 1
    order = [n.op_type for n in model.graph]
    assert order.index("SkipLayerNormalization") < order.index("Mul")
    model.clone()  # raised "outer-scope value" on the unsorted graph
    onnx.checker.check_model(ir.serde.serialize_model(model))
