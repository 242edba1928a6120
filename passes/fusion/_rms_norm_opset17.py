"""RMS normalization as the TorchScript exporter writes it at opset 17, fused like onnxscript's own rule does.

onnxscript's ``rms_normalization`` rule (0.7.2) reads ``ReduceMean`` with its axes as an input (opset 18) and
the inverse root as ``Reciprocal``. ``torch.onnx.export(dynamo=False, opset_version=17)`` writes Llama's and
T5's ``x * rsqrt(mean(x^2) + eps) * weight`` with the axes as an attribute and ``rsqrt`` as ``Div(1, Sqrt)``,
so no RMS norm fused, and with none the residual + norm (``skip_rms_normalization``) could not fuse either::

    x --Pow(2)--ReduceMean(axes=[-1])--Add(eps)--Sqrt--Div(1, .)--Mul(x, .)--Mul(weight)-->
    ==>  SimplifiedLayerNormalization(x, weight, axis=-1, epsilon=eps)

The op is emitted in the ONNX domain exactly as onnxscript's rule emits it (``_rms_norm`` writes the leftovers
back as standard ops, since ONNX has no schema for it). Exact up to ORT's kernel summing in another order.
The same-type ``Cast`` nodes the exporter puts around the statistics are matched and dropped only where they
cast to the input's own type. Built with onnxscript's exported pattern API.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE})


def _scalar(value: ir.Value | None) -> float | None:
    tensor = value.const_value if value is not None else None
    if tensor is None or tensor.size != 1:
        return None
    return float(tensor.numpy().reshape(-1)[0])


class RmsNormOpset17(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, weight_first: bool) -> None:
        super().__init__(name)
        self._weight_first = weight_first  # Mul(weight, normed) (Llama, T5) or Mul(normed, weight)

    def pattern(self, op, x, weight, epsilon, one):
        cast = pattern.OrValue([op.Cast(x, _outputs=["cast_in"]), x])
        mean = op.ReduceMean(op.Pow(cast, 2.0), _allow_other_attributes=True, _outputs=["mean"])
        inverse = op.Div(one, op.Sqrt(op.Add(mean, epsilon)))
        normed = op.Mul(cast, inverse)
        normed = pattern.OrValue([op.Cast(normed, _outputs=["cast_out"]), normed])
        return op.Mul(weight, normed) if self._weight_first else op.Mul(normed, weight)

    def check(self, context, x: ir.Value, weight: ir.Value, **rest):
        result = pattern.MatchResult()
        epsilon, one, mean = rest["epsilon"], rest["one"], rest["mean"]
        if x.dtype not in _FLOATS:
            return result.fail(f"input of type {x.dtype}, expected float or double", x)
        if weight.dtype != x.dtype:
            return result.fail("the weight's type differs from the input's", weight)
        for cast in ("cast_in", "cast_out"):
            value = rest.get(cast)
            if value is not None and value.dtype != x.dtype:
                return result.fail(f"a Cast to {value.dtype}: the statistics are computed in another precision", value)
        if _scalar(one) != 1.0:
            return result.fail("Div(c, Sqrt(..)) with c != 1 is not an inverse root", one)
        if _scalar(epsilon) is None:
            return result.fail("epsilon is not a constant scalar", epsilon)
        reduce = mean.producer()
        axes = reduce.attributes.get_ints("axes", None)
        rank = x.shape.rank() if x.shape is not None else None
        if len(reduce.inputs) > 1 or axes is None or len(axes) != 1:
            return result.fail("ReduceMean without one axes attribute (the opset 18 form is onnxscript's rule)", mean)
        if axes[0] != -1 and (rank is None or axes[0] != rank - 1):
            return result.fail(f"ReduceMean over axis {axes[0]}, not the last one", mean)
        if not reduce.attributes.get_int("keepdims", 1):
            return result.fail("ReduceMean drops the reduced axis", mean)
        return result

    def rewrite(self, op, x, weight, epsilon, **_):
        return op.SimplifiedLayerNormalization(x, weight, axis=-1, epsilon=_scalar(epsilon), stash_type=x.dtype.value)


# onnxscript's commute cannot copy a pattern holding an untagged OrValue: the two Mul orders are two rules.
rules = pattern.RewriteRuleSet(
    [RmsNormOpset17.rule("RmsNormOpset17WeightFirst", True), RmsNormOpset17.rule("RmsNormOpset17WeightLast", False)]
)
