"""_batched_heads: attention on heads folded into the batch (``torch.bmm``) made 4-D, and only where proven.

The graphs are written the way DeBERTa-v2's TorchScript export writes them: q and k folded to ``[B*h, S, d]``,
k transposed in 3-D and divided by a scale, the scores unfolded with a shape computed from ``Shape`` of the
product. Outputs are compared with the original under ORT (graph optimizations off) at several shapes.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import pytest

from passes.fusion._batched_heads import fold_static_sizes, transpose_through_folds, unfold_batched_heads
from tests.passes._util import parse, session

BMM = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, 4, S, 8] q, float[B, 4, S, 8] k) => (float[B, %d, S, S] out)
  <int64[1] minus_one = {-1}, int64[1] eight = {8}, float scale = {2.828427}, int64[1] zero = {0}, int64[1] one = {1},
   int64[1] two = {2}, int64[1] three = {3}, int64[1] heads = {%d}> {
    seq = Shape <start = 2, end = 3> (q)
    fold = Concat <axis = 0> (minus_one, seq, eight)
    qf = Reshape(q, fold)
    kf = Reshape(k, fold)
    kt = Transpose <perm = [0, 2, 1]> (kf)
    ks = Div(kt, scale)
    s3 = MatMul(qf, ks)
    sh = Shape(s3)
    rows = Shape <start = 0, end = 1> (q)
    s1 = Slice(sh, one, two)
    s2 = Slice(sh, two, three)
    target = Concat <axis = 0> (rows, heads, s1, s2)
    y = Reshape(s3, target)
    out = Identity(y)
}
"""


def _model(heads: int) -> ir.Model:
    """The export, annotated as symbolic shape inference annotates it (run-time shapes resolved)."""
    model = ir.serde.deserialize_model(parse(BMM % (heads, heads), check=False))
    common_passes.ShapeInferencePass()(model)
    values = {v.name: v for n in model.graph for v in n.outputs}
    batch = "B" if heads == 4 else "B_other"
    for name, dims in {
        "qf": ["B4", "S", 8],
        "kf": ["B4", "S", 8],
        "kt": ["B4", 8, "S"],
        "ks": ["B4", 8, "S"],
        "s3": ["B4", "S", "S"],
        "y": [batch, heads, "S", "S"],
    }.items():
        values[name].shape = ir.Shape(dims)
    return model


def test_unfold_batched_heads_makes_the_product_4d_and_exact_when_folds_are_the_leading_dims():
    model = _model(4)
    assert unfold_batched_heads(model) == 1
    [matmul] = [n for n in model.graph if n.op_type == "MatMul"]
    assert matmul.inputs[0].name == "q"  # the 4-D source, no fold left on the product
    assert not any(n.op_type == "Reshape" and n.outputs[0].name == "y" for n in model.graph)
    assert not any(n.op_type == "MatMul" and len(n.inputs[0].shape or ()) == 3 for n in model.graph)
    fold_static_sizes(model)
    reference, candidate = session(ir.serde.deserialize_model(parse(BMM % (4, 4), check=False))), session(model)
    for batch, seq in ((1, 3), (3, 11)):
        rng = np.random.default_rng(seq)
        feeds = {n: rng.standard_normal((batch, 4, seq, 8), dtype=np.float32) for n in ("q", "k")}
        np.testing.assert_allclose(candidate.run(None, feeds)[0], reference.run(None, feeds)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads", [2, 8])
def test_unfold_batched_heads_is_left_when_the_unfold_splits_other_heads(heads):
    """Unfolding ``[B*4, S, S]`` into ``[B', heads, S, S]`` with another head count is no 4-D product."""
    model = _model(heads)
    assert unfold_batched_heads(model) == 0
    assert [n.op_type for n in model.graph].count("Reshape") == 3


KT = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, 4, S, 8] k) => (float[B2, %d, 8, S2] out)
  <int64[1] minus_one = {-1}, int64[1] heads = {%d}> {
    seq = Shape <start = 2, end = 3> (k)
    size = Shape <start = 3, end = 4> (k)
    fold = Concat <axis = 0> (minus_one, seq, size)
    kf = Reshape(k, fold)
    kt = Transpose <perm = [0, 2, 1]> (kf)
    target = Concat <axis = 0> (minus_one, heads, size, seq)
    y = Reshape(kt, target)
    out = Identity(y)
}
"""


def _k_transposed(heads: int) -> ir.Model:
    """torch's SDPA decomposition of ``k.transpose(-2, -1)`` in a dynamo export (BridgeTower's image tower), shapes
    annotated as symbolic shape inference annotates them."""
    model = ir.serde.deserialize_model(parse(KT % (heads, heads), check=False))
    common_passes.ShapeInferencePass()(model)
    values = {v.name: v for n in model.graph for v in n.outputs}
    batch = "B" if heads == 4 else "B_other"
    for name, dims in {"kf": ["B4", "S", 8], "kt": ["B4", 8, "S"], "y": [batch, heads, 8, "S"]}.items():
        values[name].shape = ir.Shape(dims)
    return model


def test_a_transpose_of_folded_heads_unfolded_again_is_the_4d_transpose():
    model = _k_transposed(4)
    assert transpose_through_folds(model) == 1
    assert [(n.op_type, list(n.attributes.get_ints("perm", []))) for n in model.graph] == [
        ("Transpose", [0, 1, 3, 2]),
        ("Identity", []),
    ]
    reference, candidate = session(ir.serde.deserialize_model(parse(KT % (4, 4), check=False))), session(model)
    for batch, seq in ((1, 3), (3, 11)):
        feeds = {"k": np.random.default_rng(seq).standard_normal((batch, 4, seq, 8), dtype=np.float32)}
        np.testing.assert_array_equal(candidate.run(None, feeds)[0], reference.run(None, feeds)[0])


def test_a_transpose_of_folded_heads_unfolded_to_other_heads_stays():
    model = _k_transposed(2)
    assert transpose_through_folds(model) == 0
    assert [n.op_type for n in model.graph].count("Reshape") == 2
