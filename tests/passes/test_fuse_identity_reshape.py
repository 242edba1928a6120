"""A Reshape to its own input's shape is dropped before fusion (``_identity_reshape``).

TorchScript's SDPA export reshapes the attention output to ``[B, -1, S, d]`` from three other tensors'
shapes; kept, it stopped onnxscript's MHA rule at the SDPA and left a Reshape/Transpose chain after
``MultiHeadAttention`` that ORT does not cancel. Numerics are checked against the original with graph
optimizations off, at shapes other than the export's."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from passes._infra import op_histogram
from passes.fusion import _symbolic_shapes, fuse_transformer
from passes.fusion._identity_reshape import drop_identity_reshapes
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, session
from tests.passes.test_fuse_torchscript_attention import LAYERS, assert_same_as_export

# y1: a[B,H,S,D] reshaped to (Shape(a)[0], -1, Shape(q)[2], Shape(q)[3]): its own shape, where q is a's
# transpose-free twin (a = q * 2); y2: the same target read from a transposed tensor, a real reshape
# ([B,H,S,D] -> [B,S,H,D] read as such) unless H == S; out: a graph output kept by name.
IDENTITY = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, H, S, D] q) => (float[B, H, S, D] y1, float[B, S, H, D] y2, float[B, H, S, D] out) {
    two = Constant <value = float {2.0}> ()
    a = Mul(q, two)
    i0 = Constant <value = int64[1] {0}> ()
    i2 = Constant <value = int64[1] {2}> ()
    i3 = Constant <value = int64[1] {3}> ()
    m1 = Constant <value = int64[1] {-1}> ()
    sa = Shape(a)
    sq = Shape(q)
    b = Gather <axis = 0> (sa, i0)
    s = Gather <axis = 0> (sq, i2)
    d = Gather <axis = 0> (sq, i3)
    target = Concat <axis = 0> (b, m1, s, d)
    r1 = Reshape(a, target)
    y1 = Add(r1, two)
    t = Transpose <perm = [0, 2, 1, 3]> (a)
    st = Shape(t)
    h = Gather <axis = 0> (st, i2)
    target2 = Concat <axis = 0> (b, m1, h, d)
    r2 = Reshape(a, target2)
    y2 = Add(r2, two)
    out = Reshape(a, target)
}
"""


def _with_symbolic_shapes(proto: onnx.ModelProto) -> ir.Model:
    model = ir.serde.deserialize_model(_symbolic_shapes.infer(proto, {}))
    common_passes.ShapeInferencePass()(model)
    return model


def test_identity_reshape_dropped_when_symbolic_shapes_prove_it_and_kept_otherwise():
    proto = onnx.parser.parse_model(IDENTITY)
    onnx.checker.check_model(proto, full_check=True)
    model = _with_symbolic_shapes(proto)
    assert drop_identity_reshapes(model) == 1
    reshapes = [n for n in model.graph if n.op_type == "Reshape"]
    assert {n.outputs[0].name for n in reshapes} == {"r2", "out"}  # the real reshape and the graph output
    add = next(n for n in model.graph if n.outputs[0].name == "y1")
    assert add.inputs[0].name == "a"
    reference, candidate = session(ir.serde.deserialize_model(proto)), session(model)
    for shape in ((1, 4, 5, 8), (3, 2, 7, 4), (2, 6, 6, 3)):
        q = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
        for want, got in zip(reference.run(None, {"q": q}), candidate.run(None, {"q": q}), strict=True):
            assert got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_identity_reshape_kept_when_a_dim_is_unknown():
    proto = onnx.parser.parse_model(IDENTITY)
    model = ir.serde.deserialize_model(proto)  # no symbolic inference: the Reshapes' outputs have no shape
    assert drop_identity_reshapes(model) == 0


def test_fuse_transformer_absorbs_merge_of_heads_when_torchscript_sdpa_export(monkeypatch):
    name = "ts_bert_sdpa"
    result = FuseTransformer({"engines": ["onnxscript"]})(ir.load(MODELS / f"{name}.onnx"))
    ops = op_histogram(result.model)
    assert result.notes["candidates"]["onnxscript"]["identity_reshapes"] >= LAYERS
    assert ops["com.microsoft::Attention"] == LAYERS
    assert "Transpose" not in ops  # the op's [B, S, h*d] output feeds the output projection directly
    assert_same_as_export(name, result.model)

    # without the drop (the onnxscript engine called directly: the pass replays a model it has seen), the same
    # model kept a Transpose chain after every MultiHeadAttention
    monkeypatch.setattr(fuse_transformer, "drop_identity_reshapes", lambda model: 0)
    before = Counter(
        n.op_type for n in fuse_transformer._onnxscript(onnx.load(MODELS / f"{name}.onnx"), {}, "mha").graph.node
    )
    assert before["MultiHeadAttention"] == LAYERS
    assert before["Transpose"] >= 2 * LAYERS and before["Reshape"] > ops["Reshape"]
