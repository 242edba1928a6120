"""Constants and shape arithmetic for fuse_rotary's matcher, read without running the graph.

TorchScript writes rotate_half's split point as ``x.shape[-1] // 2`` computed at run time
(``Shape -> Gather -> Div -> Unsqueeze``) and Phi-3's rotary slice as ``cos.shape[-1]``; dynamo and
onnxscript's constant folder write the same numbers as constants, in either ``value`` or ``value_ints`` form.
``int_values`` evaluates both forms, knowing only the dims a match has established (the last dim of q/k and
of cos is the rotary dim): an unknown dim is NaN, so anything computed from one stays unknown rather than
being guessed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

_ONNX = ("", "ai.onnx")
# Integer Slice ends at or above this mean "to the end" (torch writes INT64_MAX, some exporters INT32_MAX).
SLICE_TO_END = 2**31 - 1

# Partial shapes known from the match: value -> dims, NaN where unknown.
Hints = Mapping[ir.Value, tuple[float, ...]]


def const(value: ir.Value | None) -> np.ndarray | None:
    """An initializer's or a Constant node's tensor, in any of Constant's attribute forms; else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is None or node.op_type != "Constant" or node.domain not in _ONNX:
        return None
    for key, attr in node.attributes.items():
        if key == "value":
            return attr.as_tensor().numpy()
        if key in ("value_int", "value_ints"):
            return np.array(attr.value, np.int64)
        if key in ("value_float", "value_floats"):
            return np.array(attr.value, np.float32)
    return None


def scalar(value: ir.Value | None) -> float | None:
    array = const(value)
    if array is None or array.size != 1:
        return None
    return float(array.reshape(()))


