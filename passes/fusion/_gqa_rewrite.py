"""The rewriting half of ``fuse_gqa``: the inputs GroupQueryAttention and MultiHeadAttention take, built
from a matched ``Site``, and the layer rewired onto the fused op.

Both ops take q (and GQA k, v) as [B, S, N*D]. A value that is ``Transpose(0,2,1,3)`` of [B,S,N,D] is
flattened straight from its source (a Reshape, no copy); a heads-first RotaryEmbedding of one is redone on
that flat source (``num_heads`` set), so no Transpose is left on either side of the rotation; any other
value goes through a Transpose. The fused output [B,S,H*D] is reshaped back to [B,S,H,D], the value the layer's output
projection read, so the rest of the layer is untouched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from passes._match import take_graph_output
from passes.fusion import _nan_guard as nan_guard
from passes.fusion._gqa_match import Site
from passes.fusion._gqa_probe import gqa_window_offset
from passes.fusion._head_layout import transposed_source
from passes.fusion._slice_dims import crop_source


def const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    tensor = ir.tensor(array, name=name)
    value = ir.Value(name=name, const_value=tensor, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
    graph.register_initializer(value)
    return value


def lengths(graph: ir.Graph, mask_name: str) -> tuple[ir.Value, ir.Value]:
    """seqlens_k = max(sum(mask, axis 1) - 1, 0) and total_sequence_length = mask.shape[1], both int32, once
    per graph, at its start (they read only the graph input)."""
    mask = next(v for v in graph.inputs if v.name == mask_name)
    opset = graph.opset_imports.get("", 18)
    cast = ir.node("Cast", [mask], {"to": ir.DataType.INT32}, name="fuse_gqa/mask_int32")
    if opset >= 13:
        axes = const(graph, "fuse_gqa/axis_1", np.array([1], np.int64))
        summed = ir.node("ReduceSum", [cast.outputs[0], axes], {"keepdims": 0}, name="fuse_gqa/mask_sum")
    else:
        summed = ir.node("ReduceSum", [cast.outputs[0]], {"axes": [1], "keepdims": 0}, name="fuse_gqa/mask_sum")
    one = const(graph, "fuse_gqa/one", np.array(1, np.int32))
    last = ir.node("Sub", [summed.outputs[0], one], name="fuse_gqa/last_key")
    nodes = [cast, summed, last]
    seqlens = last
    if opset >= 12:  # integer Max
        # A row whose mask is all zeros (an empty row of a padded batch) would give -1, which ORT's
        # GroupQueryAttention refuses, failing the whole batch where the export returns that row's (meaningless)
        # values: it attends to its first key instead, and every other row is unchanged.
        zero = const(graph, "fuse_gqa/zero", np.array(0, np.int32))
        seqlens = ir.node("Max", [last.outputs[0], zero], name="fuse_gqa/seqlens_k")
        nodes.append(seqlens)
    measured, total = _mask_length(graph, mask, "fuse_gqa/")
    graph.insert_before(next(iter(graph)), [*nodes, *measured])
    seqlens.outputs[0].name, total.name = "fuse_gqa/seqlens_k", "fuse_gqa/total_sequence_length"
    return seqlens.outputs[0], total


def flat_heads(
    graph: ir.Graph, value: ir.Value, prefix: str, bsnd: bool, *, heads: int | None = None, splits: dict | None = None
) -> tuple[ir.Value, list[ir.Node]]:
    """``value`` [B,N,S,D] (or [B,S,N,D] when ``bsnd``) as [B,S,N*D]: ``Reshape(x)`` when it is
    ``Transpose(0,2,1,3)(x)`` (read through a fused qkv's Slice/Split and identity Reshapes by
    ``_head_layout``); a heads-first ``RotaryEmbedding`` of such a value is redone on the flat ``Reshape(x)``
    (``num_heads`` set: the same rotation per head, no Transpose either side); anything else goes through a
    Transpose. ``splits``: the Splits ``_head_layout`` made for this layer's other inputs, to share."""
    nodes: list[ir.Node] = []
    splits = {} if splits is None else splits
    producer = value.producer()
    shape = const(graph, f"{prefix}/flat_shape", np.array([0, 0, -1], np.int64))
    if bsnd:
        source = value
    elif (source := transposed_source(graph, value, prefix, nodes, splits)) is not None:
        pass
    elif (
        heads
        and _heads_first_rotary(producer, heads)
        and (rotated := transposed_source(graph, producer.inputs[0], prefix, nodes, splits)) is not None
    ):
        flat = ir.node("Reshape", [rotated, shape], name=f"{prefix}/to_bsh")
        attributes = {a.name: a.value for a in producer.attributes.values()} | {"num_heads": heads}
        rotary = ir.node(
            "RotaryEmbedding",
            [flat.outputs[0], *producer.inputs[1:]],
            attributes,
            domain="com.microsoft",
            name=f"{prefix}/rotary_bsh",
        )
        return rotary.outputs[0], [*nodes, flat, rotary]
    else:
        nodes.append(ir.node("Transpose", [value], {"perm": [0, 2, 1, 3]}, name=f"{prefix}/to_bsnh"))
        source = nodes[-1].outputs[0]
    nodes.append(ir.node("Reshape", [source, shape], name=f"{prefix}/to_bsh"))
    return nodes[-1].outputs[0], nodes


