"""fuse_gqa folds the export's head Reshapes around GroupQueryAttention (``_gqa_reshapes``): on the TorchScript
and dynamo corpus decoders, after shape inference and fuse_rotary as the presets run them, every layer's q/k/v go from
the projection straight into RotaryEmbedding/GQA and GQA's output straight into the output projection (no
Reshape left in the graph), and the model stays exact against the original at other batch/prompt/cache sizes
and on a growing cache; without shape inference too, the ranks read from the graph's inputs through the ops. A
pair whose leading dims cannot be proven stays (``test_fuse_gqa_unshaped_reshapes``: ranks unknown or not 3)."""

from __future__ import annotations

import json

import onnx_ir as ir
import pytest

from passes._infra import PassContext, op_histogram
from passes.cleanup.shape_inference import ShapeInference
from passes.fusion.fuse_gqa import FuseGqa
from passes.fusion.fuse_rotary import FuseRotary
from tests.models.build_decoders import OUT
from tests.passes.test_pack_matmuls import _assert_exact

MANIFEST = json.loads((OUT / "manifest.json").read_text())


TORCHSCRIPT = ["llama_past_ts", "qwen2_past_ts", "phi3_past_ts", "mistral_past_ts", "trained_llama_past_ts"]
# dynamo takes the head split's batch from a past cache and its length from the ids (Reshape allowzero=1)
DYNAMO = ["llama_past_dynamo", "qwen2_past_dynamo", "phi3_past_dynamo", "mistral_past_dynamo"]


@pytest.mark.parametrize("name", TORCHSCRIPT + DYNAMO)
def test_fuse_gqa_folds_head_reshapes_and_stays_exact_when_decoder(name):
    # setup
    layers = MANIFEST["families"][name.removeprefix("trained_").split("_")[0]]["layers"]
    original = ir.load(OUT / f"{name}.onnx")
    model = ShapeInference()(ir.load(OUT / f"{name}.onnx"), PassContext()).model
    model = FuseRotary()(model, PassContext()).model
    # execute
    result = FuseGqa()(model, PassContext())
    # assert: q, k, v in and the output out, per layer
    ops = op_histogram(result.model)
    assert result.counts["fused_gqa"] == ops["com.microsoft::GroupQueryAttention"] == layers
    assert result.counts["head_reshapes_folded"] == 4 * layers
    assert "Reshape" not in ops
    for node in result.model.graph:
        if node.op_type == "GroupQueryAttention":
            assert all(v.producer() is None or v.producer().op_type != "Reshape" for v in node.inputs if v)
            assert {u.node.op_type for u in node.outputs[0].uses()} == {"MatMul"}
    _assert_exact(original, result.model, name)


@pytest.mark.parametrize("name", ["llama_past_ts", "qwen2_past_ts", "phi3_past_ts"])
def test_fuse_gqa_folds_head_reshapes_and_stays_exact_when_only_the_inputs_have_shapes(name):
    # setup: no value inside the graph annotated (a merged decoder's branches reach the passes so): the
    # ranks follow from the inputs' declared shapes through the ops
    layers = MANIFEST["families"][name.split("_")[0]]["layers"]
    original = ir.load(OUT / f"{name}.onnx")
    model = FuseRotary()(ir.load(OUT / f"{name}.onnx"), PassContext()).model
    for value in (v for node in model.graph for v in node.outputs):
        value.shape = None
    # execute
    result = FuseGqa()(model, PassContext())
    # assert: as with shape inference
    assert result.counts["fused_gqa"] == layers
    assert result.counts["head_reshapes_folded"] == 4 * layers
    assert "Reshape" not in op_histogram(result.model)
    _assert_exact(original, result.model, name)


def test_fuse_gqa_keeps_head_reshapes_when_dims_named_differently():
    # setup: the dynamo export takes the heads' batch from the past cache; name that input's batch otherwise,
    # so nothing ties it to the projections' batch any more
    name = "llama_past_dynamo"
    original = ir.load(OUT / f"{name}.onnx")
    model = ir.load(OUT / f"{name}.onnx")
    for value in model.graph.inputs:
        if value.name.startswith("past_key_values."):
            value.shape = ir.Shape(["cache_batch", *list(value.shape)[1:]])
    model = ShapeInference()(model, PassContext()).model
    model = FuseRotary()(model, PassContext()).model
    # execute
    result = FuseGqa()(model, PassContext())
    # assert: q/k/v pairs (batch from the cache) stay; the output pair reads the same cache dim: stays too
    assert result.counts["fused_gqa"] == MANIFEST["families"]["llama"]["layers"]
    assert result.counts["head_reshapes_folded"] == 0
    _assert_exact(original, result.model, name)
