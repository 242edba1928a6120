"""A decoder's structure read from its graph alone: layers, heads, KV heads, head size, hidden size, vocabulary,
rotary embedding, norm kind, attention (self and cross), KV-cache layout and the length of a learned position
table (the longest sequence it can take), for fuse_rotary's report.

Names serve only to print the cache's naming pattern (``past_key_values.{layer}.{key|value}``, Optimum's
seq2seq ``past_key_values.{layer}.decoder.{key|value}``), which the serving side must know anyway. The rest is
the graph's: heads come from the head-split ``Transpose(perm=[0, 2, 1, 3])`` every exporter writes after the
Q/K/V projections (its static shape, or the ``Reshape`` target feeding it), the hidden size and vocabulary from
the token embedding ``Gather`` (else the norms' weights and the LM head), the norm kind from the statistics'
ops, the position table from the ``Gather`` whose indices are a position input or a shifted ``Range`` (the
past length onwards).

Caches and attention split into self and cross (encoder-decoders): a cache input is a self cache when it
grows by ``Concat`` and a cross cache when it is read as it is (``core.inputs.analyze``); a cache output, and
an attention's keys, are self when their data depend on the decoder's own inputs (token ids, the self cache)
and cross when only on the encoder's (its states, the cross cache). Layers are the self caches (a key and a
value per layer), else the rotary matches (q and k per layer), else the self-attention sites, so a seq2seq
decoder's cross attention is never counted as a layer. A field the graph does not determine is None, never
guessed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import onnx_ir as ir

from core.inputs import analyze
from passes.fusion._rotary_cache import rope_theta
from passes.fusion._rotary_eval import const, heads_of_split, int_attr, ints_attr
from passes.fusion._rotary_match import RotaryMatch

_INTEGERS = (ir.DataType.INT64, ir.DataType.INT32)
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)
# Only for printing the naming pattern: the number and the key/value word become placeholders.
_CACHE_NAME = re.compile(r"^(.*?[._])(\d+)([._](?:[A-Za-z]+[._])?)(key|value)$")
_METADATA = frozenset({"Shape", "Size"})  # outputs describe a tensor's extent, not its data
_FUSED_ATTENTION = {"MultiHeadAttention": 1, "Attention": None, "GroupQueryAttention": None}  # op -> key slot
_ENCODER_SIDE = frozenset({"encoder_states", "cross_key_values"})
_SCORE_PATH = frozenset({"Add", "Mul", "Div", "Sub", "Where", "Cast", "Identity", "Reshape", "Max", "Min"})


def _depends_on(graph: ir.Graph, sources: Sequence[ir.Value]) -> set[ir.Value]:
    """Every value whose data (not its shape) the graph computes from ``sources``, in one topological sweep:
    a Reshape target built from ``Shape(input_ids)`` (BART's cross keys take the batch from the decoder) does
    not make the keys the decoder's."""
    reached = set(sources)
    for node in graph:
        if node.op_type not in _METADATA and any(v in reached for v in node.inputs if v is not None):
            reached.update(node.outputs)
    return reached


def _is_cache(value: ir.Value) -> bool:
    """A rank-4 float output holding keys or values: [batch, heads, length, head] (or heads third), not the
    attention probabilities (a Softmax's) an export may also return."""
    shape, producer = value.shape, value.producer()
    return (
        value.dtype in _FLOATS
        and shape is not None
        and len(shape) == 4
        and (producer is None or producer.op_type != "Softmax")
    )


def _caches(
    graph: ir.Graph, roles: dict[str, str], decoder_side: set[ir.Value]
) -> tuple[list[ir.Value], list[ir.Value]]:
    """(self, cross) cache tensors: the cache inputs by their role, else the cache outputs by what they depend
    on (``decoder_model`` has presents but no past)."""
    inputs = [v for v in graph.inputs if roles.get(v.name or "") in ("past_key_values", "cross_key_values")]
    if inputs:
        own = [v for v in inputs if roles[v.name or ""] == "past_key_values"]
        return own, [v for v in inputs if roles[v.name or ""] == "cross_key_values"]
    outputs = [v for v in graph.outputs if _is_cache(v)]
    return [v for v in outputs if v in decoder_side], [v for v in outputs if v not in decoder_side]


def _static(dim: Any) -> int | None:
    return dim if isinstance(dim, int) else None


def _cache_layout(caches: Sequence[ir.Value]) -> dict[str, Any] | None:
    if not caches:
        return None
    first = caches[0]
    shape = first.shape
    layout = kv_heads = head_size = None
    if shape is not None and len(shape) == 4:
        head_size = _static(shape[3])
        if _static(shape[1]) is not None and _static(shape[2]) is None:
            layout, kv_heads = "BNSH", _static(shape[1])
        elif _static(shape[2]) is not None and _static(shape[1]) is None:
            layout, kv_heads = "BSNH", _static(shape[2])
    if layout is None and (split := _split_feeding(first)) is not None:
        layout, (kv_heads, head_size) = "BNSH", split
    pattern = _CACHE_NAME.sub(lambda m: f"{m.group(1)}{{layer}}{m.group(3)}{{key|value}}", first.name or "")
    return {"layout": layout, "names": pattern, "kv_heads": kv_heads, "head_size": head_size}


def _through_elementwise(value: ir.Value | None) -> ir.Node | None:
    """The producer of ``value``, looking through a per-head norm between the head split's Reshape and its
    Transpose (Qwen3's and Gemma 3's q_norm/k_norm) along its non-constant operand."""
    for _ in range(10):
        node = value.producer() if value is not None else None
        if node is None or node.op_type not in ("Mul", "Div", "Add", "Sub", "Cast", "Identity"):
            return node
        value = next((v for v in node.inputs if v is not None and const(v) is None), None)
    return None


def _split_of(node: ir.Node) -> tuple[int, int] | None:
    """(heads, head_size) of a ``[B, S, N, H] -> [B, N, S, H]`` transpose whose dims are known, else None."""
    if node.op_type != "Transpose" or ints_attr(node, "perm") != [0, 2, 1, 3]:
        return None
    merged = node.inputs[0].producer() if node.inputs[0] is not None else None
    if merged is not None and merged.op_type == "MatMul":  # the heads' merge, probs @ v back to [B, S, N, H]
        return None
    shape = node.outputs[0].shape
    if shape is not None and len(shape) == 4 and _static(shape[1]) and _static(shape[3]):
        return int(shape[1]), int(shape[3])
    source = _through_elementwise(node.inputs[0])
    if source is not None and source.op_type == "Reshape":
        return heads_of_split(source.inputs[1], source.inputs[0])
    return None


def _head_splits(graph: ir.Graph) -> list[tuple[int, int]]:
    """(heads, head_size) of every head-split transpose whose dims are known."""
    return [split for node in graph if (split := _split_of(node)) is not None]


def _split_feeding(cache: ir.Value) -> tuple[int, int] | None:
    """(heads, head_size) of the head split a cache output holds, through the Concat onto the past (or onto an
    empty tensor: Whisper's TorchScript export) and casts, where the output's shape does not say them."""
    value: ir.Value | None = cache
    for _ in range(6):
        node = value.producer() if value is not None else None
        if node is None:
            return None
        if node.op_type == "Transpose":
            return _split_of(node)
        if node.op_type not in ("Concat", "Identity", "Cast"):
            return None
        value = node.inputs[-1]  # the new keys come last in a cache Concat
    return None


def _graph_input(value: ir.Value | None, graph: ir.Graph) -> ir.Value | None:
    """The graph input ``value`` reshapes or casts (GPT-2 flattens its ids first), else None."""
    for _ in range(4):
        if value is None or value in graph.inputs:
            return value
        node = value.producer()
        if node is None or node.op_type not in ("Reshape", "Cast", "Flatten", "Unsqueeze", "Squeeze"):
            return None
        value = node.inputs[0]
    return None


def _tables(graph: ir.Graph) -> dict[str, tuple[int, int]]:
    """Shape of the constant tables gathered by an integer graph input: "tokens" (vocab, hidden), and a
    learned "positions" table (max positions, hidden) where the model has one (GPT-2's wpe)."""
    found: dict[str, tuple[int, int]] = {}
    for node in graph:
        if node.op_type != "Gather" or len(node.inputs) != 2:
            continue
        source = _graph_input(node.inputs[1], graph)
        table = const(node.inputs[0])
        if source is None or table is None or table.ndim != 2 or source.dtype not in _INTEGERS:
            continue
        role = "positions" if "position" in (source.name or "") else "tokens"
        found.setdefault(role, (int(table.shape[0]), int(table.shape[1])))
    if "positions" not in found and "tokens" in found:
        computed = _computed_positions(graph, found["tokens"][1])
        if computed is not None:
            found["positions"] = computed
    return found


_INDEX_PATH = frozenset({"Add", "Unsqueeze", "Squeeze", "Expand", "Tile", "Cast", "Reshape", "Identity"})


def _range_offset(value: ir.Value | None, depth: int = 8) -> int | None:
    """The constant added to a ``Range`` on the way to ``value`` (0 for none), or None when ``value`` is not
    a range shifted, broadcast or reshaped: positions the graph computes from the past length and the new
    tokens' count."""
    node = value.producer() if value is not None else None
    if node is None or depth == 0:
        return None
    if node.op_type == "Range":
        return 0
    if node.op_type not in _INDEX_PATH:
        return None
    if node.op_type == "Add":
        constants = [c for v in node.inputs if (c := const(v)) is not None]
        computed = [v for v in node.inputs if v is not None and const(v) is None]
        shift = sum(int(c.reshape(-1)[0]) for c in constants if c.size == 1)
        offsets = [o for v in computed if (o := _range_offset(v, depth - 1)) is not None]
        return offsets[0] + shift if offsets and len(constants) + len(computed) == 2 else None
    return _range_offset(node.inputs[0], depth - 1)


def _computed_positions(graph: ir.Graph, hidden: int) -> tuple[int, int] | None:
    """A learned position table the graph indexes with positions it computes (GPT-2 without position ids,
    BART's and Whisper's decoders: past length + Range; not T5's relative buckets, which are no shifted
    Range): (positions it holds, hidden). BART's table starts at row 2 (``Add(.., 2)``): it holds its rows
    less that offset."""
    for node in graph:
        # Gather on axis 0, or GatherND on rows (dynamo's Whisper: the indices Unsqueezed to [.., 1])
        rows = node.op_type == "Gather" and node.attributes.get_int("axis", 0) == 0
        rows |= node.op_type == "GatherND" and node.attributes.get_int("batch_dims", 0) == 0
        if not rows or len(node.inputs) != 2:
            continue
        table = const(node.inputs[0])
        if table is None or table.ndim != 2 or table.shape[1] != hidden:
            continue
        indices = node.inputs[1]
        if node.op_type == "GatherND":  # rows only where the index tuples are one long: Unsqueeze(i, -1)
            unsqueeze = indices.producer() if indices is not None else None
            axes = const(unsqueeze.inputs[1]) if unsqueeze is not None and len(unsqueeze.inputs) > 1 else None
            if (
                unsqueeze is None
                or unsqueeze.op_type != "Unsqueeze"
                or axes is None
                or axes.reshape(-1).tolist() != [-1]
            ):
                continue
            indices = unsqueeze.inputs[0]
        offset = _range_offset(indices)
        if offset is not None and 0 <= offset < table.shape[0]:
            return int(table.shape[0]) - offset, int(table.shape[1])
    return None


def _score_operands(softmax: ir.Node) -> tuple[ir.Value, ir.Value] | None:
    """The (queries, keys) operands of ``MatMul(q, k)`` under a Softmax's scores, through the scale, bias and
    mask ops."""
    frontier = [softmax.inputs[0]]
    for _ in range(6):
        step = []
        for value in frontier:
            node = value.producer() if value is not None else None
            if node is None:
                continue
            if node.op_type == "MatMul" and all(v is not None and const(v) is None for v in node.inputs):
                return node.inputs[0], node.inputs[1]
            if node.op_type in _SCORE_PATH:
                step += [v for v in node.inputs if v is not None and const(v) is None]
        frontier = step
    return None


def _input_sources(graph: ir.Graph) -> dict[ir.Value, frozenset[ir.Value]]:
    """For every value, the graph inputs its data (not its shape) is computed from, in one topological sweep."""
    initializers = set(graph.initializers.values())
    sources: dict[ir.Value, frozenset[ir.Value]] = {v: frozenset({v}) for v in graph.inputs if v not in initializers}
    for node in graph:
        if node.op_type in _METADATA:
            continue
        found = frozenset().union(*(sources.get(v, frozenset()) for v in node.inputs if v is not None))
        for out in node.outputs:
            sources[out] = found
    return sources


def _decoder_side(model: ir.Model, roles: dict[str, str] | None = None) -> set[ir.Value]:
    """The values computed from the model's own inputs: every input but the encoder's states and cross cache."""
    graph = model.graph
    roles = roles if roles is not None else {name: role.role for name, role in analyze(model).roles.items()}
    initializers = set(graph.initializers.values())
    own = [v for v in graph.inputs if v not in initializers and roles.get(v.name or "") not in _ENCODER_SIDE]
    return _depends_on(graph, own)


def attention_kinds(model: ir.Model) -> dict[str, str]:
    """Softmax (and fused attention) node name -> "self" or "cross", for naming a seq2seq decoder's sites."""
    kinds: dict[str, str] = {}
    _attention(model.graph, _decoder_side(model), kinds)
    return kinds


def attention_counts(model: ir.Model) -> dict[str, int]:
    """Attention sites by kind, ``{"self": L, "cross": C}``, counted by node (names may be missing or repeat)."""
    return _attention(model.graph, _decoder_side(model)) or {"self": 0, "cross": 0}


def _attention(
    graph: ir.Graph, decoder_side: set[ir.Value], named: dict[str, str] | None = None
) -> dict[str, int] | None:
    """Attention sites by kind: "self" where the keys are computed from the decoder's inputs, "cross" where
    only from the encoder's; a Softmax whose keys are not found counts as self.

    A graph holding both encoder and decoder (``decoder_input_ids`` beside ``input_ids``, or pixels, or mel
    features) has no encoder-side input: every input is its own, and the encoder's states are computed in the
    graph. There a cross attention is told by its operands: its queries read a graph input its keys do not
    (the decoder's ids), where a self attention's queries and keys come from one stream (with a cache, the
    keys read the past on top of the queries' inputs, never fewer)."""
    kinds = {"self": 0, "cross": 0}
    sources: dict[ir.Value, frozenset[ir.Value]] | None = None
    for node in graph:
        if node.op_type == "Softmax" and node.domain in ("", "ai.onnx"):
            queries, keys = _score_operands(node) or (None, None)
        elif node.op_type in _FUSED_ATTENTION and node.domain == "com.microsoft":
            slot = _FUSED_ATTENTION[node.op_type]
            keys = node.inputs[slot] if slot is not None and slot < len(node.inputs) else None
            queries = node.inputs[0] if keys is not None else None
            if keys is None:  # packed QKV or a fused self cache: the keys are the decoder's
                keys = node.inputs[0]
        else:
            continue
        cross = keys is not None and keys not in decoder_side
        if not cross and keys is not None and queries is not None:
            sources = sources if sources is not None else _input_sources(graph)
            cross = bool(sources.get(queries, frozenset()) - sources.get(keys, frozenset()))
        kind = "cross" if cross else "self"
        kinds[kind] += 1
        if named is not None:
            named[node.name or ""] = kind
    return kinds if any(kinds.values()) else None


def _norm_kind(graph: ir.Graph) -> str | None:
    kinds: set[str] = set()
    for node in graph:
        if node.op_type in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization"):
            kinds.add("rms")
        elif node.op_type in ("LayerNormalization", "SkipLayerNormalization"):
            kinds.add("layernorm")
        elif node.op_type == "Pow" and node.inputs[0] is not None:
            uses = [u.node.op_type for u in node.outputs[0].uses()]
            exponent = const(node.inputs[1])
            if "ReduceMean" in uses and exponent is not None and exponent.size == 1 and float(exponent) == 2.0:
                centred = through_casts(node.inputs[0]).producer()
                kinds.add("layernorm" if centred is not None and centred.op_type == "Sub" else "rms")
    if not kinds:
        return None
    return kinds.pop() if len(kinds) == 1 else "mixed"


def through_casts(value: ir.Value) -> ir.Value:
    """``value`` before the Casts T5 writes around a norm's statistics (``x.to(float32)``)."""
    for _ in range(4):
        node = value.producer()
        if node is None or node.op_type != "Cast" or node.inputs[0] is None:
            break
        value = node.inputs[0]
    return value


def _norm_width(graph: ir.Graph) -> int | None:
    """The hidden size as the norms' weights give it, where no token table does (Whisper's encoder): the
    ``scale`` of a LayerNormalization over the last axis, else the constant vector an RMS norm multiplies by."""
    for node in graph:
        if node.op_type in ("LayerNormalization", "SimplifiedLayerNormalization") and len(node.inputs) > 1:
            scale = const(node.inputs[1])
            if scale is not None and scale.ndim == 1:
                return int(scale.shape[0])
    return None


def _lm_head_width(graph: ir.Graph) -> int | None:
    """The last dim of the first output when it is a projection by a constant weight (a language-model head,
    possibly with a bias), the vocabulary; None for hidden states (an encoder's output is a norm's)."""
    if not graph.outputs:
        return None
    node = graph.outputs[0].producer()
    if node is not None and node.op_type == "Add":  # BART's final_logits_bias
        node = next((v.producer() for v in node.inputs if v is not None and const(v) is None), None)
    if node is None or node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
        return None
    weight = const(node.inputs[1])
    if weight is None or weight.ndim != 2:
        return None
    transposed = node.op_type == "Gemm" and int_attr(node, "transB", 0) == 1
    return int(weight.shape[0] if transposed else weight.shape[1])


def detect(model: ir.Model, matches: Sequence[RotaryMatch] = ()) -> dict[str, Any]:
    """The structure as a JSON-able dict (the report's ``notes["decoder"]``)."""
    graph = model.graph
    roles = {name: role.role for name, role in analyze(model).roles.items()}
    decoder_side = _decoder_side(model, roles)
    own, cross = _caches(graph, roles, decoder_side)
    cache = _cache_layout(own)
    if cross:
        cache = {**(cache or {"layout": None, "names": None, "kv_heads": None, "head_size": None})}
        cache["cross"] = _cache_layout(cross)
    splits = _head_splits(graph)
    head_size = (cache or {}).get("head_size") or (max(s for _, s in splits) if splits else None)
    heads_seen = sorted({n for n, s in splits if s == head_size})
    kv_heads = (cache or {}).get("kv_heads") or (heads_seen[0] if heads_seen else None)
    heads = heads_seen[-1] if heads_seen else None
    attention = _attention(graph, decoder_side)
    layers = len(own) // 2 or None
    if layers is None and matches:
        layers = len(matches) // 2
    if layers is None and attention:
        layers = attention["self"] or None
    tables = _tables(graph)
    embedding = tables.get("tokens")
    rotary: dict[str, Any] | None = None
    if matches:
        first = matches[0]
        dims = sorted({m.rotary_dim for m in matches})
        rotary = {
            "rotary_dim": dims[0] if len(dims) == 1 else dims,
            "form": first.cos.kind,
            "theta": rope_theta(first.cos.values) if first.cos.kind == "inv_freq" else None,
            "attention_scaling": first.cos.scale,
            "partial_rotary_factor": round(dims[0] / head_size, 4) if head_size and len(dims) == 1 else None,
            "interleaved": first.interleaved,
        }
    return {
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_size": head_size,
        "hidden": embedding[1] if embedding else _norm_width(graph),
        "vocab": embedding[0] if embedding else _lm_head_width(graph),
        "rotary": rotary,
        "norm": _norm_kind(graph),
        "attention": attention,
        "cache": cache,
        "max_positions": tables["positions"][0] if "positions" in tables else None,
    }
