"""constant_folding: ``Gather(Shape(x), i)`` with a scalar ``i`` folds when dim ``i`` of ``x`` is static.

torch exports ``x.size(i)`` / ``x.shape[i]`` as that pair; where the other dims are dynamic onnxscript's
folder left it (it folds only 1-D indices), and the chain kept its producer computed: GPT-NeoX's partial
rotary (``q[..., : cos.shape[-1]]``) kept a Cos alive after fuse_rotary (issue 17, held-out decoders).
"""

from __future__ import annotations

from passes.cleanup.constant_folding import ConstantFolding
from tests.numerics import assert_equivalent
from tests.passes._util import apply, checked, ops, parse

MODEL = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, S, 4] x) => (float[M, 4] y, float[N, K] z, float[N, S, 4] w, float[N, K] v) {
        shape = Shape(x)
        last = Constant <value = int64 {-1}> ()
        d = Gather <axis = 0> (shape, last)
        zero = Constant <value = int64[1] {0}> ()
        du = Unsqueeze(d, zero)
        minus = Constant <value = int64[1] {-1}> ()
        target = Concat <axis = 0> (minus, du)
        y = Reshape(x, target)
        tail = Shape <start = 1> (x)
        one = Constant <value = int64 {1}> ()
        d2 = Gather <axis = 0> (tail, one)
        first = Constant <value = int64 {0}> ()
        n = Gather <axis = 0> (shape, first)
        nu = Unsqueeze(n, zero)
        target2 = Concat <axis = 0> (nu, minus)
        z = Reshape(x, target2)
        f = Cast <to = 1> (d2)
        w0 = Mul(x, f)
        lo = Constant <value = int64[1] {-1}> ()
        hi = Constant <value = int64[1] {9223372036854775807}> ()
        size = Slice(shape, lo, hi)
        sizef = Cast <to = 1> (size)
        root = Sqrt(sizef)
        w = Div(w0, root)
        mid = Constant <value = int64[1] {1}> ()
        lead = Slice(shape, zero, mid)
        lead_shape = Concat <axis = 0> (lead, minus)
        v = Reshape(x, lead_shape)
    }"""


def test_constant_folding_folds_a_static_dim_read_off_a_dynamic_shape() -> None:
    original = parse(MODEL)
    model, result = apply(ConstantFolding(), original)
    assert result.modified
    # dim -1 of x, dim 1 of Shape(x)[1:], and x.shape[-1:] (the SDPA head size under Sqrt)
    assert result.counts["static_dims_folded"] == 3
    # Only the batch dim N (symbolic) is still read off the shape: by one Gather and by one Slice (x.shape[:1])
    assert ops(model).get("Shape") == 1 and ops(model).get("Gather") == 1 and ops(model).get("Slice") == 1
    assert ops(model).get("Cast") is None and ops(model).get("Sqrt") is None  # folded once their input was
    shapes = [{"x": (1, 1, 4)}, {"x": (3, 5, 4)}, {"x": (2, 17, 4)}]
    assert_equivalent(original, checked(model), shapes)


def test_constant_folding_keeps_gather_of_a_symbolic_dim() -> None:
    original = parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N] y) {
            shape = Shape(x)
            first = Constant <value = int64 {0}> ()
            n = Gather <axis = 0> (shape, first)
            f = Cast <to = 1> (n)
            one = Constant <value = int64[1] {1}> ()
            s = ReduceSum <keepdims = 0> (x, one)
            y = Mul(s, f)
        }""")
    model, result = apply(ConstantFolding(), original)
    assert "static_dims_folded" not in result.counts
    assert ops(model).get("Shape") == 1 and ops(model).get("Gather") == 1
