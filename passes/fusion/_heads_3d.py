"""Attention on heads folded into the batch, sequence first (``F.multi_head_attention_forward``), fused to
``com.microsoft::MultiHeadAttention``.

``torch.nn.MultiheadAttention`` (and every model that calls ``F.multi_head_attention_forward`` with
``need_weights=True``: the module's default; WavLM) projects a sequence-first ``[S, B, E]``
input, folds the heads into the batch and multiplies with ``bmm``::

    P[S,B,E] --Reshape[S,B*N,d]--Transpose(1,0,2)--> q3[B*N,S,d] (--Mul(c)-->)  MatMul --(+ bias)--> Softmax
    Pk[S,B,E] --Reshape[S,B*N,d]--Transpose(1,2,0)--> kT3[B*N,d,S] ------------^                       |
    Pv[S,B,E] --Reshape[S,B*N,d]--Transpose(1,0,2)--> v3 ------------------------------------------> MatMul
      --> o3[B*N,S,d] --Transpose(1,0,2)--> [S,B*N,d] --Reshape[S*B,E]--> out projection

The bias is whatever is added to the scores: the key padding mask and ``attn_mask`` merged to ``[B*N, 1|S,
T]``, or WavLM's relative position bias gated by a function of the hidden states (``[B*N, S, T]``, computed
from activations, so no constant folding helps). onnxscript's SDPA rule reads 4-D heads only and finds no
alternative here, so none of these attentions fused. Each such site becomes::

    Q = Transpose(P, [1,0,2])[B,S,E], K, V alike;  bias4 = Reshape(bias, [-1, N, s, t]) (Expand to [.., S, T])
    y[B,S,E] = MultiHeadAttention(Q, K, V, attention_bias=bias4, num_heads=N, scale=c)
    [S,B*N,d] = Reshape(Transpose(y, [1,0,2]), [0, -1, d])      (what the out projection read before)

Exact: MultiHeadAttention splits ``Q[b, s, n*d + j]`` into head ``n`` of batch ``b``, which is ``q3[b*N + n,
s, j] = P[s, b, n*d + j]`` (a Reshape keeps the element order and ``[S, B, E] -> [S, B*N, d]`` splits the last
axis only); the bias rows ``b*N + n`` are ``[b, n]`` of its unfold the same way. A projection of the
transposed input, ``MatMul(Transpose(x), W) (+ b)``, is the same MatMul of ``x`` transposed after, so Q reads
``MatMul(x, W) (+ b)`` and the ``[S, B, E]`` copy goes. torch's packed in-projection (one ``[S, B, 3E]``
product, the default when q, k and v have one width) selects q, k and v with ``unflatten / unsqueeze /
transpose / squeeze / select``: each is read as a Slice of the last axis of the (lifted) product, once the
selection's index map, run on a probe of element ids, proves it one. Scalar scales on q, on k or on the product are one
``scale`` (float rounding only).

fairseq's ``MultiheadAttention`` (FSMT's port of it, and fairseq's own exports) folds k and v through a 4-D view,
``Reshape(Transpose(Reshape(P, [S, B, N, d]), [1,2,0,3]), [B*N, S, d])``: element ``[b*N + n, s, j]`` is ``P[s, b,
n*d + j]`` as in the 3-D fold, so it is read as one. It masks on a 4-D view of the scores, ``Reshape(Where(mask,
fill, Reshape(s3, [B, N, S, T])), [B*N, S, T])`` (the Softmax before or after the fold back: fuse_transformer moves
it onto the 4-D view first); such a Where is the additive bias ``Where(mask, fill, 0)`` on the unfolded scores
when the fill is -inf or at most -1e30 (``s + fill`` rounds to ``fill``: ``_where_mask``'s argument), and a 4-D
term is taken as it is. A site is rewritten only where the shapes prove each fold (``S`` kept, the
last dim an int ``d`` dividing ``E``) and every scale is a constant; a scale applied after a bias, a Softmax
read twice or a product read by anything but the out-projection's Transpose is left as it is.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from passes.fusion._batched_heads import same_dim
from passes.fusion._where_mask import is_masking_fill

_ONNX = ("", "ai.onnx")
_SCALES = ("Mul", "Div")


def _op(value: ir.Value | None, *ops: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.domain in _ONNX and node.op_type in ops else None


def _dims(value: ir.Value | None) -> list | None:
    return None if value is None or value.shape is None else list(value.shape)


def _tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """An initializer's or a Constant node's tensor."""
    return None if value is None else ir.convenience.get_const_tensor(value)


def _scalar(value: ir.Value | None) -> float | None:
    """The value of a one-element float constant, else None."""
    tensor = _tensor(value)
    if tensor is None:
        return None
    array = tensor.numpy()
    if array.size != 1 or not np.issubdtype(array.dtype, np.floating):
        return None
    return float(array.reshape(-1)[0])


def _perm(node: ir.Node) -> list[int]:
    return list(node.attributes.get_ints("perm", []))


@dataclasses.dataclass
class _Heads:
    """One of q, k, v: the ``[S, B, E]`` projection its heads were folded from, and the fold's sizes."""

    source: ir.Value
    head_size: int
    hidden: int


