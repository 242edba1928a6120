"""ORT's symbolic shape inference survives a Slice whose end is a ``floor`` of a symbolic length.

SEW (issue 17, held-out probe: bench/heldout_vision_audio.py) slices its pooled states and its positional
convolution to their common length, ``floor`` of the sample count after seven strided convolutions and a pool.
ORT's Slice inference cannot tell whether such an end is >= 0 and its last attempt asserts (AssertionError,
"Expected a sum of two arguments") where its caller catches only TypeError: the whole inference stopped, the
heads dims of the TorchScript exports stayed unknown and neither attention fused (0/2; the dynamo export, with
static reshapes, fused 2/2). The Slice now gets a fresh symbol on each sliced axis, what ORT gives a Slice whose
bounds it cannot read. ``heldout_sew_ts_eager.onnx`` is ``python -m bench.heldout_vision_audio --only sew
--exporters ts_eager`` (2 layers, hidden 32, 4 heads, squeeze factor 2). Compared with the original under ORT
with graph optimizations off, on sample counts other than the export's.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from passes._infra import PassContext, op_histogram
from passes.fusion._symbolic_gqa import infer_shapes
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._util import MODELS, parse, session

LAYERS = 2

# a stride-2 convolution makes the length floor(L/2 - 3/2) + 1, halved by the shape arithmetic of a pool:
# floor(floor(L/2 - 3/2)/2 + 1/2), whose sign sympy cannot tell; x is sliced to it, as SEW trims its branches
SLICED = """
<ir_version: 9, opset_import: ["" : 17]>
g (float[B, 4, L] x) => (float[B, 4, N] y)
  <float[4, 4, 3] w = {%s}, int64[1] two = {2}, int64[1] three = {3}, int64[1] zero = {0}> {
    c = Conv <kernel_shape = [3], strides = [2]> (x, w)
    shape = Shape(c)
    length = Slice(shape, two, three)
    n = Div(length, two)
    y = Slice(x, zero, n, two)
}
"""


def test_inference_completes_when_a_slice_ends_at_a_floor_of_the_length():
    model = parse(SLICED % ", ".join(["0.1"] * 48))
    inferred = infer_shapes(model, auto_merge=True)  # raised AssertionError inside ORT's _infer_Slice
    shapes = {v.name: v.type.tensor_type.shape for v in [*inferred.graph.value_info, *inferred.graph.output]}
    dims = shapes["y"].dim
    assert len(dims) == 3 and dims[1].dim_value == 4
    assert "Min(" in dims[2].dim_param and "floor(" in dims[2].dim_param  # min(end, L), not L
    got = session(ir.serde.deserialize_model(model)).run(None, {"x": np.ones((2, 4, 11), np.float32)})[0]
    assert got.shape == (2, 4, 2)  # (11 - 3) // 2 + 1 = 5 frames, halved


@pytest.mark.parametrize("name", ["heldout_sew_ts_eager", "heldout_sew_dynamo"])
def test_sew_attention_fuses_when_its_lengths_pass_through_floors(name: str):
    rng = np.random.default_rng(0)
    # the job's own input sets (2640, 5200, 10320 samples); the minimum of the feature encoder alone (400
    # samples, one frame) leaves SEW's pool no frame, which the original model cannot run either
    samples = [{"input_values": rng.standard_normal((b, n), dtype=np.float32)} for b, n in ((1, 2640), (2, 5200))]
    result = FuseTransformer({"engines": ["onnxscript"]})(
        ir.load(MODELS / f"{name}.onnx"), PassContext(samples=samples)
    )
    ops = op_histogram(result.model)
    assert result.notes["candidates"]["onnxscript"]["verified"] is True
    fused = ops["com.microsoft::MultiHeadAttention"] + ops["com.microsoft::Attention"]
    assert result.counts["fused_attention"] == LAYERS and fused == LAYERS
    assert "Softmax" not in ops
    reference, candidate = session(str(MODELS / f"{name}.onnx")), session(result.model)
    # 720: two frames after the stack, one after the pool; odd counts: the pooled and positional lengths
    # differ and are trimmed
    for batch, samples in ((1, 720), (2, 3203), (3, 7 * 320 + 3), (1, 16001)):
        feeds = {"input_values": rng.standard_normal((batch, samples), dtype=np.float32)}
        want, got = reference.run(None, feeds)[0], candidate.run(None, feeds)[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{batch}x{samples}")


@pytest.mark.parametrize("name", ["heldout_sew_ts_eager", "heldout_sew_dynamo"])
def test_committed_sew_export_holds_its_attention_and_its_pool(name: str):
    model = onnx.load(str(MODELS / f"{name}.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Softmax") == LAYERS and "AveragePool" in ops  # the squeeze the floors come from
