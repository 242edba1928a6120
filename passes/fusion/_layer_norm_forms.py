"""LayerNorm as an exporter writes it below opset 17, fused back into ``LayerNormalization``.

ONNX has no LayerNormalization before opset 17, so ``torch.onnx.export(opset_version=14)`` (Optimum's default
for years) writes each ``nn.LayerNorm`` out::

    x --ReduceMean(-1)--+                                      +--Mul(weight)--[Add(bias)]-->
    x ------------------Sub--+--Pow(2) | Mul(d, d)--ReduceMean(-1)--Add(eps)--Sqrt--Div(d, .)  (or Mul(d, 1/.),
                                                                                        Reciprocal or Div(1, .))
                             +--------------------------------------------------------/
    ==>  LayerNormalization(x, weight, bias or zeros, axis=-1, epsilon=eps)

Below opset 17 ``upgrade_opset`` applies ``rules``; at 17 and above ``fuse_for_ort`` applies ``rules`` then
``unbiased_rules`` (a hand-written norm in a new export: Cohere's, without a bias).

onnxscript's ``layer_normalization`` rule (0.7.2) reads the axes as an input only, wants ``keepdims=1`` spelled
out and a ``Reciprocal`` or ``Div``; the TorchScript exporter writes the axes as an attribute below opset 18 and
omits ``keepdims``. Both forms are read here (``upgrade_opset`` converts the graph to opset 17 first, where the
op exists). The statistics must be over the last axis only (``LayerNormalization(axis=-1)`` normalizes the
trailing axes from ``axis`` on), epsilon a constant scalar, weight and bias constant vectors over that axis (the
kernel's ``scale`` and ``B``), every intermediate read by the norm alone. Exact up to ORT's kernel summing in
another order. Built with onnxscript's exported pattern API (``RewriteRuleClassBase``, ``MatchResult.fail``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def _scalar(value: ir.Value | None) -> float | None:
    tensor = value.const_value if value is not None else None
    if tensor is None or tensor.size != 1:
        return None
    return float(tensor.numpy().reshape(-1)[0])


def _last_axis_only(reduce: ir.Node) -> bool:
    """The ReduceMean averages the last axis alone and keeps it (keepdims defaults to 1)."""
    if reduce.attributes.get_int("keepdims", 1) != 1:
        return False
    if len(reduce.inputs) > 1 and reduce.inputs[1] is not None:
        tensor = reduce.inputs[1].const_value
        axes = None if tensor is None else [int(a) for a in tensor.numpy().reshape(-1)]
    else:
        axes = reduce.attributes.get_ints("axes", None)
    if axes is None or len(axes) != 1:
        return False
    rank = reduce.inputs[0].shape.rank() if reduce.inputs[0].shape is not None else None
    return axes[0] == -1 or (rank is not None and axes[0] == rank - 1)


def _vector_over_last(value: ir.Value, x: ir.Value) -> bool:
    tensor = value.const_value
    if tensor is None or len(tensor.shape) != 1:
        return False
    last = x.shape[-1] if x.shape is not None and x.shape.rank() else None
    return isinstance(last, int) and tensor.shape[0] == last and value.dtype == x.dtype


class LayerNormForms(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, *, axes_input: bool, square: str, divide: str, biased: bool = True) -> None:
        super().__init__(name)
        self._biased = biased  # Add(., bias) after the weight; Cohere's norm has none
        self._axes_input = axes_input  # ReduceMean(x, axes) (opset 18) or ReduceMean(x, axes=[-1]) (below)
        self._square = square  # "pow": Pow(d, 2); "mul": Mul(d, d)
        # "div": Div(d, std); "reciprocal": Mul(d, Reciprocal(std)); "div_one": Mul(d, Div(1, std)), as fuse_rotary
        # leaves a norm whose Reciprocal(Sqrt) it turned for ORT's RMS fusion (an LN is the RMS norm of x - mean)
        self._divide = divide

    def _mean(self, op, x, axes):
        if self._axes_input:
            return op.ReduceMean(x, axes, _allow_other_attributes=True, _outputs=["mean_out"])
        return op.ReduceMean(x, _allow_other_attributes=True, _outputs=["mean_out"])

    def pattern(self, op, x, axes, axes2, two, epsilon, weight, bias, one):  # noqa: PLR0917 - bound by position
        d = op.Sub(x, self._mean(op, x, axes))
        square = op.Pow(d, two) if self._square == "pow" else op.Mul(d, d)
        if self._axes_input:
            var = op.ReduceMean(square, axes2, _allow_other_attributes=True, _outputs=["var_out"])
        else:
            var = op.ReduceMean(square, _allow_other_attributes=True, _outputs=["var_out"])
        std = op.Sqrt(op.Add(var, epsilon))
        if self._divide == "div":
            normed = op.Div(d, std)
        else:
            normed = op.Mul(d, op.Reciprocal(std) if self._divide == "reciprocal" else op.Div(one, std))
        scaled = op.Mul(normed, weight)
        return op.Add(scaled, bias) if self._biased else scaled

    def check(  # noqa: PLR0917 - onnxscript binds by name; the defaults are the variables a form may not bind
        self, context, x, epsilon, weight, mean_out, var_out, bias=None, two=None, one=None, **_
    ) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if self._divide == "div_one" and _scalar(one) != 1.0:
            return result.fail("Div(c, std) with c != 1 is not an inverse", one)
        if x.dtype not in _FLOATS:
            return result.fail(f"input of type {x.dtype}: LayerNormalization takes float types", x)
        for out in (mean_out, var_out):
            if not _last_axis_only(out.producer()):
                return result.fail("statistics not over the last axis alone (or keepdims=0)", out)
        if self._square == "pow" and _scalar(two) != 2.0:
            return result.fail(f"Pow exponent {_scalar(two)}, not 2", two)
        if _scalar(epsilon) is None:
            return result.fail("epsilon is not a constant scalar", epsilon)
        for name, value in (("weight", weight), ("bias", bias)):
            if (value is not None or self._biased) and not _vector_over_last(value, x):
                return result.fail(f"{name} is not a constant vector over the normalized axis", value)
        return result

    def rewrite(self, op, x, epsilon, weight, bias=None, **_):
        stash = ir.DataType.DOUBLE if x.dtype == ir.DataType.DOUBLE else ir.DataType.FLOAT
        if bias is None:  # a zero bias: onnxscript's skip_layer_normalization rule reads only biased norms
            bias = op.Constant(value=ir.tensor(np.zeros(x.shape[-1], dtype=x.dtype.numpy())))
        return op.LayerNormalization(x, weight, bias, axis=-1, epsilon=_scalar(epsilon), stash_type=stash)


_INVERSES = ("div", "reciprocal", "div_one")


def _rule_set(*, biased: bool) -> pattern.RewriteRuleSet:
    """One rule per ReduceMean form, square and inverse; ``commute``: Mul(weight, normed), Add(bias, .), Add(eps,
    var), as other exporters write them."""
    return pattern.RewriteRuleSet(
        [
            LayerNormForms.rule(
                f"LayerNorm{'AxesInput' if a else 'AxesAttribute'}{s.title()}{d.title().replace('_', '')}"
                f"{'' if biased else 'NoBias'}",
                axes_input=a,
                square=s,
                divide=d,
                biased=biased,
            )
            for a in (False, True)
            for s in ("pow", "mul")
            for d in _INVERSES
        ],
        commute=True,
    )


rules = _rule_set(biased=True)
# Applied after ``rules``: a biased norm's weighted product matches this too, and fused alone it would leave the
# bias's Add outside the kernel. Cohere's hand-written norm (opset 17/18 exports) has no bias; fuse_for_ort
# applies both sets so that its residual sums become SkipLayerNormalization.
unbiased_rules = _rule_set(biased=False)