def _heads_first_rotary(node: ir.Node | None, heads: int) -> bool:
    """A ``com.microsoft::RotaryEmbedding`` (``num_heads`` unset or ``heads``, as a partial rotation sets it; no
    packed batching) with its position ids and caches; ``flat_heads`` then asks whether its input is the
    Transpose of a [B,S,N,D] value (so 4-D [B,N,S,D])."""
    if node is None or node.op_type != "RotaryEmbedding" or node.domain != "com.microsoft":
        return False
    if len(node.inputs) != 4 or any(v is None for v in node.inputs):
        return False
    return node.attributes.get_int("num_heads", 0) in (0, heads) and not node.attributes.get_int(
        "is_packed_batching", 0
    )


def _mask_length(graph: ir.Graph, mask: ir.Value, prefix: str) -> tuple[list[ir.Node], ir.Value]:
    """The nodes computing the attention mask's length (past + new tokens) as int32 (GQA's
    total_sequence_length), the mask's Shape first, and that length."""
    shape = ir.node("Shape", [mask], name=f"{prefix}mask_shape")
    index = const(graph, f"{prefix}index_1", np.array(1, np.int64))
    length = ir.node("Gather", [shape.outputs[0], index], {"axis": 0}, name=f"{prefix}mask_length")
    total = ir.node("Cast", [length.outputs[0]], {"to": ir.DataType.INT32}, name=f"{prefix}total_sequence_length")
    return [shape, length, total], total.outputs[0]


def full_lengths(graph: ir.Graph, mask_name: str) -> tuple[ir.Value, ir.Value]:
    """seqlens_k = S - 1 for every row and total_sequence_length = S, S the attention mask's length: every key
    counted, for a bidirectional layer whose padding the mask carries as GroupQueryAttention's bias."""
    mask = next(v for v in graph.inputs if v.name == mask_name)
    measured, total = _mask_length(graph, mask, "fuse_gqa/full_")
    start = const(graph, "fuse_gqa/full_0", np.array([0], np.int64))
    end = const(graph, "fuse_gqa/full_1", np.array([1], np.int64))
    rows = ir.node("Slice", [measured[0].outputs[0], start, end], name="fuse_gqa/full_rows")  # the mask's batch
    one = const(graph, "fuse_gqa/full_one", np.array(1, np.int32))
    last = ir.node("Sub", [total, one], name="fuse_gqa/full_last_key")
    seqlens = ir.node("Expand", [last.outputs[0], rows.outputs[0]], name="fuse_gqa/full_seqlens")
    graph.insert_before(next(iter(graph)), [*measured, rows, last, seqlens])
    seqlens.outputs[0].name, total.name = "fuse_gqa/full_seqlens_k", "fuse_gqa/full_total_sequence_length"
    return seqlens.outputs[0], total


