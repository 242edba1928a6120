"""unfuse_skip_layernorm: SkipLayerNormalization becomes Sum + LayerNormalization, ORT's level-2 optimizer
cannot fuse it back, and the outputs stay the same (tiny HF exports after fuse_transformer, hand-built graphs)."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from passes._infra import PassContext
from passes.fusion.fuse_transformer import FuseTransformer
from passes.fusion.unfuse_skip_layernorm import UnfuseSkipLayerNorm
from tests.numerics import assert_equivalent
from tests.passes._util import MODELS, apply, assert_same_outputs, checked, ops, parse

SLN = "com.microsoft::SkipLayerNormalization"  # as op_histogram names it


def _ort_optimized_ops(model: ir.Model | onnx.ModelProto, tmp_path: Path) -> dict[str, int]:
    """Op counts of the graph ORT runs at its default level (ORT_ENABLE_ALL) on the CPU EP."""
    proto = model if isinstance(model, onnx.ModelProto) else ir.serde.serialize_model(model)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "ort_optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    counts: dict[str, int] = {}
    for node in onnx.load(str(tmp_path / "ort_optimized.onnx")).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


@pytest.mark.parametrize("name", ["bert_encoder", "roberta_cls", "gpt2"])
def test_unfuse_skip_layernorm_replaces_every_fused_node_when_fuse_transformer_made_them(name, tmp_path):
    """fuse_transformer's SkipLayerNormalization nodes (post-LN BERT/RoBERTa, pre-LN GPT-2 whose residual sum
    is read by the next block) all become Sum + LayerNormalization, and ORT's default level keeps them so."""
    fused = FuseTransformer()(ir.load(MODELS / f"hf_{name}.onnx")).model
    before = ops(fused)
    assert before.get(SLN, 0) > 0, "fuse_transformer no longer makes SkipLayerNormalization"
    result = UnfuseSkipLayerNorm()(fused, PassContext(target="cpu"))
    assert result.modified
    assert result.counts["skip_layernorms_unfused"] == before[SLN]
    after = ops(result.model)
    assert SLN not in after
    assert after["Sum"] >= before[SLN]
    assert after["LayerNormalization"] == before.get("LayerNormalization", 0) + before[SLN]
    assert "SkipLayerNormalization" not in _ort_optimized_ops(result.model, tmp_path)
    assert_same_outputs(name, result.model)


def test_unfuse_skip_layernorm_guards_residual_adds_when_export_is_unfused(tmp_path):
    """On the plain export ORT itself fuses Add + LayerNormalization; the Sum form keeps it from doing so."""
    original = onnx.load(str(MODELS / "hf_bert_encoder.onnx"))
    assert _ort_optimized_ops(original, tmp_path).get("SkipLayerNormalization", 0) > 0, (
        "ORT no longer fuses SkipLayerNormalization at its default level: the guard has nothing to guard"
    )
    model, result = apply(UnfuseSkipLayerNorm(), original)
    assert result.modified
    assert result.counts["skip_layernorms_unfused"] == 0
    assert result.counts["residual_adds_guarded"] >= 4  # two blocks, two residual LayerNorms each
    assert "SkipLayerNormalization" not in _ort_optimized_ops(model, tmp_path)
    assert_same_outputs("bert_encoder", model, atol=1e-5)


SLN_WITH_EVERYTHING = """
    <ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
    g (float[B, S, 8] x, float[B, S, 8] skip) => (float[B, S, 8] y, float[B, S, 1] mean,
                                                  float[B, S, 1] inv_std, float[B, S, 8] total) {
        gamma = Constant <value = float[8] {1, 2, 3, 4, 5, 6, 7, 8}> ()
        beta = Constant <value = float[8] {0.5, 0, -0.5, 0, 0.25, 0, -0.25, 0}> ()
        bias = Constant <value = float[8] {0.1, -0.1, 0.2, -0.2, 0.3, -0.3, 0.4, -0.4}> ()
        [sln] y, mean, inv_std, total = com.microsoft.SkipLayerNormalization <epsilon: float = 1e-5> (
            x, skip, gamma, beta, bias)
    }"""


def test_unfuse_skip_layernorm_maps_every_output_when_all_are_graph_outputs():
    """Mean, inverse std and the skip+bias sum are graph outputs: each keeps its name and its values."""
    original = parse(SLN_WITH_EVERYTHING, check=False)  # the checker does not know com.microsoft ops
    model, result = apply(UnfuseSkipLayerNorm(), original)
    assert result.counts == {"skip_layernorms_unfused": 1, "skip_rms_norms_unfused": 0, "residual_adds_guarded": 0}
    assert ops(model) == {"Constant": 3, "Add": 1, "Sum": 1, "LayerNormalization": 1}
    assert [o.name for o in model.graph.outputs] == ["y", "mean", "inv_std", "total"]
    norm = next(n for n in model.graph if n.op_type == "LayerNormalization")
    assert norm.attributes["epsilon"].value == pytest.approx(1e-5)
    bias_add = next(n for n in model.graph if n.op_type == "Add")
    assert bias_add.inputs[0].name == "x"  # the bias goes where the projection would have added it
    assert_equivalent(original, checked(model), shapes=[{"x": (2, 3, 8), "skip": (2, 3, 8)}])


