"""RMS normalization in the forms the torch exporters write that onnxscript's rule does not read, fused like it.

onnxscript's ``rms_normalization`` rule (0.7.2) reads one form: ``ReduceMean`` with its axes as an input
(opset 18) and the inverse root as ``Reciprocal``. The exporters write more:

* ``torch.onnx.export(dynamo=False)`` writes ``rsqrt`` as ``Div(1, Sqrt)``, with the axes as an attribute at
  opset 17 (Llama, T5) and as an input at opset 18 (T5, BART-style seq2seq files exported at 18);
* ``fuse_rotary`` rewrites the dynamo exporter's ``Reciprocal`` into ``Div(1, Sqrt)`` for ORT's session
  (``_decoder_norm``), so after it a dynamo norm is the opset-18 ``Div`` form too;
* ``Reciprocal`` with the axes as an attribute (opset 17) and ``x / Sqrt(..)`` (``_rms_norm``'s own
  decomposition) are the other spellings of the same arithmetic;
* Gemma 3n writes the inverse root as ``Pow(mean + eps, -0.5)``, and its value norm has no weight at all
  (``unscaled_rules``: the kernel's scale is ones; applied after the weighted rules);
* onnxscript's own form is read too, and without the ``noop_with_empty_axes=0`` its pattern spells out (the
  default, which an exporter may omit); ours runs first, so on such a norm onnxscript's count is 0.

Without these no RMS norm fused, and with none the residual + norm (``skip_rms_normalization``) could not fuse
either::

    x --Pow(2)--ReduceMean(axes=[-1] | [-1])--Add(eps)--Sqrt--+--Div(1, .) | Reciprocal--Mul(x, .)--Mul(weight)-->
                                                              +--Div(x, .)------------------------/
    ==>  SimplifiedLayerNormalization(x, weight, axis=-1, epsilon=eps)

The op is emitted in the ONNX domain exactly as onnxscript's rule emits it (``_rms_norm`` writes the leftovers
back as standard ops, since ONNX has no schema for it). Exact up to ORT's kernel summing in another order.
A ``Cast`` before the statistics stays where it is and the norm reads its output (T5's TorchScript export
shares that Cast with the residual sum); one after them is dropped only where it casts back to the
statistics' own type; the weight must be a vector over the normalized axis (the kernel's ``scale``),
not a tensor that would broadcast otherwise. Built with onnxscript's exported pattern API.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE})


def _scalar(value: ir.Value | None) -> float | None:
    tensor = value.const_value if value is not None else None
    if tensor is None or tensor.size != 1:
        return None
    return float(tensor.numpy().reshape(-1)[0])


def _axes(reduce: ir.Node) -> list[int] | None:
    """ReduceMean's axes, from its attribute (opset < 18) or its constant second input (opset 18)."""
    if len(reduce.inputs) > 1 and reduce.inputs[1] is not None:
        tensor = reduce.inputs[1].const_value
        return None if tensor is None else [int(a) for a in tensor.numpy().reshape(-1)]
    return reduce.attributes.get_ints("axes", None)


