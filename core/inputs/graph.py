"""What a model's inputs are, read from the graph: the role of each input and the sizes the graph implies.

Names are a hint; the structure decides where it can: an integer input whose values index a constant table
(``Gather`` on axis 0, through casts and reshapes) is a token-id input whose vocabulary is the table's rows;
the ids the graph compares them with (``Equal`` against a constant) are special tokens, and one whose
comparison selects positions (``NonZero``, ``ArgMax``, ``GatherND``: BART's classification head gathers the
hidden state at each row's ``</s>``) must be present in every row; a float input of rank 3 or 4 that reaches
a ``Conv`` is audio, spectrogram features or pixels, whose smallest valid length the convolution stack
(kernels, strides, pads) fixes, and whose exact length a position table added after it fixes (Whisper's
encoder: 1500 positions after a stride-2 stack, so 3000 frames; ViT: 197 positions, 16-pixel patches, so
224x224); ``past_key_values.*``/``past.*`` tensors are a key/value cache whose past length is the one
symbolic dim besides the batch, heads and head size being the static dims the exporter wrote (GQA/MQA
caches simply have fewer heads there).

Encoder-decoders split as Optimum exports them (``decoder_model.onnx``, ``decoder_with_past_model.onnx``): a
float ``[batch, sequence, hidden]`` input projected by constant weights (two or more ``MatMul`` straight from
it: cross-attention keys and values) beside token ids is the encoder's states; a cache input never
concatenated with new keys while another one is (the self-attention cache grows by ``Concat``) is the fixed
cross-attention cache, whose length is the encoder's; a mask that reaches the same attention scores as
either of those spans the encoder's sequence, not the decoder's past and new tokens (``cross``).

Optimum's merged decoders (``decoder_model_merged.onnx``: one ``If`` whose branches are decoder_with_past and the
decoder) hold every node inside the branches, so the graph is read through its subgraphs (a branch reads the
outer inputs and weights by name); the bool input that is the ``If``'s condition is ``use_cache_branch``, and
the branch that reads the self-attention cache is the one its value selects.

Everything here is a small ``ModelFacts`` record: it keeps no reference to the model, so a caller may drop a
large model right after reading its facts.
"""

from __future__ import annotations

import dataclasses
import re
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