def _folded(value: ir.Value | None, perm: list[int]) -> _Heads | None:
    """The projection that ``value`` folds as ``Transpose(Reshape(P[S,B,E], [S, B*N, d]), perm)`` (its
    Transposes composed into one ``perm``), proven by the shapes, else None."""
    composed = [0, 1, 2]
    node = _op(value, "Transpose")
    while node is not None:
        if len(_perm(node)) != 3:  # another rank, or the default (reversed) order: not this fold
            return None
        composed = [_perm(node)[i] for i in composed]
        value = node.inputs[0]
        node = _op(value, "Transpose")
    reshape = _op(value, "Reshape")
    if reshape is None:
        return None
    viewed = _through_4d_view(reshape)
    if viewed is not None:  # [B*N, S, d] from the 4-D view: the 3-D fold transposed by (1, 0, 2)
        composed = [[1, 0, 2][i] for i in composed]
        if composed != perm:
            return None
        return viewed
    if composed != perm:
        return None
    source = reshape.inputs[0]
    dims, folded = _dims(source), _dims(value)
    if dims is None or folded is None or len(dims) != 3 or len(folded) != 3:
        return None
    hidden, head = dims[2], folded[2]
    if not (isinstance(hidden, int) and isinstance(head, int) and head > 0 and hidden % head == 0):
        return None
    if not same_dim(dims[0], folded[0]):  # the sequence axis kept: the Reshape splits [B, E] alone
        return None
    return _Heads(source, head, hidden)


def _through_4d_view(fold: ir.Node) -> _Heads | None:
    """fairseq's fold, ``Reshape(Transpose(Reshape(P[S,B,E], [S, B, N, d]), [1,2,0,3]), [B*N, S, d])``: the
    projection and the fold's sizes, proven by the shapes (S kept by both Reshapes, ``N*d == E``; B then follows
    from the element count), else None."""
    flip = _op(fold.inputs[0], "Transpose")
    if flip is None or _perm(flip) != [1, 2, 0, 3]:
        return None
    split = _op(flip.inputs[0], "Reshape")
    if split is None:
        return None
    source = split.inputs[0]
    dims, heads4, folded = _dims(source), _dims(split.outputs[0]), _dims(fold.outputs[0])
    if dims is None or heads4 is None or folded is None or (len(dims), len(heads4), len(folded)) != (3, 4, 3):
        return None
    hidden, heads, head = dims[2], heads4[2], heads4[3]
    if not all(isinstance(d, int) and d > 0 for d in (hidden, heads, head)) or heads * head != hidden:
        return None
    if not (same_dim(dims[0], heads4[0]) and same_dim(dims[0], folded[1]) and folded[2] == head):
        return None
    return _Heads(source, head, hidden)


def _through_scales(value: ir.Value | None) -> tuple[ir.Value | None, float] | None:
    """``value`` read back through ``Mul``/``Div`` by scalar constants (``value / c``, ``value * c``, ``c * value``):
    the value they scale and the product of their factors; None when one of them is not a constant."""
    factor = 1.0
    while (node := _op(value, *_SCALES)) is not None:
        index = 0 if node.op_type == "Div" or _scalar(node.inputs[1]) is not None else 1
        c = _scalar(node.inputs[1 - index])
        if c is None:
            return None
        factor = factor / c if node.op_type == "Div" else factor * c
        value = node.inputs[index]
    return value, factor