def rewrite_gqa(
    graph: ir.Graph,
    site: Site,
    lengths_: tuple[ir.Value, ir.Value],
    sizes: tuple[int, int, int],
    window: int | None,
    *,
    bias: ir.Value | None = None,
) -> int:
    """The layer as GroupQueryAttention on its new q, k, v and its cache; GQA's presents replace the cache
    Concats (and take their graph output names). Returns how many past crops it dropped (below).

    A sliding-window export crops the past before attention, ``past[:, :, -C:]`` (Mistral: C = W - 1), and
    the present after. With a window of W keys (``local_window_size``) the first new query, at position P
    (the past's length), sees keys P - W + 1 .. P: the last W - 1 of the past and itself, later queries
    fewer of the past. So a crop keeping C >= W - 1 positions never removes a key any query reads, and
    ``Concat(past, new)[-C':]``, the present crop, which stays, is the same with the past cropped first or
    not (C' <= C + new). GQA then gets the whole past, which also matches its ``seqlens_k`` and
    ``total_sequence_length``: they count the attention mask, which spans the uncropped past (the exports
    read here refuse a past longer than W - 1: their mask and keys then differ in length). One copy of the
    cache per crop and layer fewer each step."""
    heads, kv_heads, _ = sizes
    seqlens, total = lengths_
    prefix = f"fuse_gqa/layer_{site.layer}"
    nodes: list[ir.Node] = []
    flat = []
    splits: dict = {}  # a fused qkv's Split, made once on [B,S,N,3D] for q, k and v (``_head_layout``)
    for role, value, count in (("q", site.q, heads), ("k", site.k_new, kv_heads), ("v", site.v_new, kv_heads)):
        bsnd = role == "k" and site.k_bsnd
        out, made = flat_heads(graph, value, f"{prefix}/{role}", bsnd=bsnd, heads=count, splits=splits)
        flat.append(out)
        nodes += made
    attributes: dict[str, Any] = {"num_heads": heads, "kv_num_heads": kv_heads, "scale": float(site.scale)}
    if window is not None:
        attributes["local_window_size"] = window - gqa_window_offset()
    if site.softcap:
        attributes["softcap"] = float(site.softcap)
    past = [site.k_past, site.v_past]
    if window is not None:
        whole = [crop_source(value, window - 1) for value in past]
        past = [source or value for source, value in zip(whole, past, strict=True)]
    # after seqlens_k and total: cos/sin caches and position ids (unset), attention_bias, head_sink
    tail: list[ir.Value | None] = [None, None, None, bias, None]
    if bias is not None:  # a bidirectional layer: its mask (padding, a window) is the bias
        attributes["causal"] = 0
    if site.sink is not None:
        dtype = site.q.dtype if site.q.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16) else ir.DataType.FLOAT
        tail[4] = const(graph, f"{prefix}/head_sink", np.broadcast_to(site.sink, (heads,)).astype(dtype.numpy()))
    while tail and tail[-1] is None:
        tail.pop()
    gqa = ir.node(
        "GroupQueryAttention",
        [*flat, *past, seqlens, total, *tail],
        attributes,
        domain="com.microsoft",
        num_outputs=3,
        name=f"{prefix}/GroupQueryAttention",
    )
    out, present_k, present_v = gqa.outputs
    present_k.name, present_v.name = f"{prefix}/present_key", f"{prefix}/present_value"
    _replace_output(graph, site, [*nodes, gqa], out, sizes)
    if site.k_past is None:
        _presents_without_past(graph, site, nodes, (present_k, present_v))
        return 0
    for old, new in ((site.k_all, present_k), (site.v_all, present_v)):
        if old.type is not None:
            new.type, new.shape = old.type, old.shape
        take_graph_output(graph, old, new, "/unfused")
        ir.convenience.replace_all_uses_with(old, new)
    return sum(new is not old for new, old in zip(past, (site.k_past, site.v_past), strict=True))


