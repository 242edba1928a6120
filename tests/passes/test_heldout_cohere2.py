"""Cohere 2's hand-written LayerNorm fuses, and with it the residual sums (issues 17/19, held-out decoders, round 4).

Cohere writes its norm out (``(x - mean) * rsqrt(var + eps) * weight``, no bias) in an opset-18 export, where the
fusions read only ``LayerNormalization``; fuse_rotary turns its ``Reciprocal(Sqrt)`` into ``Div(1, Sqrt)`` (an LN
is the RMS norm of ``x - mean``), a third spelling. ORT's session fused the norms at load, so the residual sums
before them (attention and MLP in parallel, added to the stream) never became SkipLayerNormalization. Now
``_layer_norm_forms`` runs in ``fuse_for_ort`` at opset 17 and above: the bias-free and ``Div(1, std)`` forms
fuse, with a zero bias so onnxscript's skip rule reads them.

``tests/models/heldout/cohere2_past_dynamo.onnx``: ``python -m bench.heldout_dec_round4 --only cohere2 --forms past
--exporters dynamo --presets --tiny`` (2 layers, hidden 32, 4 heads of 8, 2 kv heads, a window of 64 keys with
interleaved rope on layer 1, global attention without rope on layer 2, Optimum's signature; TorchScript's export of
Cohere 2 does not run in ORT).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from onnx_ir.passes.common import ShapeInferencePass

from passes._infra import op_histogram
from passes.fusion import _layer_norm_forms as forms
from tests.numerics import assert_equivalent
from tests.passes._decoder_replay import assert_decodes_like_export, fast_upto

PATH = Path(__file__).resolve().parent.parent / "models" / "heldout" / "cohere2_past_dynamo.onnx"
LAYERS = 2


def test_every_norm_and_residual_norm_fuses_and_the_decoder_decodes_like_the_export() -> None:
    model, counts = fast_upto(PATH, "fuse_transformer")
    ops = op_histogram(model)
    assert counts.get("fuse_transformer.fused_skip_layer_norm", 0) == LAYERS
    assert ops["com.microsoft::SkipLayerNormalization"] == LAYERS
    assert not any(n.op_type == "ReduceMean" for n in model.graph)
    assert_decodes_like_export(PATH, model)


def _norm(inverse: str, biased: bool) -> onnx.ModelProto:
    """``weight * (x - mean) * inverse(std) [+ bias]`` over the last of [B, S, 8], opset 18."""
    rng = np.random.default_rng(0)
    c = helper.make_tensor
    inits = [
        c("axes", TensorProto.INT64, [1], [-1]),
        c("two", TensorProto.FLOAT, [], [2.0]),
        c("eps", TensorProto.FLOAT, [], [1e-5]),
        c("one", TensorProto.FLOAT, [], [1.0]),
        c("weight", TensorProto.FLOAT, [8], rng.uniform(0.5, 1.5, 8)),
        c("bias", TensorProto.FLOAT, [8], rng.standard_normal(8)),
    ]
    node = helper.make_node
    nodes = [
        node("ReduceMean", ["x", "axes"], ["mean"]),
        node("Sub", ["x", "mean"], ["d"]),
        node("Pow", ["d", "two"], ["sq"]),
        node("ReduceMean", ["sq", "axes"], ["var"]),
        node("Add", ["var", "eps"], ["shifted"]),
        node("Sqrt", ["shifted"], ["std"]),
    ]
    if inverse == "div_one":
        nodes += [node("Div", ["one", "std"], ["inv"]), node("Mul", ["d", "inv"], ["normed"])]
    else:
        nodes += [node("Reciprocal", ["std"], ["inv"]), node("Mul", ["d", "inv"], ["normed"])]
    nodes.append(node("Mul", ["weight", "normed"], ["scaled"] if biased else ["y"]))
    if biased:
        nodes.append(node("Add", ["scaled", "bias"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "norm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("inverse", ["div_one", "reciprocal"])
@pytest.mark.parametrize("biased", [True, False])
def test_a_written_out_norm_fuses_with_its_bias_or_a_zero_one(inverse: str, biased: bool) -> None:
    proto = _norm(inverse, biased)
    model = ir.serde.deserialize_model(proto)
    ShapeInferencePass()(model)
    fused = forms.rules.apply_to_model(model) + forms.unbiased_rules.apply_to_model(model)
    assert fused == 1
    (norm,) = [n for n in model.graph if n.op_type == "LayerNormalization"]
    assert len(norm.inputs) == 3  # the bias, or zeros: the residual rule reads biased norms only
    assert not any(n.op_type in ("ReduceMean", "Sqrt") for n in model.graph)
    assert_equivalent(proto, model, [{"x": (2, 5, 8)}, {"x": (1, 9, 8)}], rtol=1e-5, atol=1e-5)