@dataclasses.dataclass
class _Site:
    product: ir.Node
    softmax: ir.Node
    context: ir.Node  # MatMul(probs, v)
    merge: ir.Node  # Transpose(1,0,2) of the context, what the out projection reads
    q: _Heads
    k: _Heads
    v: _Heads
    scale: float
    terms: list[ir.Value]
    # Terms on a 4-D view of the scores ([B|1, N|1, S|1, T]): a value added, or a masking Where (its bias is built)
    viewed_terms: list[ir.Value | ir.Node] = dataclasses.field(default_factory=list)
    view: ir.Value | None = None  # the scores unfolded to [B, N, S, T], where viewed_terms apply


def _unique_reader(value: ir.Value) -> ir.Node | None:
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    return uses[0].node


def _masking_where(where: ir.Node, value: ir.Value) -> bool:
    """``Where(mask, fill, value)`` or ``Where(mask, value, fill)`` with a fill of -inf or at most -1e30: the
    scores plus the bias ``Where(mask, fill, 0)`` (or ``Where(mask, 0, fill)``), exactly after the Softmax."""
    if len(where.inputs) != 3 or where.inputs[0] is None or value not in (where.inputs[1], where.inputs[2]):
        return False
    fill = _scalar(where.inputs[2] if where.inputs[1] is value else where.inputs[1])
    return fill is not None and is_masking_fill(fill)


def _view_of(scores: ir.Value, reshape: ir.Node, heads: int) -> bool:
    """Whether ``reshape`` unfolds the folded scores ``[B*N, S, T]`` to ``[B, N, S, T]``."""
    folded, view = _dims(scores), _dims(reshape.outputs[0])
    if folded is None or view is None or len(folded) != 3 or len(view) != 4 or view[1] != heads:
        return False
    return same_dim(view[2], folded[1]) and same_dim(view[3], folded[2])


def _folds_back(reshape: ir.Node | None, view: ir.Value) -> bool:
    """Whether ``reshape`` folds the 4-D view ``[B, N, S, T]`` back to ``[B*N, S, T]``."""
    if reshape is None or reshape.op_type != "Reshape" or reshape.domain not in _ONNX:
        return False
    dims, folded = _dims(view), _dims(reshape.outputs[0])
    if dims is None or folded is None or len(dims) != 4 or len(folded) != 3:
        return False
    return same_dim(dims[2], folded[1]) and same_dim(dims[3], folded[2])


