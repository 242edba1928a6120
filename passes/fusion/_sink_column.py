"""Attention sinks written as a softmax column (issue 17, OpenAI's privacy filter): read for the report, and the
exact rewrite that would let MultiHeadAttention take them, measured slower and so not applied by any pass.

A sink is a per-head score that takes part in each row's softmax and whose probability is thrown away. transformers'
GPT-OSS-style attention writes it as a column of the scores::

    probs = Softmax(Concat(q @ k^T * scale + mask, sink) - max)[..., :-1];  out = probs @ v

GroupQueryAttention takes such a sink (``head_sink``; fuse_gqa), but only causal; a bidirectional model (the
privacy filter: a band of 128 either way) has no fused kernel with a sink input. The column is one more key whose
score is the sink and whose value is zero: with ``k' = Concat(k, 0)`` and ``v' = Concat(v, 0)`` on the key axis,
``q @ k'^T * scale`` is the old scores with a zero column, the sink goes into that column of the mask, and
``Softmax(.) @ v'`` is ``out`` (the zero value row drops the sink's share, as the Slice did); the row's max the export
subtracts changes no softmax and is dropped. So written (``as_extra_key``), fuse_transformer's rules fuse it as
MultiHeadAttention with an ``attention_bias`` of ``[B, H, S, T + 1]``, exact, but the kernel then takes the slow
path of a full bias, and the bias is materialized per layer: at hidden 512, 8 heads of 64, one thread, ORT's
profile put 6.95 ms in the attention fused against 4.79 unfused at 128 tokens, and 43.9 against 28.4 at 512
(``python -m bench.sink_attention_ab``). ``is_sink_column`` lets the report name the layer and the measurement
(``_layer_reasons``).
"""

from __future__ import annotations

import onnx_ir as ir

from passes._match import const_ints, is_constant
from passes.fusion._rotary_eval import int_attr
from passes.fusion._rotary_interleaved import _producer

_ONNX = ("", "ai.onnx")


def _only_use(value: ir.Value) -> ir.Node | None:
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 else None


def _last_axis(node: ir.Node) -> bool:
    """The node's ``axis`` is the last of a rank-4 tensor's."""
    return int_attr(node, "axis", -1) in (-1, 3)


def _scores_matmul(value: ir.Value) -> ir.Node | None:
    """The ``MatMul(q, Transpose(k, [0, 1, 3, 2]))`` under ``value`` through Mul and Div by constants."""
    while (node := _producer(value, "Mul", "Div", "MatMul")) is not None and node.op_type != "MatMul":
        constant = [i for i in node.inputs if i is not None and is_constant(i)]
        if len(constant) != 1 or _only_use(node.inputs[0] if node.inputs[1] is constant[0] else node.inputs[1]) is None:
            return None
        value = node.inputs[0] if node.inputs[1] is constant[0] else node.inputs[1]  # type: ignore[assignment]
    if node is None or _only_use(node.outputs[0]) is None:
        return None
    transpose = _producer(node.inputs[1], "Transpose")
    if transpose is None or list(transpose.attributes.get_ints("perm", [])) != [0, 1, 3, 2]:
        return None
    return node


