"""A float16 export fuses like its float32 twin (issue 17, export variants).

``tests/models/heldout/bert_fp16_ts.onnx``: ``python -m bench.heldout_export_variants --only bert --exporters
ts_fp16`` (the corpus's tiny BertModel, ``model.half()``, TorchScript opset 17, dynamic batch and sequence).
fuse_transformer verified each candidate with float32's 1e-4: a fused kernel sums float16 in another order, one
unit in the last place at |x| ~ 2 is 2e-3, so every candidate was refused (0/2 attention, 0/4 skip norms) and
the job returned the upload. The bounds now have a floor of 4 units in the last place of a half-precision
output (``Tolerance.half_precision_floor``), and a GELU constant is read within its own type's rounding.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
import pytest

from core.config import HALF_PRECISION_FLOOR, Tolerance
from passes._infra import op_histogram
from passes.fusion import _erf_gelu
from passes.fusion.fuse_transformer import FuseTransformer
from tests.models.corpus import feeds
from tests.passes._util import MODELS, session
from workers.verify import compare_output

MODEL = MODELS / "heldout" / "bert_fp16_ts.onnx"
FP16 = HALF_PRECISION_FLOOR["float16"]


@pytest.fixture(scope="module")
def fused() -> ir.Model:
    return FuseTransformer()(ir.load(MODEL)).model


def test_float16_bert_fuses_every_attention_and_residual_norm(fused) -> None:
    ops = op_histogram(fused)
    assert ops["com.microsoft::Attention"] + ops["com.microsoft::MultiHeadAttention"] == 2
    assert ops["com.microsoft::SkipLayerNormalization"] == 4
    assert "Softmax" not in ops
    assert all(v.dtype == ir.DataType.FLOAT16 for v in fused.graph.outputs)


def test_float16_fused_bert_is_within_float16_resolution_on_other_shapes(fused) -> None:
    reference, candidate = session(MODEL), session(fused)
    worst = 0.0
    for seed, (batch, seq) in enumerate(((1, 7), (3, 23)), start=1):  # the export was 2 x 16; padded rows
        x = feeds("bert", "tiny", batch, seq, seed=seed, pad=True)
        ref, got = reference.run(None, x)[0], candidate.run(None, x)[0]
        assert got.dtype == np.float16 and got.shape == ref.shape == (batch, seq, 32)
        np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), atol=FP16, rtol=FP16)
        worst = max(worst, float(np.abs(got.astype(np.float32) - ref.astype(np.float32)).max()))
    assert worst > 0  # the kernels did reorder the sums: the floor is what let them through


def test_half_precision_floor_is_per_output_type_and_can_be_turned_off() -> None:
    ref = np.linspace(-2, 2, 64).astype(np.float16)
    got = (ref.astype(np.float32) + np.float32(3e-3) * np.sign(ref)).astype(np.float16)  # ~2 ulp at |x| ~ 2
    assert compare_output("s", "y", ref, got, Tolerance()).ok
    refused = compare_output("s", "y", ref, got, Tolerance(half_precision_floor=False))
    assert not refused.ok and "atol=0.0001 rtol=0.001" in refused.reason
    ref32, got32 = ref.astype(np.float32), got.astype(np.float32)
    stats = compare_output("s", "y", ref32, got32, Tolerance())  # float32 outputs keep the bounds as given
    assert not stats.ok and "atol=0.0001 rtol=0.001" in stats.reason
    assert Tolerance(atol=0.1).bounds(np.float16) == (0.1, FP16)  # a looser bound stays the user's


ROOT2_FP16 = float(np.float16(math.sqrt(2.0)))  # 1.4140625: 1.1e-4 from sqrt(2), within float16's rounding


def _gelu(dtype: type) -> ir.Model:
    """ESM's erf GELU ``(x * 0.5) * (1 + erf(x / root))`` in ``dtype``, with root stored as float16 rounds sqrt(2)."""
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    consts = {"half": 0.5, "root": ROOT2_FP16, "one": 1.0}
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Div", ["x", "root"], ["s"]),
            onnx.helper.make_node("Erf", ["s"], ["e"]),
            onnx.helper.make_node("Add", ["e", "one"], ["a"]),
            onnx.helper.make_node("Mul", ["x", "half"], ["h"]),
            onnx.helper.make_node("Mul", ["h", "a"], ["y"]),
        ],
        "g",
        [onnx.helper.make_tensor_value_info("x", elem, ["B", "S", 8])],
        [onnx.helper.make_tensor_value_info("y", elem, ["B", "S", 8])],
        [onnx.numpy_helper.from_array(np.array(v, dtype), k) for k, v in consts.items()],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=9)
    onnx.checker.check_model(model, full_check=True)
    return ir.serde.deserialize_model(model)


def test_float16_gelu_constant_is_read_within_its_own_rounding() -> None:
    model = _gelu(np.float16)
    assert _erf_gelu.rules.apply_to_model(model) == 1
    assert op_histogram(model)["com.microsoft::Gelu"] == 1
    # the same value in a float32 graph is no sqrt(2): float32 constants keep the 1e-4 bound
    model32 = _gelu(np.float32)
    assert _erf_gelu.rules.apply_to_model(model32) == 0
