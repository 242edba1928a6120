"""ORT's symbolic shape inference, taught GroupQueryAttention's presents when the op has no past.

ORT 1.32's ``SymbolicShapeInference`` types GroupQueryAttention's ``present_key``/``present_value`` only by
copying the past's shape. ``fuse_gqa`` gives a decoder without a cache (a no-past export, the no-cache branch
of Optimum's merged decoder) GQA with an empty past, so those two outputs stay untyped, the inference stops
there ("Incomplete symbolic shape inference") and every value after the first attention is left without a
type or shape. ``fuse_transformer``'s onnxscript rules then cannot prove a residual RMS norm's input a float
vector over the hidden size, and on the merged Llama's no-cache branch (whose standalone graph carries no
earlier value_info, ``passes._subgraphs``) 4 of its 5 norms stayed decomposed while the cache branch fused
them all.

Without a past the kernel writes the new keys and values alone, heads first (ORT's
``group_query_attention_helper.h``: present length = max(past length, total_sequence_length))::

    present_key, present_value : [batch, kv_num_heads, L, head_size]    (k's [batch, S, kv_num_heads * head_size])

with ``L`` a fresh symbol (``total_sequence_length`` is a run-time input), so no dim is claimed equal to
another that the kernel does not make equal.

A Slice whose end ORT cannot compare with 0 stops the whole inference: its last attempt (``flatten_min``)
asserts that ``end - 0`` is a sum, which an end of ``floor(...)`` form is not, and raises AssertionError where
its caller catches only TypeError. SEW's encoder slices its pooled states and its positional convolution to
their common length, ``floor`` of a length that went through seven strided convolutions and a pool: the
inference failed, the heads dims of its TorchScript exports stayed unknown and neither attention fused. Such
a Slice keeps ``Min(end, length)`` on an axis it trims from 0 by a symbolic end (the length a dynamo export
also computes and reshapes by), and a fresh symbol on any other sliced axis, what ORT gives a Slice whose
bounds it cannot read.
The reductions whose axes became an input in opset 18 (ReduceMax, ReduceMin, ReduceL1/L2, ReduceLogSum(Exp),
ReduceSumSquare) have no rule in ORT's inference, which reads that input for ReduceSum and ReduceMean only:
ONNX's own inference, given the node alone, leaves the output without a rank, and the next op that needs one
raises. RT-DETR's TopK over a ReduceMax of its query scores (Ultralytics' export, opset 18) stopped the whole
inference there ("object of type 'NoneType' has no len()"), and none of its attentions fused. Those take
ReduceSum's rule, which is theirs by the spec (axes, keepdims, noop_with_empty_axes are the same inputs).
Everything else is ORT's inference as it is.
"""

from __future__ import annotations

import numpy as np
import onnx
import sympy
from onnx import helper

# As ORT's transformers optimizer imports it (see _symbolic_shapes.infer): the module is imported lazily, by it.
from onnxruntime.transformers.shape_infer_helper import SymbolicShapeInference

_PAST_KEY, _KEY = 3, 1


# Reductions that read their axes from input 1 from opset 18 on, and that ORT's inference has no rule for.
_AXES_INPUT_REDUCTIONS = (
    "ReduceMax",
    "ReduceMin",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceSumSquare",
)