class _Sink:
    """One attention whose sink is a column of its scores, read."""

    def __init__(self, softmax: ir.Node) -> None:
        self.softmax = softmax
        x = softmax.inputs[0]
        sub = _producer(x, "Sub")
        concat = _producer(sub.inputs[0] if sub is not None else x, "Concat")
        if sub is not None:
            reduce = _producer(sub.inputs[1], "ReduceMax")
            if reduce is None or concat is None or reduce.inputs[0] is not concat.outputs[0]:
                raise LookupError
            if int_attr(reduce, "keepdims", 1) != 1 or (
                len(reduce.inputs) > 1 and const_ints(reduce.inputs[1]) not in ([-1], [3])
            ):
                raise LookupError
        if concat is None or len(concat.inputs) != 2 or not _last_axis(concat) or not _last_axis(softmax):
            raise LookupError
        self.concat = concat
        scores, self.column = concat.inputs
        add = _producer(scores, "Add")
        self.matmul = _scores_matmul(scores) if add is None else None
        self.add, self.mask = None, None
        if add is not None:
            for chain, mask in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
                if (found := _scores_matmul(chain)) is not None:
                    self.matmul, self.add, self.mask = found, add, mask
                    break
        if _only_use(scores) is not concat:
            raise LookupError
        # what the rewrite needs beyond the column: the scores' MatMul(q, Transpose(k)), typed values
        self.key = self.matmul.inputs[1].producer().inputs[0] if self.matmul is not None else None  # type: ignore[union-attr]
        # the probabilities, float Casts looked through, lose the last column, then multiply v
        node = _only_use(softmax.outputs[0])
        while node is not None and node.op_type == "Cast" and node.domain in _ONNX:
            node = _only_use(node.outputs[0])
        if node is None or node.op_type != "Slice" or node.domain not in _ONNX or len(node.inputs) < 4:
            raise LookupError
        ends, axes = const_ints(node.inputs[2]), const_ints(node.inputs[3])
        steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
        if const_ints(node.inputs[1]) != [0] or ends != [-1] or axes not in ([-1], [3]) or steps != [1]:
            raise LookupError
        self.slice = node
        after = _only_use(node.outputs[0])
        while after is not None and after.op_type == "Cast" and after.domain in _ONNX:
            after = _only_use(after.outputs[0])
        if after is None or after.op_type != "MatMul" or after.domain not in _ONNX:
            raise LookupError
        self.context = after
        # the zero rows take the key's and value's types, the mask the column's
        typed = all(v is not None and v.dtype is not None for v in (self.key, after.inputs[1], self.column))
        self.rewritable = self.matmul is not None and typed


def _zero_row(graph: ir.Graph, at: ir.Node, value: ir.Value, name: str) -> ir.Value:
    """``Concat(value, zeros, axis=2)``: one zero row on the key axis of a rank-4 ``value``, inserted before ``at``."""
    head = ir.node("Shape", [value], {"start": 0, "end": 2}, name=f"{name}/heads")
    tail = ir.node("Shape", [value], {"start": 3, "end": 4}, name=f"{name}/width")
    one = ir.node("Constant", [], {"value": ir.tensor([1], dtype=ir.DataType.INT64)}, name=f"{name}/one")
    joined = ir.node("Concat", [head.outputs[0], one.outputs[0], tail.outputs[0]], {"axis": 0}, name=f"{name}/rows")
    zero = ir.tensor([0], dtype=value.dtype)  # type: ignore[arg-type]
    zeros = ir.node("ConstantOfShape", [joined.outputs[0]], {"value": zero}, name=f"{name}/zeros")
    padded = ir.node("Concat", [value, zeros.outputs[0]], {"axis": 2}, name=f"{name}/padded")
    for node in (head, tail, one, joined, zeros, padded):
        graph.insert_before(at, node)
    padded.outputs[0].dtype = value.dtype
    if value.shape is not None and value.shape.rank() == 4:  # the attention rules bind the key length by its dims
        padded.outputs[0].shape = ir.Shape([*value.shape[:2], _plus_one(value.shape[2]), value.shape[3]])
    return padded.outputs[0]


def _plus_one(dim: int | ir.SymbolicDim) -> int | ir.SymbolicDim:
    """One more than ``dim``: the same name for the same length, so padded keys and values still agree."""
    if isinstance(dim, int):
        return dim + 1
    return ir.SymbolicDim(None if dim.value is None else f"{dim.value} + 1")


def is_sink_column(softmax: ir.Node) -> bool:
    """Whether ``softmax`` is an attention whose sink is a column of its scores (module docstring)."""
    try:
        _Sink(softmax)
    except LookupError:
        return False
    return True


