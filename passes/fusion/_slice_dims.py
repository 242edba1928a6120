"""Forget the lengths ORT's symbolic shape inference guesses, so that no rule drops a cache crop on them.

A sliding-window decoder (Mistral) crops its cache to the window: ``past[:, :, -(W - 1):]`` into attention
and ``present[:, :, -(W - 1):]`` out. ``fuse_transformer`` first runs ORT's symbolic shape inference
(``_symbolic_shapes``), which writes two guesses into the graph as if they were facts:

- a Slice with a negative start is ``-start`` long (it assumes the input is at least that long), so the
  cropped past "is" W - 1 positions;
- GroupQueryAttention's present is as long as its past (true of its shared-buffer mode only; ``fuse_gqa``
  writes the other, where present = past + new), so the uncropped present "is" W - 1 too.

onnxscript's ``collapse_slices`` (run by its ``optimizer.optimize``) drops a Slice whose input and output
read the same shape; with both crops' ends at W - 1 the present crop "kept everything" and went. The
artifact then handed back a present one position longer than the upload's once the cache reached the window
(Mistral-shaped decoders, the window at 64 and at 4096), while every input set the pass was verified on kept
the cache below it. So each Slice that is not provably whole (starts 0, ends past any length, steps 1) gets an
unknown dim on each axis it may cut, and each GroupQueryAttention present an unknown length; ONNX's own
inference, run next, derives nothing from an unknown, and an unknown dim is never "the same shape".

The first crop, of the past into attention, is another matter: ``crop_source`` finds the uncropped cache
under it, which ``fuse_gqa`` feeds GroupQueryAttention instead where its ``local_window_size`` makes the crop
redundant (the reasoning is in ``_gqa_rewrite.rewrite_gqa``).
"""

from __future__ import annotations

import onnx_ir as ir

from passes._match import const_ints

# An end at or past this is "to the end" whatever the length (exporters write INT64_MAX or INT32_MAX).
_WHOLE_END = 2**31 - 1
_SEQUENCE_AXIS = 2  # GroupQueryAttention's present_key / present_value: [batch, kv_heads, length, head_size]


def _cut_axes(node: ir.Node, rank: int) -> list[int]:
    """The axes ``node`` (a Slice) may shorten: none when it provably keeps every one whole."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    starts, ends, axes, steps = (const_ints(v) for v in inputs[1:5])
    if inputs[3] is None:  # the default: the first len(starts) axes
        axes = list(range(len(starts))) if starts is not None else list(range(rank))
    elif axes is None:  # computed in the graph: any axis
        axes = list(range(rank))
    axes = [a % rank for a in axes]
    if starts is None or ends is None or (inputs[4] is not None and steps is None):
        return axes
    steps = steps or [1] * len(starts)
    return [a for a, s, e, t in zip(axes, starts, ends, steps, strict=False) if s != 0 or e < _WHOLE_END or t != 1]


def keeps_everything(node: ir.Node) -> bool:
    """Whether the Slice ``node`` provably keeps every axis of its input whole (``x[:, :]``); False where its
    input's rank is unknown."""
    shape = node.inputs[0].shape if node.inputs and node.inputs[0] is not None else None
    return shape is not None and not _cut_axes(node, shape.rank())


def crop_source(value: ir.Value | None, keep: int) -> ir.Value | None:
    """The graph input ``x`` (a cache) of ``value = Slice(x, [-C], [to the end], [2 | -2], [1])`` that keeps
    the last ``C >= keep`` positions of the cache axis, through single-input Concat and Identity copies
    (TorchScript copies the past once before cropping it); None for anything else."""
    node = _through_copies(value).producer() if value is not None else None
    if node is None or node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 4:
        return None
    starts, ends, axes = (const_ints(v) for v in node.inputs[1:4])
    steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
    source = _through_copies(node.inputs[0])
    rank = source.shape.rank() if source is not None and source.shape is not None else 4
    if None in (starts, ends, axes, steps) or len(starts) != 1 or [a % rank for a in axes] != [_SEQUENCE_AXIS]:
        return None
    if steps != [1] or ends[0] < _WHOLE_END or starts[0] > -keep or rank != 4:
        return None
    return source if source is not None and source.is_graph_input() else None


def _through_copies(value: ir.Value | None) -> ir.Value | None:
    node = value.producer() if value is not None else None
    while node is not None and node.domain in ("", "ai.onnx") and len(node.inputs) == 1:
        if node.op_type not in ("Identity", "Concat"):
            break
        value = node.inputs[0]
        node = value.producer() if value is not None else None
    return value


def _unknown(value: ir.Value, axes: list[int]) -> bool:
    if value.shape is None or not axes:
        return False
    dims = list(value.shape)
    for axis in axes:
        dims[axis] = ir.SymbolicDim(None)
    value.shape = ir.Shape(dims)
    return True


def forget_guesses(model: ir.Model) -> int:
    """Make the guessed lengths unknown (above); how many values it touched."""
    count = 0
    for node in model.graph:
        if node.op_type == "Slice" and node.domain in ("", "ai.onnx"):
            out = node.outputs[0]
            count += out.shape is not None and _unknown(out, _cut_axes(node, out.shape.rank()))
        elif node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft":
            for present in node.outputs[1:3]:
                rank = present.shape.rank() if present.shape is not None else 0
                count += rank > _SEQUENCE_AXIS and _unknown(present, [_SEQUENCE_AXIS])
    return count
