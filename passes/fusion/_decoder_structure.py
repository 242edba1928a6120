"""A decoder's structure read from its graph alone: layers, heads, KV heads, head size, hidden size, vocabulary,
rotary embedding, norm kind and KV-cache layout, for fuse_rotary's report.

Nothing here trusts names beyond the cache's (Optimum's ``past_key_values.N.key`` / ``present.N.key``, which
the serving side must know anyway): heads come from the head-split ``Transpose(perm=[0, 2, 1, 3])`` every
exporter writes after the Q/K/V projections (its static shape, or the ``Reshape`` target feeding it), the
hidden size and vocabulary from the token embedding ``Gather``, the norm kind from the statistics' ops.
A field the graph does not determine is None, never guessed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import onnx_ir as ir

from passes.fusion._rotary_cache import rope_theta
from passes.fusion._rotary_eval import const, heads_of_split, ints_attr
from passes.fusion._rotary_match import RotaryMatch

_INTEGERS = (ir.DataType.INT64, ir.DataType.INT32)
_CACHE_NAME = re.compile(r"^(past_key_values|past|present|cache)[._](\d+)[._](key|value)$")


def _cache(values: Sequence[ir.Value]) -> dict[int, ir.Value]:
    keys: dict[int, ir.Value] = {}
    for value in values:
        found = _CACHE_NAME.match(value.name or "")
        if found and found.group(3) == "key":
            keys[int(found.group(2))] = value
    return keys


def _static(dim: Any) -> int | None:
    return dim if isinstance(dim, int) else None


def _cache_layout(keys: dict[int, ir.Value]) -> dict[str, Any] | None:
    if not keys:
        return None
    first = keys[min(keys)]
    shape = first.shape
    layout = kv_heads = head_size = None
    if shape is not None and len(shape) == 4:
        head_size = _static(shape[3])
        if _static(shape[1]) is not None and _static(shape[2]) is None:
            layout, kv_heads = "BNSH", _static(shape[1])
        elif _static(shape[2]) is not None and _static(shape[1]) is None:
            layout, kv_heads = "BSNH", _static(shape[2])
    pattern = _CACHE_NAME.sub(lambda m: f"{m.group(1)}.{{layer}}.{{key|value}}", first.name or "")
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


def _head_splits(graph: ir.Graph) -> list[tuple[int, int]]:
    """(heads, head_size) of every ``[B, S, N, H] -> [B, N, S, H]`` transpose whose dims are known."""
    found: list[tuple[int, int]] = []
    for node in graph:
        if node.op_type != "Transpose" or ints_attr(node, "perm") != [0, 2, 1, 3]:
            continue
        shape = node.outputs[0].shape
        if shape is not None and len(shape) == 4 and _static(shape[1]) and _static(shape[3]):
            found.append((int(shape[1]), int(shape[3])))
            continue
        source = _through_elementwise(node.inputs[0])
        if source is not None and source.op_type == "Reshape":
            split = heads_of_split(source.inputs[1], source.inputs[0])
            if split is not None:
                found.append(split)
    return found


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
    return found


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
                centred = node.inputs[0].producer()
                kinds.add("layernorm" if centred is not None and centred.op_type == "Sub" else "rms")
    if not kinds:
        return None
    return kinds.pop() if len(kinds) == 1 else "mixed"


def detect(model: ir.Model, matches: Sequence[RotaryMatch] = ()) -> dict[str, Any]:
    """The structure as a JSON-able dict (the report's ``notes["decoder"]``)."""
    graph = model.graph
    past, present = _cache(graph.inputs), _cache(graph.outputs)
    cache = _cache_layout(past) or _cache_layout(present)
    splits = _head_splits(graph)
    head_size = (cache or {}).get("head_size") or (max(s for _, s in splits) if splits else None)
    heads_seen = sorted({n for n, s in splits if s == head_size})
    kv_heads = (cache or {}).get("kv_heads") or (heads_seen[0] if heads_seen else None)
    heads = heads_seen[-1] if heads_seen else None
    layers = len(past) or len(present) or None
    if layers is None and matches:
        layers = len(matches) // 2
    if layers is None:
        softmaxes = sum(1 for n in graph if n.op_type == "Softmax")
        layers = softmaxes or None
    tables = _tables(graph)
    embedding = tables.get("tokens")
    logits = graph.outputs[0].shape if graph.outputs else None
    vocab = embedding[0] if embedding else (_static(logits[-1]) if logits else None)
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
            "interleaved": False,
        }
    return {
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_size": head_size,
        "hidden": embedding[1] if embedding else None,
        "vocab": vocab,
        "rotary": rotary,
        "norm": _norm_kind(graph),
        "cache": cache,
        "max_positions": tables["positions"][0] if "positions" in tables else None,
    }
