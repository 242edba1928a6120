"""GELU's tanh form as GPT-2 writes it (``gelu_new``) and as the TorchScript exporter writes
``F.gelu(x, approximate="tanh")``, with its bias, fused into ``com.microsoft::FastGelu``.

onnxscript's ``gelu`` rule (0.7.2) reads ``x * (0.5 * (1 + tanh(..)))``; GPT-2 (TorchScript and dynamo
exports alike) computes ``(0.5 * x) * (1 + tanh(..))``, so the rule stops at the outer Mul and only ORT's
optimizer engine fused it. This rule reads GPT-2's order and takes the projection's bias into the kernel::

    h = Add(MatMul(x, W), b)                             (b a constant vector over the last axis)
    Mul(Mul(h, 0.5), Add(Tanh(Mul(Add(h, Mul(Pow(h, 3), 0.044715)), sqrt(2/pi))), 1))
    ==>  FastGelu(MatMul(x, W), b)                        (com.microsoft; FastGelu(h) without a bias)

The TorchScript exporter's ``aten::gelu`` symbolic (``approximate="tanh"``: transformers'
``gelu_pytorch_tanh``, the activation of Gemma 1-3, StarCoder2, GPT-BigCode, and of ``nn.GELU(approximate=
"tanh")``) writes its own fixed order, constants first and the cube as two Muls::

    Mul(0.5, Mul(h, Add(1, Tanh(Mul(sqrt(2/pi), Add(h, Mul(0.044715, Mul(h, Mul(h, h)))))))))

which neither onnxscript's rule nor the GPT-2 one reads: on a decoder whose family expects no GELU (Gemma's
gated MLP is Llama-shaped) the ORT engine that would fuse it is never tried, and the Tanh chain stayed.
BLOOM's (Megatron's) factored form, ``(x * 0.5) * (1 + tanh((x * 0.79788456) * (x * 0.044715 * x + 1)))``,
was fused by neither engine.

Exact up to the kernel's rounding (``FastGelu`` evaluates the same tanh formula). The constants are checked
with a relative tolerance of 1e-4, ORT ``fusion_fastgelu``'s habit, and a mismatch names the constant and the
value found. Built with onnxscript's exported pattern API (``RewriteRuleClassBase``, ``MatchResult.fail``).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

_EXPECTED = {"half": 0.5, "three": 3.0, "cubic": 0.044715, "sqrt_2_over_pi": math.sqrt(2.0 / math.pi), "one": 1.0}
_EXPECTED["one_inner"] = 1.0  # the factored form's 1 + c * x * x


def _scalar(value: ir.Value | None) -> float | None:
    tensor = value.const_value if value is not None else None
    if tensor is None or tensor.size != 1:
        return None
    return float(tensor.numpy().reshape(-1)[0])


def _resolution(value: ir.Value) -> float:
    """Relative rounding of ``value``'s float type (half its machine epsilon); 0 for other types."""
    try:
        dtype = value.dtype.numpy() if value.dtype is not None else None
    except (TypeError, ValueError, NotImplementedError):  # a type numpy lacks
        return 0.0
    return float(np.finfo(dtype).eps) / 2 if dtype is not None and np.issubdtype(dtype, np.floating) else 0.0


def check_gelu(
    h: ir.Value, constants: dict[str, ir.Value], expected: dict[str, float], *, kernel: str, form: str
) -> pattern.MatchResult:
    """A GELU rule's check: ``h`` of a type ``kernel`` takes, each named constant a scalar within 1e-4 of its
    expected value, or within its own type's rounding (a float16 export stores sqrt(2) as 1.4140625, 1.1e-4
    off); a failure names the constant and the value found."""
    result = pattern.MatchResult()
    if h.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        return result.fail(f"input of type {h.dtype}: {kernel} takes float or float16", h)
    for name, want in expected.items():
        got = _scalar(constants[name])
        if got is None:
            return result.fail(f"{name} is not a constant scalar (expected {want:g})", constants[name])
        if not math.isclose(got, want, rel_tol=max(1e-4, _resolution(constants[name]))):
            return result.fail(f"{name} is {got:g}, expected {want:g}: not {form}", constants[name])
    return result


def _bias_split(h: ir.Value) -> tuple[ir.Value, ir.Value] | None:
    """(input, bias) when ``h = Add(y, b)`` with ``b`` a constant vector matching ``y``'s last axis."""
    producer = h.producer()
    if producer is None or producer.op_type != "Add" or producer.domain not in ("", "ai.onnx"):
        return None
    for y, b in (producer.inputs, reversed(producer.inputs)):
        if y is None or b is None or b.const_value is None or len(b.const_value.shape) != 1:
            continue
        if y.shape is not None and y.shape.rank() and y.shape[-1] == b.const_value.shape[0] and y.dtype == b.dtype:
            return y, b
    return None


class TanhGelu(pattern.RewriteRuleClassBase):
    constants: tuple[str, ...] = ("half", "three", "cubic", "sqrt_2_over_pi", "one")
    # uses of h inside the pattern: the bias moves into the kernel only when nothing else reads the Add
    inner_uses = 3

    # onnxscript binds pattern variables by parameter name: each constant is a positional parameter.
    def pattern(self, op, h, half, three, cubic, sqrt_2_over_pi, one):  # noqa: PLR0917
        inner = op.Add(h, op.Mul(op.Pow(h, three), cubic))
        return op.Mul(op.Mul(h, half), op.Add(op.Tanh(op.Mul(inner, sqrt_2_over_pi)), one))

    def check(self, context, h: ir.Value, **constants) -> pattern.MatchResult:
        expected = {name: _EXPECTED[name] for name in self.constants}
        return check_gelu(h, constants, expected, kernel="FastGelu", form="the tanh GELU")

    def rewrite(self, op, h, **_):
        split = _bias_split(h)
        if split is not None and len(h.uses()) == self.inner_uses and not h.is_graph_output():
            return op.FastGelu(*split, _domain="com.microsoft")
        return op.FastGelu(h, _domain="com.microsoft")


class TorchScriptTanhGelu(TanhGelu):
    """``aten::gelu(approximate="tanh")`` as torch's TorchScript symbolic (opset 9 on) emits it."""

    constants = ("half", "cubic", "sqrt_2_over_pi", "one")  # the cube is Mul(h, Mul(h, h)): no exponent
    inner_uses = 5  # Mul(h, h) reads h twice

    def pattern(self, op, h, half, cubic, sqrt_2_over_pi, one):  # noqa: PLR0917
        cube = op.Mul(h, op.Mul(h, h))
        inner = op.Mul(sqrt_2_over_pi, op.Add(h, op.Mul(cubic, cube)))
        return op.Mul(half, op.Mul(h, op.Add(one, op.Tanh(inner))))


class FactoredTanhGelu(TanhGelu):
    """Megatron's bias-GELU formula, ``x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))``
    (BLOOM's ``bloom_gelu_forward``), the cubic factored as x * (1 + c * x * x); both exporters keep torch's
    left-to-right products."""

    constants = ("half", "cubic", "sqrt_2_over_pi", "one", "one_inner")
    inner_uses = 4

    def pattern(self, op, h, half, cubic, sqrt_2_over_pi, one, one_inner):  # noqa: PLR0917
        inner = op.Mul(op.Mul(h, sqrt_2_over_pi), op.Add(op.Mul(op.Mul(h, cubic), h), one_inner))
        return op.Mul(op.Mul(h, half), op.Add(op.Tanh(inner), one))


rules = pattern.RewriteRuleSet([TanhGelu.rule(), TorchScriptTanhGelu.rule(), FactoredTanhGelu.rule()])
