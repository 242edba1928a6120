"""fuse_transformer on the architectures issue 17 found unfused: GPT-2 (TorchScript eager/SDPA and dynamo),
Llama under TorchScript, the T5 encoder and the BART encoder.

The committed exports come from tests/models/build_torchscript.py (2 layers, 4 heads, hidden 32, exported at
2 x 16). Each test asserts the fused-op counts and the report's family, and runs the fused graph against the
original in ONNX Runtime with graph optimizations off at shapes other than the export's."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from passes._infra import op_histogram
from passes.fusion._fusion_families import detect_family
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS
from tests.passes.test_fuse_torchscript_attention import assert_same_as_export

LAYERS = 2
MHA = "com.microsoft::MultiHeadAttention"
ATTENTION = "com.microsoft::Attention"  # Q/K/V of one input with their biases: packed into one op
SKIP_LN = "com.microsoft::SkipLayerNormalization"
SKIP_RMS = "com.microsoft::SkipSimplifiedLayerNormalization"
_CACHE: dict[str, object] = {}

# export -> (family, the com.microsoft ops a full fusion leaves)
CASES = {
    "ts_gpt2_eager": ("gpt2", {MHA: LAYERS, SKIP_LN: 2 * LAYERS, "com.microsoft::FastGelu": LAYERS}),
    "ts_gpt2_sdpa": ("gpt2", {MHA: LAYERS, SKIP_LN: 2 * LAYERS, "com.microsoft::FastGelu": LAYERS}),
    "dynamo_gpt2": ("gpt2", {MHA: LAYERS, SKIP_LN: 2 * LAYERS, "com.microsoft::FastGelu": LAYERS}),
    "ts_llama_eager": ("llama", {MHA: LAYERS, SKIP_RMS: 2 * LAYERS}),
    "ts_llama_sdpa": ("llama", {MHA: LAYERS, SKIP_RMS: 2 * LAYERS}),
    "ts_t5enc_eager": ("t5", {MHA: LAYERS, SKIP_RMS: 2 * LAYERS}),
    # BART's embedding sum + LayerNorm is one more Skip-LayerNorm; its GELU is the erf form, with its bias.
    "ts_bartenc_eager": ("bart", {ATTENTION: LAYERS, SKIP_LN: 2 * LAYERS + 1, "com.microsoft::BiasGelu": LAYERS}),
    "ts_bartenc_sdpa": ("bart", {ATTENTION: LAYERS, SKIP_LN: 2 * LAYERS + 1, "com.microsoft::BiasGelu": LAYERS}),
}


def fused(name: str):
    """The onnxscript engine's result on one export, computed once per session (5-15 s each on two cores)."""
    if name not in _CACHE:
        _CACHE[name] = FuseTransformer({"engines": ["onnxscript"]})(ir.load(MODELS / f"{name}.onnx"))
    return _CACHE[name]


@pytest.mark.parametrize("name", list(CASES))
def test_detect_family_names_the_architecture_when_decoder_or_encoder_export(name):
    family, evidence = detect_family(ir.load(MODELS / f"{name}.onnx"))
    assert family == CASES[name][0], evidence


@pytest.mark.parametrize("name", list(CASES))
def test_fuse_transformer_fuses_every_layer_when_architecture_export(name):
    family, wanted = CASES[name]
    result = fused(name)
    ops = op_histogram(result.model)
    assert result.notes["family"] == family
    assert {op: ops[op] for op in wanted} == wanted
    assert "Softmax" not in ops and "Tanh" not in ops and "Erf" not in ops
    assert result.notes["missing"] == {}, result.notes["missing"]
    assert not [nm.reason for nm in result.non_matches if "layer" in nm.reason]
    onnx.checker.check_model(ir.serde.serialize_model(result.model), full_check=True)
    assert_same_as_export(name, result.model)


def test_fuse_transformer_groups_relative_position_bias_with_mask_when_t5_encoder():
    """T5 adds its relative position bias and the padding mask as two Adds: they become one attention_bias
    input of MultiHeadAttention (the bias broadcast over the batch, the mask over the heads)."""
    result = fused("ts_t5enc_eager")
    counts = result.notes["candidates"]["onnxscript"]["onnxscript_counts"]
    assert counts["attention_biases_grouped"] == LAYERS
    assert counts["rms_norms_opset17"] == 2 * LAYERS + 1  # two per block and the final norm
    for node in result.model.graph:
        if node.op_type == "MultiHeadAttention":
            bias = node.inputs[5]  # query, key, value, bias, key_padding_mask, attention_bias
            assert bias is not None and bias.shape is not None and bias.shape[1] == 4  # per head: T5's bias
            producers = [bias.producer()]  # the MHA rule may Expand it to [B, heads, S, S]
            producers += [v.producer() for v in producers[0].inputs if v is not None and v.producer() is not None]
            assert "Add" in {p.op_type for p in producers}


@pytest.mark.parametrize("name", ["ts_gpt2_eager", "dynamo_gpt2"])
def test_fuse_transformer_moves_projection_bias_into_fast_gelu_when_gpt2_tanh_gelu(name):
    """GPT-2's (0.5 * x) * (1 + tanh(..)) with x = MatMul + bias becomes FastGelu(MatMul, bias)."""
    result = fused(name)
    gelus = [n for n in result.model.graph if n.op_type == "FastGelu"]
    assert len(gelus) == LAYERS
    for gelu in gelus:
        assert len(gelu.inputs) == 2 and gelu.inputs[1].const_value is not None
        assert gelu.inputs[0].producer().op_type == "MatMul"
    assert result.notes["candidates"]["onnxscript"]["onnxscript_counts"]["tanh_gelu"] == LAYERS


@pytest.mark.parametrize("name", ["ts_bartenc_eager", "ts_bartenc_sdpa"])
def test_fuse_transformer_fuses_erf_gelu_with_its_bias_when_bart_encoder(name):
    """BART's erf GELU of fc1's output (bias first: Add(b, MatMul)) becomes BiasGelu(MatMul, b)."""
    result = fused(name)
    gelus = [n for n in result.model.graph if n.op_type == "BiasGelu"]
    assert len(gelus) == LAYERS
    for gelu in gelus:
        assert gelu.inputs[0].producer().op_type == "MatMul" and gelu.inputs[1].const_value is not None
