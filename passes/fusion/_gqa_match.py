"""The structural half of ``fuse_gqa``: one decoder self-attention, found from its ``Softmax``, or the reason
it is not one.

What every exporter we read (TorchScript eager and SDPA, dynamo; Llama, Qwen2, Phi-3, Mistral, GPT-2) emits
for one layer, by value, with the names this module gives them::

    q [B,H,S,D] (opaque: rotated or not) ------------------------------------+
    past_k [B,kv,P,D] --+                                                     |
    k_new [B,kv,S,D] ---Concat(axis 2)--> k_all (the present key)            |
                         repeat_kv: Unsqueeze(2)-Expand-Reshape --> k_rep     |
                                                  Transpose(0,1,3,2)          v
                         MatMul(q, k^T) --Mul|Div(scale)--Add(mask)--Softmax--(Cast)--MatMul(., v_rep)
                                                                           --Transpose(0,2,1,3)--> out [B,S,H,D]
    past_v, v_new ---Concat(axis 2)--> v_all --repeat_kv--> v_rep

TorchScript's SDPA decomposition puts a ``Reshape`` back to the query's 4-D shape between ``MatMul(., v_rep)``
and the ``Transpose``, its target computed from the product's own ``Shape``: looked through (``Site.reshaped``),
the probe proving it keeps every dim. Without a cache, ``k_all`` is ``k_new`` itself; with as many kv heads as
heads (GPT-2), ``k_rep`` is ``k_all``.
The scale may also sit on q and k^T (one Mul each). Soft-capped scores (Gemma 2: ``cap * tanh(scores /
cap)`` before the mask) are read as the scores and the cap (``Site.softcap``). Attention sinks (GPT-OSS: a
learned logit per head joins each row, ``Softmax(Concat(scores + mask, sink))[..., :-1]``, the row's max
subtracted first) are read as the scores and the sinks (``Site.sink``), GroupQueryAttention's ``head_sink``;
so is the same sink written after the context (Granite SWA: ``MatMul(probs, v) * sigmoid(logsumexp(scores) -
sink)``, the share the sink column would have taken, ``_sink_scaled``).
Casts between float types around the Softmax (a float16 export's softmax in float32) and single-input
Concat/Identity copies are looked through. q, k_new and v_new are opaque values, so rotary embedding, fused
(``fuse_rotary``'s RotaryEmbedding) or not, composes in either order. Shapes (heads,
kv heads, head size) are not read here: ``_gqa_probe`` measures them, and also what the mask computes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from core.inputs.graph import const_array
from passes._infra import NonMatch
from passes._match import const_ints
from passes.fusion._fusion_families import is_router
from passes.fusion._rotary_eval import axes_of
from passes.fusion._slice_dims import keeps_everything

_ONNX = ("", "ai.onnx")
EXPECTED = (
    "Softmax(axis -1) of [Mul|Div](MatMul(q, Transpose(0,1,3,2)(k)), scale) + mask, then MatMul(., v) and "
    "Transpose(0,2,1,3); k and v each [Concat(past, new, axis 2)] and [Unsqueeze(2)-Expand-Reshape] (repeat_kv)"
)


@dataclasses.dataclass
class Site:
    """One attention layer, matched. ``k_new``/``v_new`` are the layer's new keys and values ([B,kv,S,D]),
    ``k_past``/``v_past`` what the Concat prepends (None without a cache), ``k_all``/``v_all`` the Concat
    outputs (the present cache), ``out`` the [B,S,H,D] value the layer's output projection reads."""

    layer: int
    softmax: ir.Node
    q: ir.Value
    k_new: ir.Value
    v_new: ir.Value
    k_past: ir.Value | None
    v_past: ir.Value | None
    k_all: ir.Value
    v_all: ir.Value
    k_rep: ir.Value
    v_rep: ir.Value
    mask: ir.Value | None
    scale: float
    context: ir.Node  # MatMul(probs, v): every input of the fused op is computed before it
    out: ir.Value
    k_bsnd: bool = False  # k_new is [B,S,kv,D] (keys transposed once, straight to k^T)
    # TorchScript's SDPA reshapes MatMul(probs, v) to the query's shape before the Transpose: that Reshape's
    # output (the probe checks it keeps every dim), else None.
    reshaped: ir.Value | None = None
    # Gemma 2's logit soft-capping, cap * tanh(scores / cap) between the scale and the mask: the cap, else 0
    softcap: float = 0.0
    # The probabilities went through the exporter's NaN guard (``Where(IsNaN(p), 0, p)``), which defines a
    # fully masked query's output as 0: a fused op that returns NaN there must get it back.
    guarded: bool = False
    # Attention sinks: the logit each head's extra column holds (its softmax share is then dropped), else None
    sink: np.ndarray | None = None

    def probed(self) -> list[ir.Value]:
        """The values whose run-time shapes ``_gqa_probe`` measures for this site."""
        extra = [self.context.outputs[0], self.reshaped] if self.reshaped is not None else []
        return [self.q, self.k_all, self.v_all, self.k_rep, self.v_rep, self.out, *extra]