def test_unfuse_skip_layernorm_uses_default_epsilon_when_attribute_absent():
    """SkipLayerNormalization's default epsilon is 1e-12, LayerNormalization's 1e-5: the pass writes it out."""
    original = parse(
        """
        <ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
        g (float[B, S, 4] x, float[B, S, 4] skip) => (float[B, S, 4] y) {
            gamma = Constant <value = float[4] {1, 1, 1, 1}> ()
            [sln] y = com.microsoft.SkipLayerNormalization (x, skip, gamma)
        }""",
        check=False,
    )
    model, result = apply(UnfuseSkipLayerNorm(), original)
    assert result.counts["skip_layernorms_unfused"] == 1
    assert ops(model) == {"Constant": 1, "Sum": 1, "LayerNormalization": 1}
    norm = next(n for n in model.graph if n.op_type == "LayerNormalization")
    assert norm.attributes["epsilon"].value == pytest.approx(1e-12)
    assert len(norm.inputs) == 2  # no beta given, none invented
    # Rows of nearly equal values are where the two epsilons would differ most.
    assert_equivalent(original, checked(model), shapes=[{"x": (1, 6, 4), "skip": (1, 6, 4)}])


def test_unfuse_skip_layernorm_leaves_bias_add_when_an_operand_is_constant():
    """Add(x, constant) -> LayerNormalization is no residual connection and ORT does not fuse it: unchanged."""
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B, S, 4] x) => (float[B, S, 4] y) {
            bias = Constant <value = float[4] {1, 2, 3, 4}> ()
            gamma = Constant <value = float[4] {1, 1, 1, 1}> ()
            [add] s = Add(x, bias)
            [ln] y = LayerNormalization <axis = -1> (s, gamma)
        }""")
    model, result = apply(UnfuseSkipLayerNorm(), original)
    assert not result.modified
    assert ops(model) == {"Constant": 2, "Add": 1, "LayerNormalization": 1}


def test_unfuse_skip_layernorm_changes_nothing_when_target_is_cuda():
    original = parse(SLN_WITH_EVERYTHING, check=False)
    model, result = apply(UnfuseSkipLayerNorm(), original, PassContext(target="cuda"))
    assert not result.modified
    assert ops(model)[SLN] == 1
    [non_match] = result.non_matches
    assert "cuda" in non_match.reason and "fast one" in non_match.reason


def test_unfuse_skip_layernorm_changes_nothing_when_opset_has_no_layernormalization():
    original = parse(
        SLN_WITH_EVERYTHING.replace('"" : 17', '"" : 16'),
        check=False,
    )
    model, result = apply(UnfuseSkipLayerNorm(), original)
    assert not result.modified
    assert ops(model)[SLN] == 1
    assert "opset 16" in result.non_matches[0].reason


SKIP_RMS = """
<ir_version: 9, opset_import: ["" : %d, "com.microsoft" : 1]>
g (float[B, S, 8] x, float[B, S, 8] skip) => (float[B, S, 8] y, float[B, S, 8] total) {
    gamma = Constant <value = float[8] {0.5, 1.5, 1, 2, 0.25, 1, 0.75, 1.25}> ()
    bias = Constant <value = float[8] {0.1, -0.2, 0.3, 0, 0.05, -0.1, 0.2, 0.4}> ()
    [srms] y, mean, inv_rms, total = com.microsoft.SkipSimplifiedLayerNormalization <epsilon = 1e-6> (
        x, skip, gamma, bias
    )
}"""


@pytest.mark.parametrize("opset", [17, 18])  # ReduceMean's axes moved from attribute to input at 18
def test_unfuse_skip_layernorm_writes_add_and_rms_when_skip_simplified_layernorm(opset, tmp_path):
    """Residual + RMS norm (Llama, T5): ORT 1.32's CPU kernel is 1.2-4.9x slower than Add + the
    SimplifiedLayerNormalization ORT's session builds from the decomposition, and it does not re-fuse them."""
    original = parse(SKIP_RMS % opset, check=False)
    model, result = apply(UnfuseSkipLayerNorm(), original)
    assert result.counts["skip_rms_norms_unfused"] == 1
    found = ops(model)
    assert "SkipSimplifiedLayerNormalization" not in str(found) and found["Add"] == 3  # bias, residual, epsilon
    assert [o.name for o in model.graph.outputs] == ["y", "total"]
    assert_equivalent(
        original, checked(model), shapes=[{"x": (2, 5, 8), "skip": (2, 5, 8)}, {"x": (1, 9, 8), "skip": (1, 9, 8)}]
    )
    ran = _ort_optimized_ops(model, tmp_path)
    assert ran.get("SimplifiedLayerNormalization") == 1 and "SkipSimplifiedLayerNormalization" not in ran


def test_unfuse_skip_layernorm_keeps_skip_rms_when_its_statistics_are_read():
    original = parse((SKIP_RMS % 18).replace("float[B, S, 8] total)", "float[B, S, 1] inv_rms)"), check=False)
    model, result = apply(UnfuseSkipLayerNorm(), original)
    assert result.counts["skip_rms_norms_unfused"] == 0
    assert "inverse-RMS output is read" in result.non_matches[0].reason
    assert ops(model)["com.microsoft::SkipSimplifiedLayerNormalization"] == 1