class RmsNormForms(pattern.RewriteRuleClassBase):
    def __init__(self, name: str, weight_first: bool, axes_input: bool, unscaled: bool = False) -> None:
        super().__init__(name)
        self._weight_first = weight_first  # Mul(weight, normed) (Llama, T5) or Mul(normed, weight)
        self._axes_input = axes_input  # ReduceMean(x, axes) (opset 18) or ReduceMean(x, axes=[..]) (opset 17)
        self._unscaled = unscaled  # no weight at all (Gemma 3n's value norm): the kernel's scale is ones

    def pattern(self, op, x, weight, epsilon, one, exponent, axes):  # noqa: PLR0917 - passed by position
        # No Cast alternative before the statistics: T5's TorchScript export shares its same-type Cast with the
        # residual Add, so the Cast cannot be consumed; the norm reads the Cast's output instead, which is exact.
        square = op.Pow(x, 2.0)
        if self._axes_input:
            mean = op.ReduceMean(square, axes, _allow_other_attributes=True, _outputs=["mean"])
        else:
            mean = op.ReduceMean(square, _allow_other_attributes=True, _outputs=["mean"])
        shifted = op.Add(mean, epsilon)
        root = op.Sqrt(shifted)
        inverse = pattern.OrValue([op.Div(one, root), op.Reciprocal(root), op.Pow(shifted, exponent)])
        if self._unscaled:  # x * inverse: a pattern cannot end in a choice
            return op.Mul(x, inverse)
        normed = pattern.OrValue([op.Mul(x, inverse), op.Div(x, root)])
        normed = pattern.OrValue([op.Cast(normed, _outputs=["cast_out"]), normed])
        return op.Mul(weight, normed) if self._weight_first else op.Mul(normed, weight)

    def check(self, context, x: ir.Value, weight: ir.Value | None = None, **rest):
        result = pattern.MatchResult()
        epsilon, one, mean = rest["epsilon"], rest.get("one"), rest["mean"]
        if x.dtype not in _FLOATS:
            return result.fail(f"input of type {x.dtype}, expected float or double", x)
        if weight is not None and weight.dtype != x.dtype:
            return result.fail("the weight's type differs from the input's", weight)
        exponent = rest.get("exponent")
        if exponent is not None and _scalar(exponent) != -0.5:
            return result.fail("Pow(mean + eps, p) with p != -0.5 is not an inverse root", exponent)
        cast = rest.get("cast_out")
        if cast is not None and cast.dtype != x.dtype:
            return result.fail(f"a Cast to {cast.dtype}: the statistics are computed in another precision", cast)
        if one is not None and _scalar(one) != 1.0:
            return result.fail("Div(c, Sqrt(..)) with c != 1 is not an inverse root", one)
        if _scalar(epsilon) is None:
            return result.fail("epsilon is not a constant scalar", epsilon)
        reduce = mean.producer()
        axes = _axes(reduce)
        rank = x.shape.rank() if x.shape is not None else None
        if axes is None or len(axes) != 1:
            return result.fail("ReduceMean without one constant axis", mean)
        if axes[0] != -1 and (rank is None or axes[0] != rank - 1):
            return result.fail(f"ReduceMean over axis {axes[0]}, not the last one", mean)
        if not reduce.attributes.get_int("keepdims", 1):
            return result.fail("ReduceMean drops the reduced axis", mean)
        if self._unscaled:
            last = x.shape[-1] if x.shape is not None and x.shape.rank() else None
            if not isinstance(last, int):
                return result.fail("an unscaled norm over an axis of unknown size (the kernel's scale needs it)", x)
            return result
        if not _is_scale_vector(weight, x):
            return result.fail(f"weight of shape {weight.shape}: not a vector over the last axis of {x.shape}", weight)
        return result

    def rewrite(self, op, x, epsilon, weight=None, **_):
        if weight is None:  # the unscaled form: a scale of ones
            weight = op.Constant(value=ir.tensor(np.ones(x.shape[-1], dtype=x.dtype.numpy())))
        return op.SimplifiedLayerNormalization(x, weight, axis=-1, epsilon=_scalar(epsilon), stash_type=x.dtype.value)


def _is_scale_vector(weight: ir.Value, x: ir.Value) -> bool:
    """The weight multiplies the normalized axis only: shape [H] (or [1, .., H]), H the input's last dim where
    known. A weight with a batch or sequence extent broadcasts differently from the kernel's scale."""
    shape = weight.shape
    if shape is None or shape.rank() == 0 or any(d != 1 for d in list(shape)[:-1]):
        return False
    x_last = x.shape[-1] if x.shape is not None and x.shape.rank() else None
    last = shape[-1]
    if isinstance(last, int) or isinstance(x_last, int):
        return last == x_last
    named = getattr(last, "value", None)  # a symbolic dim: the same name, never two unknowns
    return named is not None and named == getattr(x_last, "value", None)


# onnxscript's commute cannot copy a pattern holding an untagged OrValue: each Mul order and ReduceMean form is
# its own rule.
_VARIANTS = [(first, axes_input) for axes_input in (False, True) for first in (True, False)]
rules = pattern.RewriteRuleSet(
    [
        RmsNormForms.rule(
            f"RmsNormOpset{18 if axes_input else 17}Weight{'First' if first else 'Last'}", first, axes_input
        )
        for first, axes_input in _VARIANTS
    ]
)
# Applied after ``rules``: a weighted norm's inner product matches this too, and fused alone it would leave the
# weight's Mul outside the kernel.
unscaled_rules = pattern.RewriteRuleSet(
    [RmsNormForms.rule(f"RmsNormOpset{18 if a else 17}Unscaled", False, a, unscaled=True) for a in (False, True)]
)