def _presents_without_past(
    graph: ir.Graph, site: Site, fed: list[ir.Node], presents: tuple[ir.Value, ir.Value]
) -> None:
    """Without a cache, the graph's present outputs (a no-cache decoder's: Optimum's merged no-cache branch)
    become GQA's own ``present_key``/``present_value`` where they are ``k_new``/``v_new`` themselves.

    Why that is exact: with no past, GQA's present is its k (v) input [B,S,kv*D] heads first, [B,kv,S,D],
    copied as given (``do_rotary=0``: no rotation of its own) and ``total_sequence_length`` long, which ORT
    (1.32) refuses unless it equals past + new = S. GQA's k input is ``flat_heads(k_new)``, a layout of
    ``k_new`` (``Reshape`` of the [B,S,kv,D] value ``k_new`` transposes, or the same rotation redone flat on
    it), so the present holds ``k_new``'s values in ``k_new``'s layout: the rotation the present carries is
    the one GQA attends with. Keys GQA reads as [B,S,kv,D] (``k_bsnd``), or through a Transpose of
    ``k_new`` itself (nothing saved), keep their own present. The ops that computed the present for the
    output alone (per layer a Transpose of v, and of k its head split and Transpose) are then dead."""
    for new, old, bsnd in zip(presents, (site.k_new, site.v_new), (site.k_bsnd, False), strict=True):
        if bsnd or not old.is_graph_output() or any(old in node.inputs for node in fed):
            continue
        if old.type is not None:
            new.type, new.shape = old.type, old.shape
        take_graph_output(graph, old, new, "/unfused")


def rewrite_mha(graph: ir.Graph, site: Site, sizes: tuple[int, int, int], value_head: int) -> None:
    """The layer's attention core as MultiHeadAttention: q flat, the repeated keys and values as they are
    ([B,H,T,D], after the cache Concat, which stays), the graph's own mask as ``attention_bias``. Exact for
    any mask, padding and batch: the fallback where GroupQueryAttention does not fit. Values of another head
    size than the keys (``value_head``: multi-head latent attention) go flat, [B,T,H*D] each: ORT's kernel
    takes keys and values of different widths only so."""
    heads = sizes[0]
    prefix = f"fuse_gqa/layer_{site.layer}"
    q, nodes = flat_heads(graph, site.q, f"{prefix}/q", bsnd=False, heads=heads)
    key, value = site.k_rep, site.v_rep
    if site.k_bsnd or value_head != sizes[2]:  # MHA then takes both keys and values as [B,S,H*D]
        key, made_k = flat_heads(graph, site.k_rep, f"{prefix}/k", bsnd=site.k_bsnd)
        value, made_v = flat_heads(graph, site.v_rep, f"{prefix}/v", bsnd=False)
        nodes += made_k + made_v
    mha = ir.node(
        "MultiHeadAttention",
        [q, key, value, None, None, site.mask],
        {"num_heads": heads, "scale": float(site.scale)},
        domain="com.microsoft",
        name=f"{prefix}/MultiHeadAttention",
    )
    out, guard = mha.outputs[0], []
    if site.guarded:  # MultiHeadAttention returns NaN for a query whose every key is masked with -inf
        guard = nan_guard.zero_nan_rows(out)
        out = guard[-1].outputs[0]
    _replace_output(graph, site, [*nodes, mha, *guard], out, (*sizes[:2], value_head))


def _replace_output(graph: ir.Graph, site: Site, nodes: list[ir.Node], out: ir.Value, sizes) -> None:
    """Insert ``nodes`` before the layer's MatMul(probs, v) (every input they read is computed by then) and
    route ``out`` [B,S,H*D], reshaped to [B,S,H,D], to the readers of the layer's attention output."""
    heads, _, head_size = sizes
    prefix = f"fuse_gqa/layer_{site.layer}"
    out.name = f"{prefix}/out"
    split = const(graph, f"{prefix}/heads_shape", np.array([0, 0, heads, head_size], np.int64))
    unflat = ir.node("Reshape", [out, split], name=f"{prefix}/to_heads")
    graph.insert_before(site.context, [*nodes, unflat])
    ir.convenience.replace_all_uses_with(site.out, unflat.outputs[0])