_LAYOUT = ("Expand", "Reshape", "Unsqueeze", "Squeeze", "Transpose", "Cast", "Tile", "Identity")


def sink_computed(softmax: ir.Node) -> bool:
    """Whether the sink column of ``softmax`` (an ``is_sink_column`` attention) is computed from activations, as
    Inkling 2's per-token ``sink_proj(hidden)``, rather than laid out from one learned logit per head."""
    value = _Sink(softmax).column
    while (node := value.producer() if value is not None else None) is not None and node.op_type in _LAYOUT:
        value = node.inputs[0]
    return value is not None and not is_constant(value) and not value.is_initializer()


def as_extra_key(model: ir.Model) -> int:
    """Every attention of ``model`` whose sink is a softmax column rewritten with the sink as one more key
    (module docstring); returns how many."""
    graph = model.graph
    found = []
    for node in graph:
        if node.op_type == "Softmax" and node.domain in _ONNX:
            try:
                sink = _Sink(node)
            except LookupError:
                continue
            if sink.rewritable:
                found.append(sink)
    for i, sink in enumerate(found):
        name = f"{sink.softmax.name or 'softmax'}/sink_key_{i}"
        assert sink.matmul is not None and sink.key is not None  # rewritable
        key = _zero_row(graph, sink.matmul, sink.key, f"{name}/key")
        transpose = sink.matmul.inputs[1].producer()
        assert transpose is not None
        transpose.replace_input_with(0, key)
        value = sink.context.inputs[1]
        assert value is not None
        sink.context.replace_input_with(1, _zero_row(graph, sink.context, value, f"{name}/value"))
        # the mask over [B, H, S, T] (broadcast from its own shape) with the sink's column beside it
        target = ir.node("Shape", [sink.column], {"start": 0, "end": 3}, name=f"{name}/bias_rows")
        keys = ir.node("Shape", [sink.key], {"start": 2, "end": 3}, name=f"{name}/bias_keys")
        full = ir.node("Concat", [target.outputs[0], keys.outputs[0]], {"axis": 0}, name=f"{name}/bias_shape")
        nodes = [target, keys, full]
        if sink.mask is not None:
            wide = ir.node("Expand", [sink.mask, full.outputs[0]], name=f"{name}/mask")
        else:
            zero = ir.tensor([0], dtype=sink.column.dtype or ir.DataType.FLOAT)  # type: ignore[union-attr]
            wide = ir.node("ConstantOfShape", [full.outputs[0]], {"value": zero}, name=f"{name}/mask")
        bias = ir.node("Concat", [wide.outputs[0], sink.column], {"axis": -1}, name=f"{name}/bias")
        nodes += [wide, bias]
        if sink.add is not None:
            position = list(sink.add.inputs).index(sink.mask)
            for node in nodes:
                graph.insert_before(sink.add, node)
            sink.add.replace_input_with(position, bias.outputs[0])
            scores = sink.add.outputs[0]
        else:
            scores_in = sink.concat.inputs[0]
            add = ir.node("Add", [scores_in, bias.outputs[0]], name=f"{name}/scores")
            for node in (*nodes, add):
                graph.insert_before(sink.concat, node)
            scores = add.outputs[0]
        if sink.column.shape is not None and key.shape is not None and sink.column.shape.rank() == 4:
            scores.shape = ir.Shape([*sink.column.shape[:3], key.shape[2]])
            sink.softmax.outputs[0].shape = scores.shape
        sink.softmax.replace_input_with(0, scores)
        sliced = sink.slice.outputs[0]
        ir.convenience.replace_all_uses_with(sliced, sink.slice.inputs[0])
    if found:
        ir.passes.common.RemoveUnusedNodesPass()(model)
        graph.sort()  # the sink's column may be computed after the scores' Add that now reads it
    return len(found)