def _match(product: ir.Node, opset: int) -> _Site | None:
    lhs, rhs = _through_scales(product.inputs[0]), _through_scales(product.inputs[1])
    if lhs is None or rhs is None:
        return None
    q, k = _folded(lhs[0], [1, 0, 2]), _folded(rhs[0], [1, 2, 0])
    if q is None or k is None or q.head_size != k.head_size or q.hidden != k.hidden:
        return None
    scale = lhs[1] * rhs[1]
    for heads in (q, k):  # a scalar scale on the projection before its fold (fairseq's q) is the product's too
        under = _through_scales(heads.source)
        if under is not None and under[0] is not None:
            heads.source, scale = under[0], scale * under[1]
    value, terms, viewed_terms, biased, view = product.outputs[0], [], [], False, None
    while (reader := _unique_reader(value)) is not None and reader.domain in _ONNX:
        if reader.op_type in _SCALES and not biased:
            index = next(i for i, v in enumerate(reader.inputs) if v is value)
            c = _scalar(reader.inputs[1 - index])
            if c is None or (reader.op_type == "Div" and index != 0):
                return None
            scale = scale / c if reader.op_type == "Div" else scale * c
        elif reader.op_type == "Add":
            other = reader.inputs[1] if reader.inputs[0] is value else reader.inputs[0]
            if other is None or other is value:
                return None
            (viewed_terms if view is not None else terms).append(other)
            biased = True
        elif reader.op_type == "Reshape" and view is None and not terms:
            if not _view_of(value, reader, q.hidden // q.head_size):
                break
            view = reader
        elif reader.op_type == "Where" and view is not None:
            if not _masking_where(reader, value):
                return None
            viewed_terms.append(reader)
            biased = True
        else:
            break
        value = reader.outputs[0]
    # fairseq masks on a 4-D view and folds back, before the Softmax or (moved by fuse_transformer) after it
    fold = _unique_reader(value) if view is not None else None
    if _folds_back(fold, value):
        value = fold.outputs[0]
    else:
        fold = None
    softmax = _unique_reader(value)
    if softmax is None or softmax.op_type != "Softmax" or softmax.domain not in _ONNX:
        return None
    rank = len(value.shape) if value.shape is not None else 3
    if softmax.attributes.get_int("axis", -1 if opset >= 13 else 1) not in (-1, rank - 1):  # 1 before opset 13
        return None
    probs = softmax.outputs[0]
    if view is not None and fold is None:
        fold = _unique_reader(probs)
        if not _folds_back(fold, probs):
            return None
        probs = fold.outputs[0]
    context = _unique_reader(probs)
    if context is None or context.op_type != "MatMul" or context.inputs[0] is not probs:
        return None
    v = _folded(context.inputs[1], [1, 0, 2])
    if v is None or v.head_size != q.head_size:
        return None
    merge = _unique_reader(context.outputs[0])
    if merge is None or merge.op_type != "Transpose" or merge.domain not in _ONNX or _perm(merge) != [1, 0, 2]:
        return None
    if merge.outputs[0].is_graph_output():  # kept simple: the model's output keeps the node that names it
        return None
    return _Site(product, softmax, context, merge, q, k, v, scale, terms, viewed_terms, view and view.outputs[0])


def _const(values: list[int], name: str) -> ir.Node:
    return ir.node("Constant", [], {"value": ir.tensor(np.array(values, np.int64))}, name=name)


def _lifted(source: ir.Value, prefix: str, nodes: list[ir.Node]) -> ir.Value | None:
    """``MatMul(x, W) (+ b)`` for a projection ``MatMul(Transpose(x, [1,0,2]), W) (+ b)`` with constant W and b
    (the same product, transposed after), else None."""
    add = _op(source, "Add")
    matmul, bias = (_op(source, "MatMul"), None) if add is None else (None, None)
    if add is not None:
        for i in (0, 1):
            if (mm := _op(add.inputs[i], "MatMul")) is not None and _tensor(add.inputs[1 - i]) is not None:
                matmul, bias = mm, add.inputs[1 - i]
        if bias is None or len(_tensor(bias).shape) > 1:
            return None
    if matmul is None or (flip := _op(matmul.inputs[0], "Transpose")) is None or _perm(flip) != [1, 0, 2]:
        return None
    weight = matmul.inputs[1]
    if weight is None or _tensor(weight) is None or len(_tensor(weight).shape) != 2:
        return None
    node = ir.node("MatMul", [flip.inputs[0], weight], name=f"{prefix}/matmul")
    nodes.append(node)
    if bias is not None:
        node = ir.node("Add", [node.outputs[0], bias], name=f"{prefix}/bias")
        nodes.append(node)
    return node.outputs[0]


# The ops of torch's packed in-projection between the [S, B, 3E] product and each of q, k, v:
# ``unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2)[i]``, or a Slice/Split of its last axis.
_PACKED_STEPS = ("Reshape", "Unsqueeze", "Transpose", "Squeeze", "Gather", "Slice")
_PROBE = (2, 3)  # stand-in sizes of the product's two leading axes


def _axes_input(node: ir.Node, index: int) -> list[int] | None:
    value = node.inputs[index] if len(node.inputs) > index else None
    tensor = _tensor(value)
    return None if tensor is None else [int(i) for i in tensor.numpy().reshape(-1)]


def _simulate(node: ir.Node, array: np.ndarray, sizes: dict) -> np.ndarray | None:
    """``node`` applied to ``array`` (element ids): the index map it makes, from its constant operands and its
    output's inferred shape (symbolic dims read through ``sizes``); None where one is not known."""
    op = node.op_type
    if op == "Reshape":
        dims = _dims(node.outputs[0])
        if dims is None:
            return None
        target = [d if isinstance(d, int) else sizes.get(d) for d in dims]
        return array.reshape(target) if None not in target and np.prod(target) == array.size else None
    if op == "Transpose":
        perm = _perm(node) or list(reversed(range(array.ndim)))
        return array.transpose(perm) if len(perm) == array.ndim else None
    if op in ("Unsqueeze", "Squeeze"):
        axes = _axes_input(node, 1)
        if axes is None:
            return None
        if op == "Squeeze":
            axes = [a % array.ndim for a in axes]
            return array.squeeze(tuple(axes)) if all(array.shape[a] == 1 for a in axes) else None
        out = array
        for axis in sorted(a % (array.ndim + len(axes)) for a in axes):
            out = np.expand_dims(out, axis)
        return out
    if op == "Gather":
        index = _axes_input(node, 1)
        shape = _tensor(node.inputs[1]).shape if index is not None else None
        return (
            None
            if index is None
            else np.take(array, np.array(index).reshape(tuple(shape)), node.attributes.get_int("axis", 0))
        )
    if op == "Slice":
        starts, ends = _axes_input(node, 1), _axes_input(node, 2)
        axes = _axes_input(node, 3) if len(node.inputs) > 3 else list(range(len(starts or [])))
        steps = _axes_input(node, 4) if len(node.inputs) > 4 else [1] * len(starts or [])
        if starts is None or ends is None or axes is None or steps is None:
            return None
        index = [slice(None)] * array.ndim
        for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
            index[axis % array.ndim] = slice(start, end, step)
        return array[tuple(index)]
    return None


def _packed_slice(source: ir.Value) -> tuple[ir.Value, int, int] | None:
    """``(L, start, end)`` when ``source`` is ``L[:, :, start:end]`` for a rank-3 ``L`` through the ops of a
    packed in-projection, proven by running their index map on a probe; else None."""
    chain: list[ir.Node] = []
    value = source
    while (node := _op(value, *_PACKED_STEPS)) is not None and len(chain) < 8:
        chain.insert(0, node)
        value = node.inputs[0]
        dims = _dims(value)
        if node.op_type == "Reshape" and dims is not None and len(dims) == 3:
            break
    else:
        return None
    dims, out = _dims(value), _dims(source)
    if not chain or dims is None or out is None or not isinstance(dims[2], int) or not isinstance(out[2], int):
        return None
    sizes: dict = {}
    probe_dims = []
    for d, stand_in in zip(dims[:2], _PROBE, strict=True):
        if isinstance(d, int):
            probe_dims.append(d)
        elif isinstance(d, ir.SymbolicDim) and d.value is not None:
            sizes[d] = stand_in
            probe_dims.append(stand_in)
        else:
            return None
    probe = np.arange(int(np.prod(probe_dims)) * dims[2]).reshape(*probe_dims, dims[2])
    array = probe
    for node in chain:
        try:
            array = _simulate(node, array, sizes)
        except (ValueError, IndexError):  # operands that do not fit the probe (an index out of its range): no proof
            return None
        if array is None:
            return None
    start = int(array.reshape(-1)[0]) if array.size else -1
    width = out[2]
    if array.shape != (*probe_dims, width) or not 0 <= start <= dims[2] - width:
        return None
    return (value, start, start + width) if np.array_equal(array, probe[:, :, start : start + width]) else None


def _batch_first(heads: _Heads, prefix: str, nodes: list[ir.Node], shared: dict) -> ir.Value:
    """``[B, S, E]`` for one of q, k, v. A projection of the transposed input is lifted above the transpose
    (``_lifted``; the ``[S, B, E]`` copy then has no reader left); a packed in-projection's slice of it is read
    off the lifted ``[B, S, 3E]`` product, which q, k and v share (``shared``); otherwise
    ``Transpose(P, [1,0,2])``, or the input itself when ``P`` is a transpose of ``[B, S, E]``."""
    source = heads.source
    flip = _op(source, "Transpose")
    if flip is not None and _perm(flip) == [1, 0, 2]:
        return flip.inputs[0]
    packed = _packed_slice(source)
    if packed is not None:
        product, start, end = packed
        if id(product) not in shared:
            base = _lifted(product, f"{prefix}/packed", nodes)
            if base is None:
                node = ir.node("Transpose", [product], {"perm": [1, 0, 2]}, name=f"{prefix}/packed_batch_first")
                nodes.append(node)
                base = node.outputs[0]
            shared[id(product)] = base
        bounds = [_const(v, f"{prefix}/slice_{i}") for i, v in enumerate(([start], [end], [-1]))]
        part = ir.node("Slice", [shared[id(product)], *(b.outputs[0] for b in bounds)], name=f"{prefix}/slice")
        nodes += [*bounds, part]
        return part.outputs[0]
    lifted = _lifted(source, prefix, nodes)
    if lifted is not None:
        return lifted
    node = ir.node("Transpose", [source], {"perm": [1, 0, 2]}, name=f"{prefix}/batch_first")
    nodes.append(node)
    return node.outputs[0]


def _bias_layout(site: _Site) -> str | None:
    """How the terms on the scores unfold: "per_head" (a term ``[B*N, s, t]``, rows ``b*N + n``, the others
    shared), "shared" (each of rank 2 or leading dim 1: one bias for every batch and head), else None."""
    scores = _dims(site.product.outputs[0])
    dims = [_dims(t) for t in site.terms]
    if scores is None or any(d is None or len(d) > 3 for d in dims):
        return None
    per_head = [len(d) == 3 and same_dim(d[0], scores[0]) for d in dims]
    if not all(p or len(d) < 3 or d[0] == 1 for p, d in zip(per_head, dims, strict=True)):
        return None
    return "per_head" if any(per_head) else "shared"  # the sum broadcasts a shared term over the rows


def _attention_bias(site: _Site, heads: int, qk: tuple[ir.Value, ir.Value], prefix: str, nodes: list[ir.Node]):
    """The terms' sum as ``[B|1, N|1, S, T]``: a ``[B*N, s, t]`` term unfolds its leading dim, a term that
    broadcasts over every head (rank 2, or leading dim 1) gains two leading 1s; expanded to the scores' last two
    dims unless they are proven already. None when a term's leading dim is neither (the site is skipped)."""
    if not site.terms:
        return None
    total = site.terms[0]
    for index, term in enumerate(site.terms[1:]):
        add = ir.node("Add", [total, term], name=f"{prefix}/bias_sum{index}")
        nodes.append(add)
        total = add.outputs[0]
    scores = _dims(site.product.outputs[0])
    dims = [_dims(t) for t in site.terms]
    lead = [-1, heads] if _bias_layout(site) == "per_head" else [1, 1]
    rank = max(len(d) for d in dims)
    shape = ir.node("Shape", [total], {"start": rank - 2}, name=f"{prefix}/bias_shape")
    lead_c = _const(lead, f"{prefix}/bias_lead")
    target = ir.node("Concat", [lead_c.outputs[0], shape.outputs[0]], {"axis": 0}, name=f"{prefix}/bias_target")
    unfold = ir.node("Reshape", [total, target.outputs[0]], name=f"{prefix}/bias_4d")
    nodes += [shape, lead_c, target, unfold]
    full = all(len(d) >= 2 and same_dim(d[-2], scores[1]) and same_dim(d[-1], scores[2]) for d in dims)
    return unfold.outputs[0] if full else _expanded(unfold.outputs[0], qk, prefix, nodes)


def _expanded(bias: ir.Value, qk: tuple[ir.Value, ir.Value], prefix: str, nodes: list[ir.Node]) -> ir.Value:
    """``bias [B|1, N|1, s, t]`` expanded to the query and key lengths, which MultiHeadAttention requires."""
    # the lengths from q and k, not from the scores' product: a reader of it would keep the 3-D attention alive
    q, k = qk
    rows = ir.node("Shape", [q], {"start": 1, "end": 2}, name=f"{prefix}/query_length")
    cols = ir.node("Shape", [k], {"start": 1, "end": 2}, name=f"{prefix}/key_length")
    ones = _const([1, 1], f"{prefix}/ones")
    to = ir.node("Concat", [ones.outputs[0], rows.outputs[0], cols.outputs[0]], {"axis": 0}, name=f"{prefix}/expand_to")
    expand = ir.node("Expand", [bias, to.outputs[0]], name=f"{prefix}/bias_expand")
    nodes += [rows, cols, ones, to, expand]
    return expand.outputs[0]


def _term_dims(term: ir.Value | ir.Node) -> list | None:
    """A term's dims on the 4-D view: a masking Where's are its mask's (the bias built from it broadcasts so)."""
    return _dims(term.inputs[0] if isinstance(term, ir.Node) else term)


def _viewed_layout(site: _Site, heads: int) -> bool | None:
    """Whether the terms on the 4-D view already span the query and key lengths (no Expand needed); None when a
    term cannot be an attention bias (a rank above 4, a head dim other than N or 1): the site is skipped."""
    view, proven = _dims(site.view), True
    for term in site.viewed_terms:
        dims = _term_dims(term)
        if view is None or dims is None or len(dims) > 4:
            return None
        dims = [1] * (4 - len(dims)) + dims
        if dims[1] not in (1, heads):
            return None
        proven = proven and same_dim(dims[2], view[2]) and same_dim(dims[3], view[3])
    return proven


def _viewed_bias(site: _Site, qk: tuple[ir.Value, ir.Value], proven: bool, prefix: str, nodes: list[ir.Node]):
    """The sum of the terms on the 4-D view of the scores as ``[B|1, N|1, S, T]``: a masking Where becomes its
    additive bias, a term of lower rank gains leading 1s; expanded to the lengths unless ``proven`` already."""
    total = None
    for index, term in enumerate(site.viewed_terms):
        rank = len(_term_dims(term))
        value = term
        if isinstance(term, ir.Node):  # Where(mask, fill, scores) -> Where(mask, fill, 0)
            fill_at = 1 if _scalar(term.inputs[1]) is not None else 2
            fill = _tensor(term.inputs[fill_at]).numpy()
            zero = ir.node("Constant", [], {"value": ir.tensor(np.zeros((), fill.dtype))}, name=f"{prefix}/zero{index}")
            branches = [term.inputs[fill_at], zero.outputs[0]][:: 1 if fill_at == 1 else -1]
            bias = ir.node("Where", [term.inputs[0], *branches], name=f"{prefix}/mask{index}")
            nodes += [zero, bias]
            value = bias.outputs[0]
        if rank < 4:
            axes = _const(list(range(4 - rank)), f"{prefix}/lead_axes{index}")
            lifted = ir.node("Unsqueeze", [value, axes.outputs[0]], name=f"{prefix}/lead{index}")
            nodes += [axes, lifted]
            value = lifted.outputs[0]
        if total is not None:
            add = ir.node("Add", [total, value], name=f"{prefix}/bias_sum{index}")
            nodes.append(add)
            value = add.outputs[0]
        total = value
    return total if proven else _expanded(total, qk, prefix, nodes)


def fuse_folded_heads(model: ir.Model) -> int:
    """Rewrite every proven sequence-first folded-heads attention to ``MultiHeadAttention``; the count."""
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 18))
    sites = [
        s for node in model.graph if node.op_type == "MatMul" and node.domain in _ONNX if (s := _match(node, opset))
    ]
    done = 0
    shared: dict = {}  # a packed projection's lifted product, once for its q, k and v
    for index, site in enumerate(sites):
        prefix = f"{site.product.name or 'attention'}/mha_3d_{index}"  # ORT refuses two nodes of one name
        heads = site.q.hidden // site.q.head_size
        if site.terms and not _bias_layout(site):
            continue
        proven = _viewed_layout(site, heads) if site.viewed_terms else None
        if site.viewed_terms and proven is None:
            continue
        nodes: list[ir.Node] = []
        q, k, v = (
            _batch_first(h, f"{prefix}/{n}", nodes, shared) for h, n in ((site.q, "q"), (site.k, "k"), (site.v, "v"))
        )
        if site.viewed_terms:
            bias = _viewed_bias(site, (q, k), proven, prefix, nodes)
        else:
            bias = _attention_bias(site, heads, (q, k), prefix, nodes)
        inputs = [q, k, v] + ([None, None, bias] if bias is not None else [])
        attrs = {"num_heads": heads, "scale": float(site.scale)}
        mha = ir.node("MultiHeadAttention", inputs, attrs, domain="com.microsoft", name=f"{prefix}/mha")
        flip = ir.node("Transpose", [mha.outputs[0]], {"perm": [1, 0, 2]}, name=f"{prefix}/seq_first")
        split = _const([0, -1, site.q.head_size], f"{prefix}/heads_shape")
        merged = ir.node("Reshape", [flip.outputs[0], split.outputs[0]], name=f"{prefix}/heads")
        nodes += [mha, flip, split, merged]
        out = site.merge.outputs[0]
        merged.outputs[0].shape, merged.outputs[0].dtype = out.shape, out.dtype
        model.graph.insert_before(site.merge, nodes)
        ir.convenience.replace_all_uses_with(out, merged.outputs[0])
        done += 1
    if done:
        common_passes.RemoveUnusedNodesPass()(model)
        model.graph.sort()  # a lifted projection reads x, which may sit after the folded site's first node
        if "com.microsoft" not in model.opset_imports:
            model.opset_imports["com.microsoft"] = 1
    return done
