"""constant_folding leaves no Identity of its own making behind.

onnxscript's folder rewrites a no-op (a Cast to its input's own type, a one-input Concat) to an Identity and
then bypasses it; the Identity stayed in the graph, unread, still reading the value. A rewrite rule that needs
its matched values to have no other reader then refused them: XLM's TorchScript scores, cast to float before
the Softmax, were read by such an Identity and onnxscript's SDPA rule fused no attention in the job
(tests/passes/test_fuse_expanded_where_mask.py covers the model).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.cleanup.constant_folding import ConstantFolding
from passes.cleanup.shape_inference import ShapeInference
from tests.passes._util import apply, ops, parse, session

NO_OPS = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, S] x, float[B, S] y) => (float[B, S] z, float[B, S] w) {
    c = Cast <to = 1> (x)
    s = Softmax <axis = -1> (c)
    k = Concat <axis = 1> (y)
    z = Relu(s)
    w = Neg(k)
}
"""


def test_folded_no_ops_leave_no_identity_reading_their_input():
    model, _ = apply(ShapeInference({}), parse(NO_OPS))
    folded, result = apply(ConstantFolding({}), ir.serde.serialize_model(model))
    assert result.modified
    left = ops(folded)
    assert "Identity" not in left and "Cast" not in left and "Concat" not in left, left
    for value in (v for n in folded.graph for v in n.inputs if v is not None and v.is_graph_input()):
        assert all(u.node.op_type in ("Softmax", "Neg") for u in value.uses()), [u.node.op_type for u in value.uses()]
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal((3, 7), dtype=np.float32) for k in ("x", "y")}
    reference = session(ir.serde.deserialize_model(parse(NO_OPS)))
    for want, got in zip(reference.run(None, feeds), session(folded).run(None, feeds), strict=True):
        np.testing.assert_array_equal(got, want)
