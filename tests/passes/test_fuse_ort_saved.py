"""A model ONNX Runtime saved after its own optimizations fuses its attention (issue 17, export variants).

An upload that is "already optimized" by an ORT session (``SessionOptions.optimized_model_filepath`` at
ORT_ENABLE_EXTENDED) has each attention's scaled scores as ``com.microsoft::FusedMatMul(q, k^T, alpha)``:
fuse_transformer found 0/2 attention on the corpus's tiny BERT and ViT saved that way
(``python -m bench.heldout_export_variants --only bert vit --exporters ort_saved``). The saved models are
made here from the committed TorchScript exports, by the ORT the tests run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxruntime as ort
import pytest

from passes._infra import op_histogram
from passes.fusion import _fused_matmul
from passes.fusion.fuse_transformer import FuseTransformer
from tests.models.corpus import feeds
from tests.passes._util import MODELS, session


def _ort_saved(arch: str, tmp: Path) -> Path:
    out = tmp / f"{arch}_ort_saved.onnx"
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(out)
    ort.InferenceSession(str(MODELS / "corpus" / f"{arch}_ts_eager.onnx"), options, providers=["CPUExecutionProvider"])
    return out


@pytest.mark.parametrize(("arch", "shapes"), [("bert", ((1, 7), (3, 23))), ("vit", ((1, 0), (3, 0)))])
def test_ort_saved_encoder_fuses_its_attention(arch, shapes, tmp_path) -> None:
    saved = _ort_saved(arch, tmp_path)
    assert op_histogram(ir.load(saved))["com.microsoft::FusedMatMul"] == 2  # what ORT wrote, the premise
    result = FuseTransformer()(ir.load(saved))
    assert result.notes["fused_matmuls_unfolded"] == 2
    ops = op_histogram(result.model)
    assert ops["com.microsoft::Attention"] + ops["com.microsoft::MultiHeadAttention"] == 2
    assert "Softmax" not in ops and "com.microsoft::FusedMatMul" not in ops
    reference, candidate = session(saved), session(result.model)
    for seed, (batch, seq) in enumerate(shapes, start=1):
        x = feeds(arch, "tiny", batch, seq, seed=seed, pad=True)
        for ref, got in zip(reference.run(None, x), candidate.run(None, x), strict=True):
            assert ref.shape == got.shape
            np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-3)


def _fused_matmul_graph(trans_a: int, trans_b: int, alpha: float, batch_transposed: int = 0) -> onnx.ModelProto:
    node = oh.make_node(
        "FusedMatMul",
        ["a", "b"],
        ["y"],
        domain="com.microsoft",
        alpha=alpha,
        transA=trans_a,
        transB=trans_b,
        transBatchB=batch_transposed,
    )
    a_shape = [2, 3, 5, 4] if trans_a else [2, 3, 4, 5]
    b_shape = [2, 3, 6, 5] if trans_b else [2, 3, 5, 6]
    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["a"]), node],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, a_shape)],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [onh.from_array(np.random.default_rng(0).standard_normal(b_shape).astype(np.float32), "b")],
    )
    opsets = [oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)]
    return oh.make_model(graph, opset_imports=opsets, ir_version=8)


@pytest.mark.parametrize(("trans_a", "trans_b", "alpha"), [(0, 1, 0.125), (1, 0, 1.0), (1, 1, -2.0), (0, 0, 0.5)])
def test_fused_matmul_unfolds_to_the_same_values(trans_a, trans_b, alpha) -> None:
    proto = _fused_matmul_graph(trans_a, trans_b, alpha)
    model = ir.serde.deserialize_model(proto)
    common_passes.ShapeInferencePass()(model)  # as fuse_transformer does first: a transpose flag needs the rank
    assert _fused_matmul.unfold(model) == 1
    ops = op_histogram(model)
    assert "com.microsoft::FusedMatMul" not in ops and ops["MatMul"] == 1
    assert ops.get("Transpose", 0) == trans_a + trans_b and ops.get("Mul", 0) == (alpha != 1.0)
    assert model.graph.outputs[0].name == "y"
    x = np.random.default_rng(1).standard_normal([d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim])
    x = x.astype(np.float32)
    want, got = session(ir.serde.deserialize_model(proto)).run(None, {"x": x}), session(model).run(None, {"x": x})
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)


def test_batch_transposed_fused_matmul_is_kept() -> None:
    model = ir.serde.deserialize_model(_fused_matmul_graph(0, 1, 0.5, batch_transposed=1))
    assert _fused_matmul.unfold(model) == 0
    assert op_histogram(model)["com.microsoft::FusedMatMul"] == 1