_BATCH_DIM = re.compile(r"^(n|b|bs|batch.*|.*_batch|batch_size|num_batches)$", re.IGNORECASE)
_SEQ_DIM = re.compile(r"(seq|sequence|len|length|tokens?|time|steps?)", re.IGNORECASE)
_IDS_NAME = re.compile(r"(^|_)ids$|^input_ids", re.IGNORECASE)
_MASK_NAME = re.compile(r"mask", re.IGNORECASE)
_TOKEN_TYPE_NAME = re.compile(r"token_type|segment_ids", re.IGNORECASE)
_POSITION_NAME = re.compile(r"position_ids", re.IGNORECASE)
_LABELS_NAME = re.compile(r"^labels?$|_labels?$", re.IGNORECASE)
_OFFSETS_NAME = re.compile(r"(^|_)offsets?$", re.IGNORECASE)
_LENGTHS_NAME = re.compile(r"(^|_)(lengths?|lens|seq_?lens?)$", re.IGNORECASE)
_PAST_NAME = re.compile(r"^past|past_key|past_value|\.past|cache", re.IGNORECASE)
_DECODER_NAME = re.compile(r"decoder", re.IGNORECASE)
_ALIAS_OPS = frozenset({"Cast", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose"})
# Ops a signal passes through between the convolutions of a feature encoder (norms, activations, casts).
# A norm over channels written channels-last (data2vec-audio's and ConvNeXt's LayerNorm between two
# Transposes) keeps the length axis too: without them the walk ends after the first convolution and the
# audio is sized for that one alone.
_CONV_PATH_OPS = frozenset(
    {
        "Conv", "Relu", "Gelu", "Erf", "Mul", "Add", "Div", "Sub", "Sqrt", "Pow", "Tanh", "Sigmoid", "Cast",
        "InstanceNormalization", "GroupNormalization", "BatchNormalization", "Reshape", "Unsqueeze",
        "MaxPool", "AveragePool", "LeakyRelu", "HardSwish", "Clip", "Pad", "ReduceMean",
        "Transpose", "LayerNormalization", "Elu", "Selu", "Softplus", "PRelu", "Identity", "Squeeze",
        # a waveform codec's encoder (EnCodec, DAC) crops the padded signal back to its length between its
        # reflect-padded convolutions
        "Slice",
        # an upload quantized by ORT's tools: quantize_dynamic's DynamicQuantizeLinear -> ConvInteger, and the
        # QuantizeLinear -> DequantizeLinear pairs of a QDQ model before each Conv
        "ConvInteger", "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear",
    }
)  # fmt: skip
_CONVS = frozenset({"Conv", "ConvInteger"})
_STEPS = _CONVS | {"MaxPool", "AveragePool"}  # what changes the length: read on input 0 only
_SELECTORS = frozenset({"NonZero", "ArgMax", "ArgMin", "Compress", "GatherND", "TopK"})
DEFAULT_CLASSES = 10
DEFAULT_IDS_HIGH = 100
DEFAULT_INT_HIGH = 10


@dataclasses.dataclass(frozen=True)
class ConvStep:
    """One convolution or pooling along an input's path: per spatial axis."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    pads: tuple[int, ...]  # begin..., end...
    dilation: tuple[int, ...]

    def min_input(self, out: int, axis: int) -> int:
        """The input length that gives ``out`` positions on ``axis``: the inverse of ORT's floor formula."""
        span = self.dilation[axis] * (self.kernel[axis] - 1) + 1
        pad = self.pads[axis] + self.pads[axis + len(self.kernel)]
        return max(1, (out - 1) * self.stride[axis] + span - pad)


@dataclasses.dataclass
class InputRole:
    """The role of one graph input and the evidence for it (a sentence for the report)."""

    name: str
    role: str  # token_ids, attention_mask, token_type_ids, position_ids, labels, past_key_values,
    #            pixel_values, audio, features, float, int, bool, strings, offsets, lengths
    why: str
    high: int | None = None  # exclusive upper bound of integer values (vocabulary, type table, classes)
    markers: tuple[int, ...] = ()  # ids the graph selects positions by: one per row, at its last valid token
    avoid: tuple[int, ...] = ()  # other ids the graph compares with (padding): kept out of random ids
    convs: tuple[ConvStep, ...] = ()  # the convolution stack on the input's spatial axes
    exact_out: int | None = None  # positions the stack must yield (a position table added after it)
    channels: int | None = None  # input channels of the first convolution
    past_axis: int | None = None  # the past-length axis of a key/value cache
    decoder: bool = False
    cross: bool = False  # an attention mask over the encoder's sequence (cross-attention), not past + new
    cache_value: bool = True  # use_cache_branch: the value that selects the branch reading the cache
    words: tuple[str, ...] = ()  # strings: the values drawn from

    def min_length(self, out: int = 1, axis: int = 0) -> int:
        """The spatial length on ``axis`` that makes the stack yield ``out`` positions."""
        length = out
        for step in reversed(self.convs):
            length = step.min_input(length, axis)
        return length


@dataclasses.dataclass
class ModelFacts:
    roles: dict[str, InputRole]
    max_positions: int | None  # rows of the position table, when one is found
    has_past: bool
    # A decoder-only language model (token ids, a mask, positions, a cache; a causal mask in the graph or a
    # cache): its generated sets are the calls generation makes, unpadded (``core.inputs.synthesize``).
    causal_lm: bool = False
    # A decoder reading an encoder's states or a cross-attention cache (a seq2seq decoder file): its inputs
    # over the encoder's sequence share one length, and a set after a past decodes as generation does.
    encoder_decoder: bool = False
    # Rows the graph may fold its leading axis into (X-CLIP's video tower reshapes frames to [-1, 8 frames, d]; a
    # guidance UNet halves its batch), 1 where nothing is folded. A guess after a refusal, not a rule: a head
    # count dividing a [batch x heads, ...] size reads the same.
    row_group: int = 1

    def describe(self) -> dict[str, dict[str, Any]]:
        return {name: {"role": r.role, "why": r.why} for name, r in self.roles.items()}


def _as_ir(model: onnx.ModelProto | ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(model) if isinstance(model, onnx.ModelProto) else model


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant contents: an initializer or a ``Constant`` node's tensor; else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is not None and node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
        attr = node.attributes.get("value")
        if attr is not None:
            return attr.as_tensor().numpy()
    return None


def _const_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if value.const_value is not None and value.shape is not None and all(isinstance(d, int) for d in value.shape):
        return tuple(int(d) for d in value.shape)
    array = const_array(value)
    if array is not None:
        return tuple(array.shape)
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    if node.op_type == "Gather":
        # A table's rows picked by constant indices (CLIP's vision tower adds ``position_embedding(position_ids)``,
        # a buffer of 0..n-1): the indices' shape in place of the gathered axis.
        table, indices = _const_shape(node.inputs[0]), const_array(node.inputs[1])
        if table is None or indices is None or not table:
            return None
        axis = node.attributes.get_int("axis", 0) % len(table)
        return (*table[:axis], *indices.shape, *table[axis + 1 :])
    # A constant reshaped (quantize_int4's token table reading the tied lm_head's packed weights as
    # [rows, packed columns]): the shape without the bytes.
    if node.op_type != "Reshape":
        return None
    source, target = _const_shape(node.inputs[0]), const_array(node.inputs[1])
    if source is None or target is None or node.attributes.get_int("allowzero", 0):
        return None
    dims = [source[i] if d == 0 else int(d) for i, d in enumerate(target.tolist())]
    if dims.count(-1) == 1:
        known = int(np.prod([d for d in dims if d != -1]))
        dims[dims.index(-1)] = int(np.prod(source)) // known if known else 0
    return tuple(dims) if all(d >= 0 for d in dims) else None


def _nodes(graph: ir.Graph) -> ir.traversal.RecursiveGraphIterator:
    """Every node, those of If/Loop/Scan subgraphs included (a merged decoder holds all of them in its two
    branches), each graph in order and a subgraph's nodes before the node that owns it."""
    return ir.traversal.RecursiveGraphIterator(graph)


# Ops whose output holds some of their data input's values (MusicGen's ``input_ids.view(-1, 2, S)[:, k]``: each
# codebook's ids, selected before its own table): ids still, for the table they index.
_SELECTING_OPS = frozenset({"Gather", "Slice"})


def _aliases(graph: ir.Graph, names: set[str]) -> dict[str, str]:
    """Tensor name -> the graph input it is a cast, reshape or transpose of, or a selection of its elements."""
    out = {name: name for name in names}
    for node in _nodes(graph):  # topological order
        if node.op_type in _ALIAS_OPS | _SELECTING_OPS and node.inputs and node.inputs[0] is not None:
            source = out.get(node.inputs[0].name or "")
            if source is not None and node.outputs:
                out[node.outputs[0].name or ""] = source
    return out


def _reaches(value: ir.Value, ops: frozenset[str], depth: int = 4, stop: frozenset[str] = frozenset()) -> bool:
    if depth < 0:
        return False
    for use in value.uses():
        node = use.node
        if node.op_type in ops:
            return True
        if node.op_type in stop:
            continue
        if any(_reaches(out, ops, depth - 1, stop) for out in node.outputs):
            return True
    return False


def _conv_steps(start: ir.Value, spatial: int) -> tuple[list[ConvStep], int | None, ir.Value | None]:
    """Convolutions and pools on the path from ``start`` (breadth first through ``_CONV_PATH_OPS``), in
    graph order, with the first convolution's input channels and the last step's output."""
    seen: set[int] = set()
    found: list[ir.Node] = []
    queue = deque([start])
    while queue and len(seen) < 400:
        value = queue.popleft()
        for use in value.uses():
            node = use.node
            if id(node) in seen or node.op_type not in _CONV_PATH_OPS:
                continue
            if node.op_type in _STEPS and use.idx != 0:
                continue
            seen.add(id(node))
            if node.op_type in _STEPS:
                found.append(node)
            queue.extend(node.outputs)
    steps: list[ConvStep] = []
    channels = None
    order = {id(n): i for i, n in enumerate(start.graph or [])} if start.graph is not None else {}
    found.sort(key=lambda n: order.get(id(n), 0))
    for node in found:
        weight = node.inputs[1] if node.op_type in _CONVS and len(node.inputs) > 1 else None
        wshape = _const_shape(_dequantized(weight)) if weight is not None else None
        kernel = node.attributes.get_ints("kernel_shape", None)
        if kernel is None and wshape is not None:
            kernel = wshape[2:]
        if kernel is None or len(kernel) != spatial:
            continue
        if channels is None and wshape is not None and len(wshape) > 1:
            channels = int(wshape[1]) * node.attributes.get_int("group", 1)
        one = (1,) * spatial
        steps.append(
            ConvStep(
                tuple(int(k) for k in kernel),
                tuple(int(s) for s in node.attributes.get_ints("strides", one)),
                tuple(int(p) for p in node.attributes.get_ints("pads", (0,) * 2 * spatial)),
                tuple(int(d) for d in node.attributes.get_ints("dilations", one)),
            )
        )
    last = found[-1].outputs[0] if found else None
    return steps, channels, last


def _dequantized(value: ir.Value) -> ir.Value:
    """The quantized constant behind a QDQ model's weight (``DequantizeLinear(int8 weight, scale)``): same shape."""
    node = value.producer()
    if node is not None and node.op_type == "DequantizeLinear" and node.inputs and node.inputs[0] is not None:
        return node.inputs[0]
    return value


def _table_after(value: ir.Value | None, depth: int = 8) -> int | None:
    """Rows of a constant position table added within ``depth`` ops after ``value`` (Transpose, Reshape,
    activations between, and the Concat that puts a class token before the patches: ViT's): the positions the
    preceding stack must yield."""
    if value is None:
        return None
    frontier = [value]
    for _ in range(depth):
        nxt = []
        for v in frontier:
            for use in v.uses():
                node = use.node
                if node.op_type == "Add":
                    for other in node.inputs:
                        shape = _const_shape(other) if other is not v else None
                        if shape and len(shape) >= 2 and shape[-2] > 1:
                            return int(shape[-2])
                if node.op_type in _CONV_PATH_OPS | {"Transpose", "Flatten", "Gelu", "Concat"}:
                    nxt.extend(node.outputs)
        frontier = nxt
    return None


def _compared_ids(graph: ir.Graph, aliases: dict[str, str]) -> dict[str, tuple[set[int], set[int]]]:
    """Per id input: (markers, others) among the constants it is compared with by ``Equal``."""
    out: dict[str, tuple[set[int], set[int]]] = {}
    for node in _nodes(graph):
        if node.op_type != "Equal" or len(node.inputs) != 2:
            continue
        for a, b in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
            source = aliases.get(a.name or "") if a is not None else None
            array = const_array(b)
            if source is None or array is None or array.size != 1 or array.dtype.kind not in "iu":
                continue
            markers, others = out.setdefault(source, (set(), set()))
            # A comparison that picks positions (the EOS gather) needs the id there; one feeding a CumSum
            # or a mask (RoBERTa's padding) needs it absent.
            selects = _reaches(node.outputs[0], _SELECTORS, depth=4, stop=frozenset({"CumSum"}))
            (markers if selects else others).add(int(array.reshape(-1)[0]))
    return out


def _max_positions(graph: ir.Graph, aliases: dict[str, str]) -> int | None:
    """Rows of the position table: a table gathered by indices not drawn from a token-id input (``Range``
    or ``position_ids``), or an initializer named like ``position_embeddings``/``embed_positions``."""
    sizes = []
    for node in _nodes(graph):
        if node.op_type != "Gather" or len(node.inputs) < 2 or node.attributes.get_int("axis", 0) != 0:
            continue
        table, index = node.inputs[0], node.inputs[1]
        shape = _const_shape(table)
        if not shape or len(shape) != 2 or index is None:
            continue
        lower = (table.name or "").lower()
        source = aliases.get(index.name or "")
        if "position" in lower or "wpe" in lower or (source is not None and _POSITION_NAME.search(source)):
            sizes.append(shape[0])
    for name, value in graph.initializers.items():
        shape = _const_shape(value)
        lower = name.lower()
        if shape and ("position_embeddings" in lower or "embed_positions" in lower) and len(shape) == 2:
            sizes.append(shape[0])
    return min(sizes) if sizes else None


def analyze(model: onnx.ModelProto | ir.Model) -> ModelFacts:
    """The role of every input the caller feeds, from the graph."""
    model = _as_ir(model)
    graph = model.graph
    initializers = set(graph.initializers)
    inputs = [v for v in graph.inputs if v.name not in initializers]
    aliases = _aliases(graph, {v.name or "" for v in inputs})
    ranges: dict[str, tuple[int, str]] = {}
    for node in _nodes(graph):
        # A quantized table (int4's GatherBlockQuantized: [rows, packed columns]) is indexed on gather_axis.
        quantized = node.op_type == "GatherBlockQuantized" and node.domain == "com.microsoft"
        if (node.op_type == "Gather" or quantized) and len(node.inputs) >= 2 and node.inputs[1] is not None:
            source = aliases.get(node.inputs[1].name or "")
            shape = _const_shape(node.inputs[0])
            if source is None or not shape:
                continue
            axis = node.attributes.get_int("gather_axis" if quantized else "axis", 0)
            rows = int(shape[axis if axis >= 0 else axis + len(shape)])
            if source not in ranges or rows < ranges[source][0]:
                ranges[source] = (rows, node.inputs[0].name or "a constant")
    compared = _compared_ids(graph, aliases)
    has_past = any(_PAST_NAME.search(v.name or "") and v.dtype is not None and v.dtype.is_floating_point()
                   for v in inputs)  # fmt: skip
    roles = {v.name or "": _role(v, ranges, compared, has_past, model) for v in inputs}
    encoder_decoder = _cross_attention(graph, roles, inputs)
    causal_lm = _causal_lm(graph, roles, has_past, model)
    if causal_lm:
        for role in roles.values():
            if role.role == "attention_mask":
                role.why = CAUSAL_LM_MASK + ("; spans the past and the new tokens" if has_past else "")
    return ModelFacts(
        roles, _max_positions(graph, aliases), has_past, causal_lm, encoder_decoder, row_group=_row_group(graph)
    )


_MAX_ROW_GROUP = 64


def _row_group(graph: ir.Graph) -> int:
    """The least common multiple of the groups the graph folds a leading axis into, from the two forms the
    exporters write: TorchScript's ``Div(Gather(Shape(x), 0), k)`` (``x.shape[0] // k`` as a reshape's size) and
    dynamo's ``Reshape(x, [-1, k * d1, ...])`` over a symbolic leading axis whose other sizes are known. 1 where
    none is found or the multiple is implausibly large (more than 64 rows)."""
    group = 1
    for node in _nodes(graph):
        k = _folded_rows(node)
        if k > 1:
            group = int(np.lcm(group, k))
    return group if group <= _MAX_ROW_GROUP else 1


def _folded_rows(node: ir.Node) -> int:
    if node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return 1
    if node.op_type == "Div" and _leading_size(node.inputs[0]):
        divisor = const_array(node.inputs[1])
        if divisor is not None and divisor.size == 1 and divisor.dtype.kind in "iu":
            return max(int(divisor.reshape(())), 1)
    if node.op_type == "Reshape":
        data = node.inputs[0]
        shape = data.shape if data is not None else None
        target = _reshape_target(node.inputs[1], data)
        if target is None or len(target) < 2 or target[0] != -1 or shape is None or len(shape) < 2:
            return 1
        if isinstance(shape[0], int):
            return 1
        # A size the target reads off the data's own axis (MusicGen's ``input_ids.view(-1, codebooks, S)``, the
        # sequence S taken from the input) cancels against that axis: what is left is the rows folded.
        rest = {axis: dim for axis, dim in enumerate(shape) if axis > 0}
        wanted = []
        for piece in target[1:]:
            if isinstance(piece, tuple) and piece[1] in rest:
                del rest[piece[1]]
            elif isinstance(piece, int) and piece > 0:
                wanted.append(piece)
            else:
                return 1
        if not all(isinstance(d, int) and d > 0 for d in rest.values()):
            return 1
        have, want = int(np.prod(list(rest.values()))), int(np.prod(wanted))
        if want % have == 0:
            return want // have
    return 1


def _reshape_target(value: ir.Value | None, data: ir.Value | None) -> list[int | tuple[str, int]] | None:
    """A Reshape's target shape, each entry a constant or ``("axis", i)`` for a size read off ``data``'s axis i
    (``Gather(Shape(data), i)`` or ``Shape(data, start=i, end=i + 1)``, through a Cast or an Unsqueeze), when the
    target is a constant or a Concat of such pieces; else None."""
    array = const_array(value)
    if array is not None:
        return [int(t) for t in array.reshape(-1)] if array.ndim == 1 else None
    concat = value.producer() if value is not None else None
    if concat is None or concat.op_type != "Concat" or concat.domain not in ("", "ai.onnx"):
        return None
    pieces: list[int | tuple[str, int]] = []
    for part in concat.inputs:
        constant = const_array(part)
        if constant is not None:
            pieces.extend(int(t) for t in constant.reshape(-1))
            continue
        axis = _axis_of(part, data)
        if axis is None:
            return None
        pieces.append(("axis", axis))
    return pieces


def _axis_of(value: ir.Value | None, data: ir.Value | None = None) -> int | None:
    """The axis of ``data`` (of any tensor, without ``data``) whose size ``value`` is, one element read as
    ``Gather(Shape(x), i)`` or ``Shape(x, start=i, end=i + 1)`` through a Cast, Squeeze or Unsqueeze; else None.
    A negative index is not resolved (None)."""
    node = value.producer() if value is not None else None
    while node is not None and node.op_type in ("Cast", "Squeeze", "Unsqueeze") and node.inputs:
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is None:
        return None
    if node.op_type == "Shape" and (data is None or node.inputs[0] is data):
        start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", 0)
        return start if end == start + 1 and start >= 0 else None
    if node.op_type == "Gather" and len(node.inputs) == 2 and node.inputs[0] is not None:
        shape, index = node.inputs[0].producer(), const_array(node.inputs[1])
        if shape is None or shape.op_type != "Shape" or (data is not None and shape.inputs[0] is not data):
            return None
        start = shape.attributes.get_int("start", 0)
        if index is None or index.size != 1 or int(index.reshape(())) < 0 or start < 0:
            return None
        return int(index.reshape(())) + start
    return None


def _leading_size(value: ir.Value | None) -> bool:
    """Whether ``value`` is a tensor's leading size: ``Gather(Shape(x), 0)`` or ``Shape(x, start=0, end=1)``
    (through a Cast or a Squeeze)."""
    return _axis_of(value) == 0


CAUSAL_LM_MASK = (
    "name says mask; a decoder-only language model: all ones (generation pads nothing; a right-padded row "
    "gives its pad positions values no caller reads, which a fused attention need not reproduce)"
)
_LM_ROLES = frozenset({"token_ids", "attention_mask", "position_ids", "past_key_values", "use_cache_branch"})
_ENCODER_NAME = re.compile(r"encoder", re.IGNORECASE)
_ORDER_OPS = frozenset({"Less", "LessOrEqual", "Greater", "GreaterOrEqual"})


def _causal_lm(graph: ir.Graph, roles: dict[str, InputRole], has_past: bool, model: ir.Model) -> bool:
    """One token-id input, and nothing but a mask, positions and a cache beside it (no encoder states or
    decoder ids, token types, pixels), no id the graph selects positions by (a classifier's ``</s>``), an
    output over the vocabulary (logits, not a pooled text embedding such as CLIP's causal text tower), and
    either a cache or a causal mask computed in the graph."""
    ids = [r for r in roles.values() if r.role == "token_ids"]
    if len(ids) != 1 or ids[0].markers or ids[0].decoder:
        return False
    if any(r.role not in _LM_ROLES or r.decoder or _ENCODER_NAME.search(n) for n, r in roles.items()):
        return False
    if not any(_over_vocabulary(out, ids[0].high) for out in model.graph.outputs):
        return False
    return has_past or _has_causal_mask(graph)


def _over_vocabulary(value: ir.Value, vocab: int | None) -> bool:
    last = value.shape[-1] if value.shape is not None and len(value.shape) else None
    if isinstance(last, int):
        return vocab is not None and last == vocab
    return (value.name or "") == "logits"


def _has_causal_mask(graph: ir.Graph) -> bool:
    """A ``Trilu``, an order comparison of two position ranges (``kv_idx <= q_idx``: both sides computed from
    a ``Range``), or a constant square table, one value on and below its diagonal and another above (GPT-2's
    ``bias`` buffer, a baked additive mask)."""
    for node in _nodes(graph):
        if node.op_type == "Trilu":
            return True
        ordered = node.op_type in _ORDER_OPS and len(node.inputs) == 2
        if ordered and all(v is not None and _from_range(v) for v in node.inputs):
            return True
    return any(_triangular(v) for v in graph.initializers.values())


def _from_range(value: ir.Value, depth: int = 8) -> bool:
    stack, seen = [(value, 0)], set()
    while stack:
        current, hops = stack.pop()
        node = current.producer()
        if node is None or id(node) in seen or hops > depth:
            continue
        seen.add(id(node))
        if node.op_type == "Range":
            return True
        stack.extend((v, hops + 1) for v in node.inputs if v is not None)
    return False


def _triangular(value: ir.Value) -> bool:
    shape = value.shape
    if shape is None or len(shape) < 2 or shape[-1] != shape[-2] or not isinstance(shape[-1], int):
        return False
    if shape[-1] < 2 or value.const_value is None or not all(isinstance(d, int) for d in shape):
        return False
    if int(np.prod([int(d) for d in shape])) > 1 << 22:
        return False
    table = value.const_value.numpy().reshape(-1, shape[-1], shape[-1])[0]
    lower, upper = table[np.tril_indices(shape[-1])], table[np.triu_indices(shape[-1], 1)]
    return bool((lower == lower[0]).all() and (upper == upper[0]).all() and lower[0] != upper[0])


def _role(
    value: ir.Value,
    ranges: dict[str, tuple[int, str]],
    compared: dict[str, tuple[set[int], set[int]]],
    has_past: bool,
    model: ir.Model,
) -> InputRole:
    name = value.name or ""
    kind = np.dtype(value.dtype.numpy()).kind if value.dtype is not None else "f"
    rank = len(value.shape) if value.shape is not None else 0
    decoder = bool(_DECODER_NAME.search(name))
    if _MASK_NAME.search(name) and kind in "biuf":
        why = "name says mask: right-padded 1/0 rows, each with >= 1 valid token"
        if has_past:
            why += "; spans the past and the new tokens"
        return InputRole(name, "attention_mask", why, decoder=decoder)
    if kind == "b":
        return _branch_flag(value, has_past) or InputRole(name, "bool", "boolean input: random 0/1")
    if kind in "iu":
        table = ranges.get(name)
        if _TOKEN_TYPE_NAME.search(name):
            high = min(2, table[0]) if table else 2
            return InputRole(name, "token_type_ids", f"token types below {high}", high=high)
        if _POSITION_NAME.search(name):
            return InputRole(name, "position_ids", "positions 0..S-1 (after the past, when there is one)")
        if _LENGTHS_NAME.search(name) and rank == 1:
            why = "valid lengths per row (ASR encoders' length input): 1 to the other inputs' longest free axis"
            return InputRole(name, "lengths", why)
        if _OFFSETS_NAME.search(name) and rank == 1:
            return InputRole(name, "offsets", "bag offsets (EmbeddingBag): ascending from 0, within the indices")
        if _LABELS_NAME.search(name) and kind == "i":
            classes = _num_classes(model)
            return InputRole(name, "labels", f"labels below {classes} with 20% ignore index -100", high=classes)
        if table is not None:
            markers, others = compared.get(name, (set(), set()))
            why = f"indexes {table[1]!r}: ids below its {table[0]} rows"
            if markers:
                why += f"; the graph selects positions by id {sorted(markers)}: one per row, at its last token"
            if others:
                why += f"; compared with {sorted(others)} (padding), kept out of the random ids"
            role = InputRole(name, "token_ids", why, high=table[0], decoder=decoder)
            role.markers, role.avoid = tuple(sorted(markers)), tuple(sorted(others - markers))
            return role
        high = DEFAULT_IDS_HIGH if _IDS_NAME.search(name) else DEFAULT_INT_HIGH
        return InputRole(name, "int", f"integer input not read as an index: values below {high}", high=high)
    if kind == "O":
        return _strings_role(value)
    if kind != "f":
        return InputRole(name, "unsupported", f"dtype {value.dtype}")
    if _PAST_NAME.search(name) and rank >= 3:
        return _past_role(value)
    if rank in (2, 3, 4):
        spatial = rank - 2 if rank > 2 else 1
        start = value
        if rank == 2:  # raw audio [batch, samples] reaches its Conv1d through an Unsqueeze
            start = value
        steps, channels, last = _conv_steps(start, spatial)
        # [batch, 1, samples] into a Conv1d stack is a waveform with its channel (EnCodec, DAC, HiFi-GAN's
        # discriminators), not one frame of features: sized, like [batch, samples], so that the stack yields
        # the sequence's frames (its strides multiply the length, and reflect pads inside need room).
        if steps and (rank == 2 or (rank == 3 and channels == 1)):
            role = InputRole(name, "audio", "", convs=tuple(steps), channels=channels)
            role.why = (
                f"raw audio{' [batch, 1, samples]' if rank == 3 else ''} into a {len(steps)}-step convolution "
                "stack (kernels "
                f"{[s.kernel[0] for s in steps]}, strides {[s.stride[0] for s in steps]}): "
                f">= {role.min_length()} samples"
            )
            return role
        if steps and rank == 3:
            exact = _table_after(last)
            role = InputRole(name, "features", "", convs=tuple(steps), channels=channels, exact_out=exact)
            role.why = f"features [batch, {channels} channels, frames] into a {len(steps)}-step convolution stack"
            if exact:
                role.why += f"; a {exact}-row position table after it fixes the frames to {role.min_length(exact)}"
            return role
        if steps and rank == 4:
            exact = _patch_positions(steps, last)
            role = InputRole(name, "pixel_values", "", convs=tuple(steps), channels=channels, exact_out=exact)
            role.why = f"pixels [batch, {channels}, H, W] into a {len(steps)}-step convolution stack"
            if exact:
                role.why += f"; {exact} patches per side from the position table: {role.min_length(exact)} pixels"
            return role
    if decoder:
        return InputRole(name, "float", "decoder float input (encoder states): N(0, 1)", decoder=True)
    return InputRole(name, "float", "float input: N(0, 1)")


# Where an ai.onnx.ml or ai.onnx op lists the strings it recognises (the categories of a fitted encoder).
_STRING_TABLES = {
    "OneHotEncoder": ("cats_strings",),
    "CategoryMapper": ("cats_strings",),
    "LabelEncoder": ("keys_strings",),
    "TfIdfVectorizer": ("pool_strings",),
}
# Ops that pass strings on unchanged in content (a table behind them still reads the input's values).
_STRING_CARRIERS = frozenset({"Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Slice", "Gather"})
DEFAULT_WORDS = ("a", "b", "c", "d")


def _strings_role(value: ir.Value) -> InputRole:
    """A string input: values drawn from the categories the graph's encoders were fitted on (a category outside
    them is an error for an encoder that keeps no 'unknown' slot), or a few short words when none reads it."""
    words: list[str] = []
    tables: list[str] = []
    frontier, seen = [value], set()
    while frontier:
        current = frontier.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for node, _ in current.uses():
            for attr_name in _STRING_TABLES.get(node.op_type, ()):
                attr = node.attributes.get(attr_name)
                if attr is None:
                    continue
                found = [w.decode() if isinstance(w, bytes) else str(w) for w in attr.value]
                words += [w for w in found if w not in words]
                tables.append(f"{node.op_type}.{attr_name}")
            if node.op_type == "StringNormalizer" or node.op_type in _STRING_CARRIERS:
                frontier.extend(o for o in node.outputs if o.dtype in (ir.DataType.STRING, None))
    name = value.name or ""
    if words:
        why = f"strings from the {len(words)} categories of {', '.join(sorted(set(tables)))}"
        return InputRole(name, "strings", why, words=tuple(words))
    return InputRole(name, "strings", f"strings: no category table reads it, words {list(DEFAULT_WORDS)}",
                     words=DEFAULT_WORDS)  # fmt: skip


def _branch_flag(value: ir.Value, has_past: bool) -> InputRole | None:
    """A bool the model branches on (an ``If``'s condition) where exactly one branch reads a cache input: a
    merged decoder's ``use_cache_branch``, whatever its name. The generated sets run both branches."""
    if not has_past:
        return None
    for use in value.uses():
        node = use.node
        if node.op_type != "If" or use.idx != 0:
            continue
        reads = {}
        for key in ("then_branch", "else_branch"):
            attr = node.attributes.get(key)
            branch = attr.as_graph() if attr is not None else None
            reads[key] = branch is not None and any(
                v is not None and v.is_graph_input() and _PAST_NAME.search(v.name or "")
                for n in ir.traversal.RecursiveGraphIterator(branch)
                for v in n.inputs
            )
        if reads["then_branch"] != reads["else_branch"]:
            on = reads["then_branch"]
            return InputRole(
                value.name or "",
                "use_cache_branch",
                f"the If {node.name or ''}'s condition: {on} runs the branch that reads the key/value cache "
                f"(Optimum's merged decoder: decoder_with_past), {not on} the one without (the decoder, fed a "
                "dummy cache it never reads); the generated sets run both",
                cache_value=on,
            )
    return None


def _patch_positions(steps: list[ConvStep], last: ir.Value | None) -> int | None:
    """Patches per side when a single patch convolution feeds a table of n*n (+1 class token) positions."""
    if len(steps) != 1 or last is None:
        return None
    rows = _table_after(last)
    if not rows:
        return None
    for count in (rows, rows - 1, rows - 2):  # plain, [CLS], [CLS] + distillation token (DeiT)
        side = round(count**0.5)
        if count > 0 and side * side == count:
            return side
    return None


def _past_role(value: ir.Value) -> InputRole:
    """The past length is the symbolic dim that is neither the batch (axis 0) nor a static head count or
    head size; with several, the layout's usual place: axis -2 ([batch, heads, past, head_dim], GQA/MQA
    alike) or axis 1 for a rank-3 fused cache ([batch, past, 2 * head_dim])."""
    shape = value.shape
    dims = list(shape) if shape is not None else []
    symbolic = [i for i, d in enumerate(dims) if not isinstance(d, int) and i != 0]
    axis = symbolic[0] if len(symbolic) == 1 else (len(dims) - 2 if len(dims) == 4 else 1)
    statics = [d for d in dims if isinstance(d, int)]
    return InputRole(
        value.name or "",
        "past_key_values",
        f"key/value cache, past length on axis {axis}; static dims {statics} (heads, head size) from the graph",
        past_axis=axis,
    )


_PROJECTIONS = frozenset({"MatMul", "Gemm"})
_SCORE_STOP = frozenset({"Softmax", "Concat"})  # past the scores (or into a cache), nothing is a score input
# Fused attention (ORT's contrib ops, an upload optimized before): the input slots of keys and values that
# are used as given, and of a past the op concatenates new keys onto.
_FUSED_KV = {"MultiHeadAttention": (1, 2), "GroupQueryAttention": (1, 2)}
_FUSED_PAST = {"MultiHeadAttention": (6, 7), "GroupQueryAttention": (3, 4), "Attention": (4,)}


def _grows(node: ir.Node, idx: int) -> bool:
    return node.op_type == "Concat" or idx in _FUSED_PAST.get(node.op_type, ())


def _read_as_is(node: ir.Node, idx: int) -> bool:
    """An attention ``MatMul`` (scores against the keys, weights against the values) or a fused attention's
    key/value slot."""
    return node.op_type in _PROJECTIONS or idx in _FUSED_KV.get(node.op_type, ())


def _cross_attention(graph: ir.Graph, roles: dict[str, InputRole], inputs: list[ir.Value]) -> bool:
    """Re-read the inputs of a seq2seq decoder (module docstring); True when it is one."""
    by_name = {v.name or "": v for v in inputs}
    pasts = [n for n, r in roles.items() if r.role == "past_key_values"]
    grows = {n: _direct(by_name[n], _grows) for n in pasts}
    sources: list[ir.Value] = []
    if any(grows.values()):
        for name in pasts:
            if not grows[name] and _direct(by_name[name], _read_as_is):
                roles[name] = InputRole(
                    name,
                    "cross_key_values",
                    "cross-attention cache: read by the attention as it is, never concatenated with new keys "
                    "(the self-attention cache is), so its length is the encoder's, fixed",
                    past_axis=roles[name].past_axis,
                )
                sources.append(by_name[name])
    has_ids = any(r.role == "token_ids" for r in roles.values())
    for name, role in list(roles.items()):
        value = by_name[name]
        shape = value.shape
        if role.role != "float" or not has_ids or shape is None or len(shape) != 3 or not isinstance(shape[2], int):
            continue
        projections = [
            u.node for u in value.uses()
            if (u.node.op_type in _PROJECTIONS and u.idx == 0 and len(u.node.inputs) > 1
                and const_array(u.node.inputs[1]) is not None) or u.idx in _FUSED_KV.get(u.node.op_type, ())
        ]  # fmt: skip
        if projections:
            roles[name] = InputRole(
                name,
                "encoder_states",
                f"encoder states [batch, encoder sequence, {shape[2]}]: read by {len(projections)} constant "
                "projections or attention key/value slots (cross-attention) beside the decoder's token ids",
                decoder=True,
            )
            sources.append(value)
    if not sources:
        return False
    scores = _forward(sources, depth=8)
    for name, role in roles.items():
        if role.role == "attention_mask" and _forward([by_name[name]], depth=14) & scores:
            role.cross = True
            role.why = "mask over the encoder's sequence: it reaches the cross-attention scores; right-padded 1/0 rows"
    return True


def _direct(value: ir.Value, accept: Callable[[ir.Node, int], bool], depth: int = 5) -> bool:
    """Whether ``value``'s data (not its shape) reaches a use ``accept`` takes (node, input slot) through casts,
    reshapes, transposes and scaling by a constant. Dynamo's decomposed SDPA reads a cached key as
    ``Mul(Reshape(Transpose(Reshape(k))), sqrt(scale))`` before the scores' MatMul: five steps."""
    if depth < 0:
        return False
    for use in value.uses():
        node = use.node
        passes = (node.op_type in _ALIAS_OPS and use.idx == 0) or _onto_empty(node, value) or _scaled(node, value)
        if passes and any(_direct(o, accept, depth - 1) for o in node.outputs):
            return True
        if accept(node, use.idx) and not passes:
            return True
    return False


def _scaled(node: ir.Node, value: ir.Value) -> bool:
    """``value`` times (or divided by) a one-element constant: the same tensor, scaled."""
    if node.op_type not in ("Mul", "Div") or len(node.inputs) != 2:
        return False
    other = node.inputs[1] if node.inputs[0] is value else node.inputs[0] if node.op_type == "Mul" else None
    array = const_array(other) if other is not None and other is not value else None
    return array is not None and array.size == 1


def _onto_empty(node: ir.Node, value: ir.Value) -> bool:
    """A Concat of ``value`` onto empty constants (DynamicCache's lazy start): the tensor passes on unchanged."""
    return node.op_type == "Concat" and all(
        v is value or ((a := const_array(v)) is not None and a.size == 0) for v in node.inputs
    )


def _forward(values: list[ir.Value], depth: int) -> set[int]:
    """Ids of the ``Add``/``Where``/``Mul`` nodes and fused attentions reachable from ``values`` within
    ``depth`` ops, short of a ``Softmax``: where attention scores meet their mask."""
    found: set[int] = set()
    seen: set[int] = set()
    frontier = list(values)
    for _ in range(depth):
        nxt = []
        for value in frontier:
            for use in value.uses():
                node = use.node
                if id(node) in seen or (node.op_type in _SCORE_STOP and not _onto_empty(node, value)):
                    continue
                seen.add(id(node))
                if node.op_type in ("Add", "Where", "Mul") or node.op_type in _FUSED_PAST:
                    found.add(id(node))
                if node.op_type not in _FUSED_PAST:
                    nxt.extend(node.outputs)
        frontier = nxt
    return found


def _num_classes(model: ir.Model) -> int:
    """A guess for label ranges: the smallest static last dim > 1 among float outputs."""
    sizes = []
    for out in model.graph.outputs:
        if out.dtype is not None and out.dtype.is_floating_point() and out.shape is not None and len(out.shape):
            last = out.shape[-1]
            if isinstance(last, int) and last > 1:
                sizes.append(last)
    return min(sizes) if sizes else DEFAULT_CLASSES


def dim_role(dim: str | None, axis: int) -> str:
    """``batch`` or ``seq`` for a symbolic dim, from its name, else from its axis."""
    if dim is None:
        return "batch" if axis == 0 else "seq"
    if _BATCH_DIM.match(dim):
        return "batch"
    if _SEQ_DIM.search(dim):
        return "seq"
    return "batch" if axis == 0 else "seq"