class Declined(Exception):
    """A candidate that is not the pattern; the message says which part was expected and what was found."""


def match_sites(graph: ir.Graph) -> tuple[list[Site], list[NonMatch]]:
    """Every Softmax of ``graph`` as a ``Site`` or a ``NonMatch`` naming the part of the pattern that blocked
    it. Nothing is edited."""
    sites: list[Site] = []
    declined: list[NonMatch] = []
    softmaxes = [n for n in graph if n.op_type == "Softmax" and n.domain in _ONNX]
    for node in [n for n in softmaxes if is_router(n)]:  # numbered apart: the layers are the attentions
        reason = f"node {node.name}: a mixture-of-experts router (its scores multiply weights only), not attention"
        declined.append(NonMatch(reason, node=node.name, op_type="Softmax"))
    for layer, node in enumerate(n for n in softmaxes if not is_router(n)):
        try:
            sites.append(_match(layer, node))
        except Declined as exc:
            reason = f"attention layer {layer} (node {node.name}): expected {EXPECTED}; {exc}"
            declined.append(NonMatch(reason, node=node.name, op_type="Softmax"))
    return sites, declined


def _match(layer: int, softmax: ir.Node) -> Site:
    axis = softmax.attributes.get_int("axis", -1)
    rank = len(softmax.inputs[0].shape) if softmax.inputs[0].shape is not None else 4
    if axis not in (-1, rank - 1):
        raise Declined(f"found Softmax over axis {axis}, not the keys (-1)")
    unguarded = _through_casts(softmax.outputs[0])
    probs = _through_nan_guard(unguarded)
    guarded = probs is not unguarded
    sunk = _sink_column_dropped(probs)
    probs = probs if sunk is None else sunk
    context = _single_use(probs, "MatMul", "the Softmax's output")
    if context.inputs[0] is not probs:
        raise Declined("found the probabilities as the MatMul's second input, not its first")
    scaled = _sink_scaled(context.outputs[0], softmax)
    if scaled is not None and sunk is not None:
        raise Declined("found both a dropped sink column and a sink scale after the context")
    context_out, scaled_sink = scaled if scaled is not None else (context.outputs[0], None)
    reshaped = _shape_restoring_reshape(context_out)
    out_t = _single_use(reshaped or context_out, "Transpose", "MatMul(probs, v)")
    if list(out_t.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        raise Declined(f"found Transpose perm {list(out_t.attributes.get_ints('perm', []))} after MatMul(probs, v)")
    scores, sink = _strip_max_shift(_under_float_cast(softmax.inputs[0])), None
    if sunk is not None:
        scores, sink = _strip_sink(scores)
    sink = scaled_sink if scaled_sink is not None else sink
    scores, mask = _strip_mask(scores)
    scores, softcap = _strip_softcap(scores)
    q, kt, scale = _strip_scale(scores)
    k_rep, k_bsnd = _transposed_keys(kt)
    k_all, v_all = _unrepeat(k_rep, "k"), _unrepeat(context.inputs[1], "v")
    if k_bsnd and (k_all is not k_rep or _cache_concat(k_all)):
        raise Declined("found keys transposed straight from [B,S,N,D] but repeated or concatenated with a cache")
    k_past, k_new = _split_cache(k_all, "key")
    v_past, v_new = _split_cache(v_all, "value")
    if (k_past is None) != (v_past is None):
        raise Declined("found a cache Concat on one of key and value only")
    return Site(
        layer, softmax, q, k_new, v_new, k_past, v_past, k_all, v_all, k_rep, context.inputs[1], mask, scale,
        context, out_t.outputs[0], k_bsnd, reshaped, softcap, guarded, sink,
    )  # fmt: skip


def _shape_restoring_reshape(value: ir.Value) -> ir.Value | None:
    """The output of the one ``Reshape`` reading ``value`` (MatMul(probs, v)) when nothing else reads it but
    ``Shape`` nodes (the target shape's arithmetic): TorchScript's SDPA restores the query's 4-D shape so.
    The probe proves it keeps every dim (``fuse_gqa._sizes``); None for any other reader."""
    uses = _live_uses(value)
    reshapes = [u.node for u in uses if u.node.op_type == "Reshape" and u.node.domain in _ONNX]
    shapes = [u.node for u in uses if u.node.op_type == "Shape" and u.node.domain in _ONNX]
    if len(reshapes) != 1 or len(reshapes) + len(shapes) != len(uses) or reshapes[0].inputs[0] is not value:
        return None
    return reshapes[0].outputs[0]


def _producer(value: ir.Value | None, *ops: str) -> ir.Node | None:
    """The node of one of ``ops`` computing ``value``, through Identity copies (CSE leaves them)."""
    node = value.producer() if value is not None else None
    while node is not None and node.op_type == "Identity" and node.domain in _ONNX and "Identity" not in ops:
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is None or node.domain not in _ONNX or node.op_type not in ops:
        return None
    return node


def _live(node: ir.Node, depth: int = 8) -> bool:
    """Whether anything the graph returns reads ``node``'s outputs: the passes before this one (CSE's Identity
    copies) leave dead consumers behind until dead_node_elimination runs last."""
    if depth == 0:
        return True
    return any(o.is_graph_output() or any(_live(u.node, depth - 1) for u in o.uses()) for o in node.outputs)


def _live_uses(value: ir.Value) -> list:
    return [u for u in value.uses() if _live(u.node)]


# Casts between these are read through around the Softmax: a half-precision export computes its softmax in
# float32 (``Cast(to=float) -> Softmax -> Cast(to=float16)``), which is what GroupQueryAttention and
# MultiHeadAttention do inside for float16 and bfloat16 inputs, so the fused op keeps that precision.
_FLOATS = frozenset({ir.DataType.FLOAT.value, ir.DataType.FLOAT16.value, ir.DataType.BFLOAT16.value})


def _through_casts(value: ir.Value) -> ir.Value:
    """Follow single-use Identities and Casts from one float type to another (TorchScript casts the
    probabilities to float, twice; a float16 export back to float16)."""
    while True:
        uses = _live_uses(value)
        if len(uses) != 1 or uses[0].node.op_type not in ("Cast", "Identity") or uses[0].node.domain not in _ONNX:
            return value
        node = uses[0].node
        if node.op_type == "Cast" and not _float_cast(value, node):
            return value
        value = node.outputs[0]


def _float_cast(value: ir.Value, cast: ir.Node) -> bool:
    # An untyped value (TorchScript writes no value_info) is taken as float32, the exporters' default.
    own = value.dtype.value if value.dtype is not None else ir.DataType.FLOAT.value
    return own in _FLOATS and cast.attributes.get_int("to", 0) in _FLOATS


def _under_float_cast(value: ir.Value) -> ir.Value:
    """The scores under the ``Cast(to=float)`` a half-precision export puts before its Softmax (see _FLOATS),
    else ``value``."""
    cast = _producer(value, "Cast")
    if cast is None or cast.inputs[0] is None or not _float_cast(cast.inputs[0], cast) or len(_live_uses(value)) != 1:
        return value
    return cast.inputs[0]


def _through_nan_guard(probs: ir.Value) -> ir.Value:
    """The guarded probabilities of ``Where(IsNaN(p), 0, p)``, which the exporters' SDPA decomposition writes
    to zero fully-masked rows; ``probs`` itself when no such guard reads it. Dropping the guard is exact where
    no row is fully masked (a causal mask with right padding always leaves a query its own key); the pass's
    verification runs such masks, and left padding is refused for GQA anyway (``fuse_gqa.LEFT_PADDING``)."""
    uses = _live_uses(probs)
    where = next((u.node for u in uses if u.node.op_type == "Where" and u.node.domain in _ONNX), None)
    isnan = next((u.node for u in uses if u.node.op_type == "IsNaN" and u.node.domain in _ONNX), None)
    if len(uses) != 2 or where is None or isnan is None:  # IsNaN reads p once, Where once (as "else")
        return probs
    condition, fill, other = where.inputs
    constant = ir.convenience.get_const_tensor(fill) if fill is not None else None  # TorchScript: a Constant
    if condition is not isnan.outputs[0] or other is not probs or constant is None or constant.numpy().any():
        return probs
    return _through_casts(where.outputs[0])


def _sink_column_dropped(probs: ir.Value) -> ir.Value | None:
    """The probabilities without their last column, ``Slice(p, 0, -1, axis=-1)`` (the sink's share, which no
    value reads), through float Casts; None when ``probs`` is not so cut."""
    uses = _live_uses(probs)
    cut = uses[0].node if len(uses) == 1 else None
    if cut is None or cut.op_type != "Slice" or cut.domain not in _ONNX or len(cut.inputs) < 4:
        return None
    steps = const_ints(cut.inputs[4]) if len(cut.inputs) > 4 and cut.inputs[4] is not None else [1]
    starts, ends, axes = (const_ints(v) for v in cut.inputs[1:4])
    if starts != [0] or ends != [-1] or axes not in ([-1], [3]):
        return None
    return _through_casts(cut.outputs[0]) if steps == [1] else None


def _strip_max_shift(value: ir.Value) -> ir.Value:
    """x of ``Sub(x, ReduceMax(x, axis=-1, keepdims=1))``, which only does what the Softmax does inside (the
    shifted row's max is exactly 0, so its exponentials are the same), else ``value``."""
    sub = _producer(value, "Sub")
    top = _producer(sub.inputs[1], "ReduceMax") if sub is not None else None
    if top is None or top.inputs[0] is not sub.inputs[0] or top.attributes.get_int("keepdims", 1) != 1:
        return value
    return sub.inputs[0] if axes_of(top) in ([-1], [3]) else value


def _strip_sink(value: ir.Value) -> tuple[ir.Value, np.ndarray]:
    """(scores, sink per head) of ``Concat(scores, broadcast(sink), axis=-1)`` whose last column the probabilities
    drop: the sink a constant broadcast to one column ([1, H, 1, 1] or one value), through Expand, Reshape,
    Unsqueeze and float Casts."""
    concat = _producer(value, "Concat")
    if concat is None or len(concat.inputs) != 2 or concat.attributes.get_int("axis", 0) not in (-1, 3):
        raise Declined("found the Softmax's last column dropped, but not over Concat(scores, sink, axis=-1)")
    return concat.inputs[0], _per_head_constant(concat.inputs[1])


def _through_float_casts(value: ir.Value, *ops: str) -> ir.Node | None:
    """The node of one of ``ops`` computing ``value``, read up through float-to-float Casts."""
    node = _producer(value, "Cast", *ops)
    while node is not None and node.op_type == "Cast" and "Cast" not in ops:
        if not _float_cast(node.inputs[0], node):
            return None
        node = _producer(node.inputs[0], "Cast", *ops)
    return node


def _per_head_constant(value: ir.Value) -> np.ndarray:
    """The float constant under Expand, Reshape, Unsqueeze and float Casts of ``value``, one value per head
    (at most one dim above 1), flattened; Declined, saying what computes it, otherwise."""
    while (array := const_array(value)) is None:
        node = _producer(value, "Expand", "Reshape", "Unsqueeze", "Cast")
        if node is None or (node.op_type == "Cast" and not _float_cast(node.inputs[0], node)):
            found = value.producer().op_type if value.producer() is not None else "a graph input"
            raise Declined(f"found the sink computed by {found}, not a constant per head")
        value = node.inputs[0]
    if not np.issubdtype(array.dtype, np.floating) or sum(d > 1 for d in array.shape) > 1:
        raise Declined(f"found a sink of shape {list(array.shape)}, not one value per head")
    return array.reshape(-1).astype(np.float32)


def _sink_scaled(context: ir.Value, softmax: ir.Node) -> tuple[ir.Value, np.ndarray] | None:
    """(the scaled context, the sink per head) of ``Mul(context, Unsqueeze(Sigmoid(ReduceLogSumExp(x, axis=-1)
    - sink), -1))`` where x is what the Softmax reads (float Casts looked through); None for any other reader.
    ``softmax(x) * sigmoid(lse(x) - s)`` is ``exp(x) / (sum(exp(x)) + exp(s))``, the kept columns of the
    softmax over ``[x, s]``: GroupQueryAttention's ``head_sink``."""
    uses = _live_uses(context)
    mul = uses[0].node if len(uses) == 1 else None
    if mul is None or mul.op_type != "Mul" or mul.domain not in _ONNX:
        return None
    gate = mul.inputs[1] if mul.inputs[0] is context else mul.inputs[0]
    node = _through_float_casts(gate, "Unsqueeze", "Sigmoid")
    unsqueezed = node is not None and node.op_type == "Unsqueeze"
    if unsqueezed:
        if axes_of(node) not in ([-1], [3]):
            return None
        node = _through_float_casts(node.inputs[0], "Sigmoid")
    sub = _through_float_casts(node.inputs[0], "Sub") if node is not None and node.op_type == "Sigmoid" else None
    lse = _through_float_casts(sub.inputs[0], "ReduceLogSumExp") if sub is not None else None
    if lse is None or axes_of(lse) not in ([-1], [3]) or lse.attributes.get_int("keepdims", 1) != int(not unsqueezed):
        return None
    if lse.inputs[0] not in (softmax.inputs[0], _under_float_cast(softmax.inputs[0])):
        return None
    return mul.outputs[0], _per_head_constant(sub.inputs[1])


def _single_use(value: ir.Value, op: str, what: str) -> ir.Node:
    uses = _live_uses(value)
    if len(uses) != 1 or uses[0].node.op_type != op or uses[0].node.domain not in _ONNX:
        found = ", ".join(u.node.op_type for u in uses) or "no consumer"
        raise Declined(f"expected {what} to feed one {op}; found {found}")
    return uses[0].node


def _scalar(value: ir.Value | None) -> float | None:
    array = const_array(value)
    if array is None or array.size != 1 or not np.issubdtype(array.dtype, np.floating):
        return None
    return float(array.reshape(-1)[0])


def _strip_mask(value: ir.Value) -> tuple[ir.Value, ir.Value | None]:
    """The scores under an additive mask, and the mask (None when there is none)."""
    add = _producer(value, "Add")
    if add is None:
        return value, None
    for i in (0, 1):
        if _producer(add.inputs[i], "Mul", "Div", "MatMul") is not None:
            return add.inputs[i], add.inputs[1 - i]
    raise Declined("found an Add before the Softmax whose inputs are not scores (Mul, Div or MatMul) and a mask")


def _strip_softcap(value: ir.Value) -> tuple[ir.Value, float]:
    """(scores, cap) from ``Mul(Tanh(Div(scores, cap)), cap)`` (``Mul(scores, 1/cap)`` inside as well), the
    soft-capping GroupQueryAttention applies between the scale and the mask (its ``softcap``); (value, 0.0)
    when the scores are not capped."""
    outer = _producer(value, "Mul")
    if outer is None:
        return value, 0.0
    cap = _scalar(outer.inputs[1]) or _scalar(outer.inputs[0])
    tanh = _producer(outer.inputs[0], "Tanh") or _producer(outer.inputs[1], "Tanh")
    if cap is None or tanh is None:
        return value, 0.0
    inner = _producer(tanh.inputs[0], "Div", "Mul")
    c = None if inner is None else _scalar(inner.inputs[1])
    if c is None or c == 0.0:
        raise Declined(f"found Tanh before the Softmax capping by {cap:g}, not of scores / {cap:g}")
    if not np.isclose(c if inner.op_type == "Div" else 1.0 / c, cap, rtol=1e-6):
        raise Declined(f"found a soft-cap of cap * tanh(scores / c) with c != cap ({cap:g})")
    return inner.inputs[0], cap


def _strip_scale(value: ir.Value) -> tuple[ir.Value, ir.Value, float]:
    """(q, k^T, scale) from ``MatMul(q, kT) * c``, ``MatMul(q, kT) / c`` or ``MatMul(q * a, kT * b)``."""
    scale = 1.0
    node = _producer(value, "Mul", "Div")
    if node is not None:
        c = _scalar(node.inputs[1]) if node.op_type == "Div" else _scalar(node.inputs[1]) or _scalar(node.inputs[0])
        if c is None:
            raise Declined(f"found {node.op_type} of the scores by a non-constant")
        scale = 1.0 / c if node.op_type == "Div" else c
        value = node.inputs[0] if _scalar(node.inputs[0]) is None else node.inputs[1]
    matmul = _producer(value, "MatMul")
    if matmul is None:
        found = value.producer().op_type if value.producer() is not None else "a graph input"
        raise Declined(f"expected MatMul(q, k^T) under the scale; found {found}")
    q, kt = matmul.inputs[0], matmul.inputs[1]
    for side in ("q", "k"):
        operand = q if side == "q" else kt
        mul = _producer(operand, "Mul")
        c = None if mul is None else (_scalar(mul.inputs[1]) or _scalar(mul.inputs[0]))
        if mul is not None and c is not None:
            scale *= c
            operand = mul.inputs[0] if _scalar(mul.inputs[0]) is None else mul.inputs[1]
            q, kt = (operand, kt) if side == "q" else (q, operand)
    return q, kt, scale


def _transposed_keys(kt: ir.Value) -> tuple[ir.Value, bool]:
    """(k, whether k is [B,S,N,D]): ``Transpose(0,1,3,2)`` of heads-first keys (or its batched form, see
    ``_folded_transpose``), or ``Transpose(0,2,3,1)`` of the projection split into heads (dynamo's GPT-2
    without a cache transposes once)."""
    folded = _folded_transpose(kt)
    if folded is not None:
        return folded, False
    node = _producer(kt, "Transpose")
    perm = list(node.attributes.get_ints("perm", [])) if node is not None else None
    if node is None or perm not in ([0, 1, 3, 2], [0, 2, 3, 1]):
        found = f"Transpose{perm}" if node is not None else (kt.producer().op_type if kt.producer() else "input")
        raise Declined(f"expected k^T = Transpose(0,1,3,2)(k); found {found}")
    return node.inputs[0], perm == [0, 2, 3, 1]


def _folded_transpose(kt: ir.Value) -> ir.Value | None:
    """k under dynamo's batched k^T, ``Reshape(Transpose(0,2,1)(Reshape(k, [B*H, S, D])), [B, H, D, S])``
    (the SDPA decomposition's bmm form), else None. The ranks are read from the graph; that the outer
    Reshape restores [B, H, D, S] is what the pass's verification then proves on every input set."""
    outer = _producer(kt, "Reshape")
    swap = _producer(outer.inputs[0], "Transpose") if outer is not None else None
    inner = _producer(swap.inputs[0], "Reshape") if swap is not None else None
    if inner is None or list(swap.attributes.get_ints("perm", [])) != [0, 2, 1]:
        return None
    k = inner.inputs[0]
    ranks = (k.shape, inner.outputs[0].shape, kt.shape)
    if any(shape is None for shape in ranks) or [len(shape) for shape in ranks] != [4, 3, 4]:
        return None
    return k


def _whole(value: ir.Value) -> ir.Value:
    """``value`` under any ``Slice`` that keeps everything (``_slice_dims.keeps_everything``): the dynamo
    exporter's ``x[:, :, None, :, :]`` without its optimizer (``optimize=False``) writes them around
    repeat_kv's Unsqueeze."""
    node = _producer(value, "Slice")
    while node is not None and keeps_everything(node):
        value = node.inputs[0]
        node = _producer(value, "Slice")
    return value


def _unrepeat(value: ir.Value, which: str) -> ir.Value:
    """The kv-head tensor under repeat_kv ``Reshape(Expand(Unsqueeze(x, 2)))``, else the value itself (the
    probe then checks it has as many heads as q). Slices that keep everything are read through."""
    reshape = _producer(value, "Reshape")
    expand = _producer(reshape.inputs[0], "Expand") if reshape is not None else None
    unsqueeze = _producer(_whole(expand.inputs[0]), "Unsqueeze") if expand is not None else None
    if unsqueeze is None:
        return value
    axes = const_array(unsqueeze.inputs[1]) if len(unsqueeze.inputs) > 1 else None
    if axes is None and "axes" in unsqueeze.attributes:
        axes = np.array(unsqueeze.attributes.get_ints("axes", []))
    if axes is None or axes.reshape(-1).tolist() != [2]:
        raise Declined(f"found repeat_kv of {which} unsqueezing axes {None if axes is None else axes.tolist()}, not 2")
    return _whole(unsqueeze.inputs[0])


def _cache_concat(value: ir.Value) -> bool:
    """Whether ``value`` is a Concat other than of the head dim's halves (partial rotary: GPT-J's rotated and
    plain parts of [B,S,N,D] keys joined on the last axis), so possibly a cache's."""
    concat = _producer(value, "Concat")
    return concat is not None and concat.attributes.get_int("axis", 0) not in (3, -1)


def _split_cache(value: ir.Value, which: str) -> tuple[ir.Value | None, ir.Value]:
    """(past, new) of ``Concat(past, new, axis=2)``; (None, value) when there is no cache Concat."""
    concat = _producer(value, "Concat")
    if concat is None:
        return None, value
    axis = concat.attributes.get_int("axis", 0)
    if axis in (3, -1):  # partial rotary joins rotated and plain halves of the head dim: the keys themselves
        return None, value
    if axis not in (2, -2) or len(concat.inputs) != 2:
        raise Declined(f"found the {which} from a Concat of {len(concat.inputs)} inputs on axis {axis}")
    past = concat.inputs[0]
    copy = _producer(past, "Concat", "Identity")
    while copy is not None and len(copy.inputs) == 1:  # TorchScript's single-input Concat copy of the past
        past = copy.inputs[0]
        copy = _producer(past, "Concat", "Identity")
    return past, concat.inputs[1]