def int_attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def ints_attr(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else [int(v) for v in attr.value]


def axes_of(node: ir.Node, input_index: int = 1) -> list[int] | None:
    """Unsqueeze/Squeeze/ReduceMean axes: an input since opset 13 (18 for ReduceMean), an attribute before."""
    if len(node.inputs) > input_index and node.inputs[input_index] is not None:
        array = const(node.inputs[input_index])
        return None if array is None else [int(v) for v in array.reshape(-1)]
    return ints_attr(node, "axes")


def _shape_of(value: ir.Value, hints: Hints) -> np.ndarray | None:
    if value in hints:
        return np.array(hints[value], np.float64)
    if value.shape is None:
        return None
    return np.array([d if isinstance(d, int) else np.nan for d in value.shape], np.float64)


def int_values(value: ir.Value | None, hints: Hints, depth: int = 12) -> np.ndarray | None:
    """The integer tensor ``value`` holds (float64, NaN where it depends on an unknown dim); None when its
    computation uses an op this does not follow."""
    if value is None or depth == 0:
        return None
    array = const(value)
    if array is not None:
        return array.astype(np.float64) if array.dtype.kind in "iuf" else None
    node = value.producer()
    if node is None or node.domain not in _ONNX:
        return None
    op = node.op_type

    def arg(i: int) -> np.ndarray | None:
        return int_values(node.inputs[i], hints, depth - 1) if i < len(node.inputs) else None

    if op == "Shape":
        shape = _shape_of(node.inputs[0], hints) if node.inputs[0] is not None else None
        if shape is None:
            return None
        start, end = int_attr(node, "start", 0), node.attributes.get("end")
        return shape[start : None if end is None else int(end.value)]
    if op in ("Cast", "Identity"):
        return arg(0)
    if op in ("Unsqueeze", "Squeeze", "Reshape", "Flatten"):
        data = arg(0)
        return None if data is None else data.reshape(-1) if data.ndim else data.reshape(1)
    if op == "Gather":
        data, index = arg(0), const(node.inputs[1])
        if index is None or int_attr(node, "axis", 0) != 0:
            return None
        if data is None:  # one dim of a shape this cannot see (an unannotated value): unknown, not unfollowable
            source = node.inputs[0].producer() if node.inputs[0] is not None else None
            known = source is not None and source.op_type == "Shape" and bool((index >= 0).all())
            return np.full(index.shape, np.nan) if known else None
        if data.ndim != 1:
            return None
        return data[index.astype(np.int64)]
    if op == "Concat":
        parts = [arg(i) for i in range(len(node.inputs))]
        if any(p is None for p in parts):
            return None
        return np.concatenate([p.reshape(-1) for p in parts if p is not None])
    if op in ("Add", "Sub", "Mul", "Div"):
        a, b = arg(0), arg(1)
        if a is None or b is None:
            return None
        with np.errstate(invalid="ignore", divide="ignore"):
            if op == "Div":  # ONNX integer Div truncates; the shapes here are non-negative
                return np.trunc(a / b)
            return {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}[op](a, b)
    return None


def one_int(value: ir.Value | None, hints: Hints) -> int | None:
    """A single known integer, else None."""
    array = int_values(value, hints)
    if array is None or array.size != 1 or not np.isfinite(array).all():
        return None
    return int(array.reshape(()))


def heads_of_split(reshape_target: ir.Value | None, data: ir.Value | None) -> tuple[int, int] | None:
    """(heads, head_size) of a head-split ``Reshape(data, [B, S, N, H])``, N = -1 resolved from data's width."""
    target = int_values(reshape_target, {})
    if target is None or target.size != 4 or not np.isfinite(target[2:]).all() or target[3] <= 0:
        return None
    heads, size = int(target[2]), int(target[3])
    if heads <= 0:
        width = last_dim(data)
        if width is None or width % size:
            return None
        heads = width // size
    return heads, size


def last_dim(value: ir.Value | None, depth: int = 6) -> int | None:
    """The static last dim of a projection's output: annotated, else the weight, bias or slice that sets it
    (TorchScript annotates no intermediate shapes; heads then follow from width / head_size)."""
    if value is None or depth == 0:
        return None
    if value.shape is not None and len(value.shape) and isinstance(value.shape[-1], int):
        return value.shape[-1]
    node = value.producer()
    if node is None or node.domain not in _ONNX:
        return None
    if node.op_type in ("MatMul", "Gemm"):
        weight = const(node.inputs[1])
        if weight is not None and weight.ndim == 2:
            return int(weight.shape[0] if int_attr(node, "transB", 0) else weight.shape[1])
    if node.op_type == "Add":
        for i in (0, 1):
            bias = const(node.inputs[i])
            if bias is not None and bias.ndim == 1 and bias.size > 1:
                return int(bias.size)
        return last_dim(node.inputs[0], depth - 1) or last_dim(node.inputs[1], depth - 1)
    if node.op_type == "Slice" and len(node.inputs) >= 4:
        start, end, axes = (const(node.inputs[i]) for i in (1, 2, 3))
        # a projection's output is [batch, sequence, width]: axis 2 is its last
        if start is None or end is None or axes is None or axes.size != 1 or int(axes.reshape(())) not in (-1, 2):
            return None
        width = last_dim(node.inputs[0], depth - 1)
        stop = int(end.reshape(()))
        stop = min(stop, width) if width is not None else stop
        return None if stop >= SLICE_TO_END else stop - int(start.reshape(()))
    if node.op_type == "Split" and int_attr(node, "axis", 0) in (-1, 2):  # GPT-2's c_attn output in q, k, v
        sizes = const(node.inputs[1]) if len(node.inputs) > 1 else None
        if sizes is None and (attr := ints_attr(node, "split")) is not None:
            sizes = np.array(attr)
        index = list(node.outputs).index(value)
        if sizes is not None:
            return int(sizes.reshape(-1)[index])
        width = last_dim(node.inputs[0], depth - 1)
        return None if width is None or width % len(node.outputs) else width // len(node.outputs)
    if node.op_type in ("Cast", "Identity"):
        return last_dim(node.inputs[0], depth - 1)
    return None