class _GqaPresents(SymbolicShapeInference):
    """GroupQueryAttention's presents without a past; a Slice whose end ORT's proof cannot read; the opset-18
    reductions ORT has no rule for."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        for op in _AXES_INPUT_REDUCTIONS:
            self.dispatcher_.setdefault(op, self._reduce_by_axes_input)

    def _reduce_by_axes_input(self, node: onnx.NodeProto) -> None:
        opset = next((o.version for o in self.out_mp_.opset_import if o.domain in ("", "ai.onnx")), 0)
        if opset >= 18 and len(node.input) > 1 and node.input[1]:
            self._infer_ReduceSum(node)

    def _infer_GroupQueryAttention(self, node: onnx.NodeProto) -> None:  # ORT dispatches on this name
        super()._infer_GroupQueryAttention(node)
        if len(node.input) > _PAST_KEY and node.input[_PAST_KEY]:
            return  # ORT copies the past's shape
        if len(node.input) <= _KEY or not node.input[_KEY]:
            return  # packed QKV: the head size is not k's alone
        key = self._get_shape(node, _KEY)
        kv_heads = next((a.i for a in node.attribute if a.name == "kv_num_heads"), 0)
        if key is None or len(key) != 3 or not isinstance(key[2], int) or kv_heads <= 0 or key[2] % kv_heads:
            return
        dtype = self.known_vi_[node.input[0]].type.tensor_type.elem_type
        for index in (1, 2):
            if len(node.output) <= index or not node.output[index]:
                continue
            length = str(self._new_symbolic_dim_from_output(node, index, 2))
            shape = [key[0], kv_heads, length, key[2] // kv_heads]
            self.known_vi_[node.output[index]].CopyFrom(helper.make_tensor_value_info(node.output[index], dtype, shape))

    def _infer_Slice(self, node: onnx.NodeProto) -> None:  # ORT dispatches on this name
        try:
            super()._infer_Slice(node)
        except AssertionError:
            if self._get_shape(node, 0) is None:
                raise  # no shape to keep: ORT's failure stands
            self._slice_unread(node)

    def _slice_unread(self, node: onnx.NodeProto) -> None:
        shape = self._get_sympy_shape(node, 0)
        starts, ends, axes, steps = (
            self._try_get_value(node, i) if len(node.input) > i and node.input[i] else None for i in (1, 2, 3, 4)
        )
        starts, ends, steps = (None if v is None else list(np.atleast_1d(v)) for v in (starts, ends, steps))
        if axes is not None:
            axes = [int(a) % len(shape) for a in np.atleast_1d(axes)]
        elif starts is not None:
            axes = list(range(len(starts)))
        # axes left unread (computed at run time, or opset <= 9 attributes) mean every axis may be sliced
        for k, axis in enumerate(range(len(shape)) if axes is None else axes):
            start = starts[k] if starts is not None and k < len(starts) else None
            end = ends[k] if ends is not None and k < len(ends) else None
            step = steps[k] if steps is not None and k < len(steps) else 1
            if start == 0 and step == 1 and isinstance(end, sympy.Expr) and not end.is_number:
                # x[:end] keeps min(end, length) rows. The same expression, not a fresh symbol: a dynamo
                # export computes the trimmed length once and reshapes by that value (SEW's heads split is
                # [batch, Min(...), -1, 8]), so only this keeps its heads dim a constant.
                shape[axis] = sympy.Min(end, shape[axis])
            else:
                shape[axis] = self._new_symbolic_dim_from_output(node, 0, axis)
        self._update_computed_dims(shape)
        dims = [int(d) if getattr(d, "is_number", isinstance(d, int)) else str(d) for d in shape]
        vi = self.known_vi_[node.output[0]]
        vi.CopyFrom(helper.make_tensor_value_info(node.output[0], vi.type.tensor_type.elem_type, dims))


def infer_shapes(proto: onnx.ModelProto, auto_merge: bool = True) -> onnx.ModelProto:
    """``SymbolicShapeInference.infer_shapes`` (which builds its own instance, so a subclass needs this copy of
    its loop), with GroupQueryAttention's presents typed without a past. Raises as ORT's does."""
    inference = _GqaPresents(2**31 - 1, auto_merge, False, 0)
    inference._preprocess(proto)
    complete = False
    while inference.run_:
        complete = inference._infer_impl()
    inference._update_output_from_vi()
    if not complete:
        raise Exception("Incomplete symbolic shape inference")  # what ORT raises: reports read its type
    return inference.out_mp_
