"""Attention written with the heads folded into the batch (``torch.bmm`` on ``[B*h, S, d]``) made 4-D.

DeBERTa-v2 (and other models that call ``torch.bmm``) reshape q, k and v from ``[B, h, S, d]`` to
``[B*h, S, d]``, multiply, and unfold the scores to ``[B, h, S, S]`` for the mask; the probabilities are
folded again for the product with v. onnxscript's SDPA rule matches 4-D ``MatMul`` only, so none of these
attentions fused. Folding the leading two dims, multiplying the last two and unfolding is the same as the
4-D (batched) ``MatMul``, so the folds are dropped::

    q4[B,h,S,d] --Reshape[B*h,S,d]--> MatMul --Reshape[B,h,S,S]--> scores
    k4[B,h,S,d] --Reshape[B*h,S,d]--Transpose(0,2,1)--Div(c)--^
    ==>  q4 --> MatMul --> scores;   k4 --Transpose(0,1,3,2)--Div(c)--^

    p4[B,h,S,S] --Reshape[B*h,S,S]--> MatMul --Reshape[B,h,S,d]--> out
    v4[B,h,S,d] --Reshape[B*h,S,d]--------^
    ==>  p4, v4 --> MatMul --> out

DeBERTa's disentangled attention (c2p and p2c, DeBERTa-v3) adds its relative terms to the folded scores before
the unfold, so the product's reader is an ``Add``, not the unfold. The unfold is first distributed over such
sums (``distribute_unfolds``), which is exact: both terms have the folded shape, and a Reshape keeps the
element order, so reshaping the sum is the sum of the reshaped terms::

    Reshape(Add(MatMul(q3, kT3), rel3), [B,h,S,T])  ==>  Add(Reshape(MatMul(q3, kT3), ..), Reshape(rel3, ..))

after which the product's fold is dropped as above and the relative terms reach the Softmax as a
``[B, h, S, T]`` bias (``attention_bias`` of the fused attention).

BLOOM's ``baddbmm(alibi, q3, kT3, alpha=1/sqrt(d))`` adds a term that broadcasts over the queries (ALiBi,
``[B*h, 1, T]``) to the product scaled after the MatMul. Such a term is unfolded on its own to ``[B, h, 1, T]``
(``[-1, h]`` then its own last sizes: its leading dim is the sum's, so each element keeps its head), and a
scalar ``Mul``/``Div`` applied to the folded product is applied to the 4-D product instead.

A site is rewritten only where the shapes prove each fold merges exactly the two leading dims of its 4-D
source and the unfold restores them (dims compared as the same int or the same symbol; TorchScript's
run-time shapes are resolved first by ``_symbolic_shapes``). The scalar scaling between the fold and the
MatMul commutes with the transposition and is kept.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from passes._match import const_ints
from passes.fusion._rotary_eval import axes_of

_ONNX = ("", "ai.onnx")
_SCALAR_OPS = ("Div", "Mul")


def _dims(value: ir.Value | None) -> list | None:
    return None if value is None or value.shape is None else list(value.shape)


def same_dim(a: object, b: object) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return isinstance(a, ir.SymbolicDim) and isinstance(b, ir.SymbolicDim) and a.value is not None and a == b


def _unfolded(value: ir.Value | None) -> ir.Value | None:
    """The 4-D source of a ``Reshape`` that folds ``[B, h, X, Y]`` into ``[B*h, X, Y]``, else None."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Reshape" or node.domain not in _ONNX:
        return None
    source, folded = node.inputs[0], _dims(value)
    dims = _dims(source)
    if dims is None or folded is None or len(dims) != 4 or len(folded) != 3:
        return None
    return source if same_dim(dims[2], folded[1]) and same_dim(dims[3], folded[2]) else None


def _scalar(value: ir.Value | None) -> bool:
    return value is not None and value.shape is not None and all(d == 1 for d in value.shape)


def _under_scalars(value: ir.Value | None) -> tuple[ir.Value | None, list[ir.Node]]:
    """``value`` under the scalar ``Mul``/``Div`` ops applied to it, and those ops in the order they apply."""
    scalars: list[ir.Node] = []
    node = value.producer() if value is not None else None
    while node is not None and node.op_type in _SCALAR_OPS and node.domain in _ONNX and _scalar(node.inputs[1]):
        scalars.insert(0, node)
        value = node.inputs[0]
        node = value.producer() if value is not None else None
    return value, scalars


def _rhs(value: ir.Value | None) -> tuple[ir.Value, bool, list[ir.Node]] | None:
    """The 4-D source of the MatMul's rhs, whether it was transposed (k^T), and the scalar ops after."""
    value, scalars = _under_scalars(value)
    node = value.producer() if value is not None else None
    if node is not None and node.op_type == "Transpose" and node.domain in _ONNX:
        if list(node.attributes.get_ints("perm", [])) != [0, 2, 1]:
            return None
        source = _unfolded(node.inputs[0])
        return (source, True, scalars) if source is not None else None
    source = _unfolded(value)
    return (source, False, scalars) if source is not None else None


def _lhs(value: ir.Value | None) -> tuple[ir.Value, list[ir.Node]] | None:
    """The 4-D source of the MatMul's lhs and the scalar ops applied to it after its fold (ViTDet and SAM scale q
    before the product: ``(q * scale) @ k^T``)."""
    value, scalars = _under_scalars(value)
    source = _unfolded(value)
    return (source, scalars) if source is not None else None


def _reshape_readers(graph: ir.Graph, folded: ir.Value, product: ir.Node, before: ir.Node) -> None:
    """``Shape`` readers of the folded product read ``[B*h, X, Y]`` computed from the 4-D product's shape,
    so the 3-D MatMul is left without readers (it would otherwise run beside the 4-D one)."""
    readers = [u.node for u in folded.uses() if u.node.op_type == "Shape"]
    if not readers:
        return
    prefix = product.name

    def const(name: str, values: list[int]) -> ir.Value:
        node = ir.node("Constant", [], {"value": ir.tensor(np.array(values, np.int64))}, name=f"{prefix}/{name}")
        nodes.append(node)
        return node.outputs[0]

    nodes: list[ir.Node] = []
    shape = ir.node("Shape", [product.outputs[0]], name=f"{prefix}/shape")
    nodes.append(shape)
    starts, mids, ends = const("s0", [0]), const("s1", [1]), const("s2", [2])
    lead_b = ir.node("Slice", [shape.outputs[0], starts, mids], name=f"{prefix}/batch")
    lead_h = ir.node("Slice", [shape.outputs[0], mids, ends], name=f"{prefix}/heads")
    rows = ir.node("Mul", [lead_b.outputs[0], lead_h.outputs[0]], name=f"{prefix}/rows")
    rest = ir.node("Slice", [shape.outputs[0], ends, const("s4", [4])], name=f"{prefix}/rest")
    folded_shape = ir.node("Concat", [rows.outputs[0], rest.outputs[0]], {"axis": 0}, name=f"{prefix}/folded_shape")
    nodes += [lead_b, lead_h, rows, rest, folded_shape]
    graph.insert_before(before, nodes)
    for reader in readers:
        start = reader.attributes.get_int("start", 0)
        end = reader.attributes.get_int("end", 3)
        value = folded_shape.outputs[0]
        if (start, end) != (0, 3) and (start, end) != (0, 4):
            begin = ir.node("Constant", [], {"value": ir.tensor(np.array([start], np.int64))})
            stop = ir.node("Constant", [], {"value": ir.tensor(np.array([end], np.int64))})
            part = ir.node("Slice", [value, begin.outputs[0], stop.outputs[0]], name=f"{reader.name}/folded")
            graph.insert_before(reader, [begin, stop, part])
            value = part.outputs[0]
        ir.convenience.replace_all_uses_with(reader.outputs[0], value, replace_graph_outputs=False)


def _same_shape(a: ir.Value | None, b: ir.Value | None) -> bool:
    da, db = _dims(a), _dims(b)
    return da is not None and db is not None and len(da) == len(db) and all(map(same_dim, da, db))


def _broadcasts_within_heads(term: ir.Value | None, total: ir.Value | None) -> bool:
    """A 3-D term whose leading ``B*h`` dim is the sum's and whose other dims are the sum's or 1 (BLOOM's ALiBi,
    ``[B*h, 1, T]``, broadcast over the queries): unfolding its leading dim alone keeps every element's head."""
    dims, full = _dims(term), _dims(total)
    if dims is None or full is None or len(dims) != 3 or len(full) != 3 or not same_dim(dims[0], full[0]):
        return False
    return all(d == 1 or same_dim(d, f) for d, f in zip(dims[1:], full[1:], strict=True))


def _unfold_like(term: ir.Value, unfolded: ir.Value, prefix: str) -> tuple[list[ir.Node], ir.Value]:
    """``term [B*h, X, Y]`` reshaped to ``[B, h, X, Y]`` with h the unfold's constant heads dim: ``[-1, h]``
    then the term's own last two sizes. Nothing here reads the full term, which the SDPA rule must see
    read by the sum alone."""
    heads = list(unfolded.shape)[1]
    lead = ir.node("Constant", [], {"value": ir.tensor(np.array([-1, heads], np.int64))}, name=f"{prefix}/lead")
    begin = ir.node("Constant", [], {"value": ir.tensor(np.array([1], np.int64))}, name=f"{prefix}/b1")
    end = ir.node("Constant", [], {"value": ir.tensor(np.array([3], np.int64))}, name=f"{prefix}/b3")
    own = ir.node("Shape", [term], name=f"{prefix}/term_shape")
    rest = ir.node("Slice", [own.outputs[0], begin.outputs[0], end.outputs[0]], name=f"{prefix}/rest")
    shape = ir.node("Concat", [lead.outputs[0], rest.outputs[0]], {"axis": 0}, name=f"{prefix}/term_target")
    reshaped = ir.node("Reshape", [term, shape.outputs[0]], name=f"{prefix}/term1")
    reshaped.outputs[0].shape = ir.Shape(list(unfolded.shape)[:2] + list(term.shape)[1:])
    reshaped.outputs[0].dtype = term.dtype
    return [lead, begin, end, own, rest, shape, reshaped], reshaped.outputs[0]


def distribute_unfolds(model: ir.Model) -> int:
    """Rewrite ``Reshape(Add(x, y))`` that unfolds ``[B*h, S, T]`` to ``[B, h, S, T]`` into ``Add(Reshape(x),
    Reshape(y))`` where x, y and the sum have one shape (no broadcast) and the sum has no other reader than
    the unfold and ``Shape`` ops (which then read a term: the same shape); repeated, so nested sums distribute too.
    The number of Reshapes distributed."""
    done = 0
    changed = True
    while changed:
        changed = False
        for unfold in list(model.graph):
            if unfold.op_type != "Reshape" or unfold.domain not in _ONNX:
                continue
            total, target = unfold.inputs[0], _dims(unfold.outputs[0])
            add = total.producer() if total is not None else None
            if add is None or add.op_type != "Add" or add.domain not in _ONNX or total.is_graph_output():
                continue
            folded = _dims(total)
            if target is None or folded is None or len(target) != 4 or len(folded) != 3:
                continue
            if not (same_dim(target[2], folded[1]) and same_dim(target[3], folded[2])):
                continue
            x, y = add.inputs
            if not _same_shape(x, total):
                x, y = y, x
            if not _same_shape(x, total):
                continue
            broadcast = not _same_shape(y, total)
            if broadcast and not (_broadcasts_within_heads(y, total) and isinstance(target[1], int)):
                continue
            readers = [u.node for u in total.uses()]
            if any(r is not unfold and r.op_type != "Shape" for r in readers):
                continue
            if broadcast and len(readers) > 1:
                continue  # a Shape reader would need a full-shape term to read; none is left but the product
            prefix = unfold.name or f"unfold_{done}"  # ORT refuses two nodes of one name
            nodes = []
            parts = []
            # the same shape operand and attributes (allowzero included): the full term reshapes as the sum did
            part = ir.node("Reshape", [x, unfold.inputs[1]], dict(unfold.attributes), name=f"{prefix}/term0")
            part.outputs[0].shape, part.outputs[0].dtype = unfold.outputs[0].shape, unfold.outputs[0].dtype
            nodes.append(part)
            parts.append(part.outputs[0])
            if broadcast:
                nodes_y, term = _unfold_like(y, part.outputs[0], prefix)
                nodes += nodes_y
                parts.append(term)
            else:
                part = ir.node("Reshape", [y, unfold.inputs[1]], dict(unfold.attributes), name=f"{prefix}/term1")
                part.outputs[0].shape, part.outputs[0].dtype = unfold.outputs[0].shape, unfold.outputs[0].dtype
                nodes.append(part)
                parts.append(part.outputs[0])
            summed = ir.node("Add", parts, name=f"{prefix}/sum")
            summed.outputs[0].shape, summed.outputs[0].dtype = unfold.outputs[0].shape, unfold.outputs[0].dtype
            nodes.append(summed)
            model.graph.insert_before(unfold, nodes)
            # Shape readers read a term instead (the same shape): the one that is not a MatMul product, which
            # unfold_batched_heads replaces; reading it would keep a second (3-D or 4-D) product alive
            kept = y if _product_of(x) is not None else x
            for reader in readers:
                if reader is not unfold:
                    reader.replace_input_with(0, kept)
            ir.convenience.replace_all_uses_with(unfold.outputs[0], summed.outputs[0])
            model.graph.remove(unfold, safe=True)
            done += 1
            changed = True
    if done:
        common_passes.RemoveUnusedNodesPass()(model)
    return done


def _scaled_by(matmul: ir.Node) -> list[tuple[ir.Node, ir.Value]]:
    """The chain of scalar ``Mul``/``Div`` that alone reads the MatMul's product (besides ``Shape`` ops), in
    order, each with its scalar operand; [] when none."""
    chain: list[tuple[ir.Node, ir.Value]] = []
    value = matmul.outputs[0]
    while True:
        uses = [u for u in value.uses() if u.node.op_type != "Shape"]
        if len(uses) != 1 or value.is_graph_output():
            return chain
        node, idx = uses[0].node, uses[0].idx
        if node.op_type not in _SCALAR_OPS or node.domain not in _ONNX or (node.op_type == "Div" and idx != 0):
            return chain
        scalar = node.inputs[1 - idx]
        if not _scalar(scalar):
            return chain
        chain.append((node, scalar))
        value = node.outputs[0]


def _product_of(value: ir.Value | None) -> ir.Node | None:
    """The MatMul whose product ``value`` is, through scalar ``Mul``/``Div``; None otherwise."""
    value, _ = _under_scalars(value)
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == "MatMul" and node.domain in _ONNX else None


def _folded_product_heads(value: ir.Value) -> ir.Value | None:
    """Where ``value`` is a (scaled) product of two proven folds (q3 @ k3^T on ``[B*h, S, d]``), q's 4-D source
    when its heads dim is a number (what an unfold of the product needs), else None."""
    matmul = _product_of(value)
    if matmul is None:
        return None
    found = _lhs(matmul.inputs[0])
    if found is None or _rhs(matmul.inputs[1]) is None or not isinstance(list(found[0].shape)[1], int):
        return None
    return found[0]


def _squeezes_axis0(node: ir.Node) -> bool:
    return node.op_type == "Squeeze" and node.domain in _ONNX and axes_of(node) == [0]


def _cuts_axis0(node: ir.Node, value: ir.Value) -> bool:
    """A ``Split`` or ``Slice`` of ``value`` on axis 0 alone (``unbind``'s cut, before its Squeeze)."""
    if node.domain not in _ONNX or not node.inputs or node.inputs[0] is not value:
        return False
    if node.op_type == "Split":
        return node.attributes.get_int("axis", 0) == 0
    return node.op_type == "Slice" and len(node.inputs) >= 4 and const_ints(node.inputs[3]) == [0]


def fold_after_cut(model: ir.Model) -> int:
    """q, k and v cut from a folded qkv, ``unbind(Reshape(qkv5 [n, B, h, S, d], [n, B*h, S, d]))`` (ViTDet's and
    SAM's attention), rewritten as each cut then folded, ``Reshape(Squeeze(cut(qkv5)), [-1, S, d])``: the same
    values (the fold merges the two dims after the cut axis, which the cut keeps), and each of q, k and v then the
    fold of a ``[B, h, S, d]`` value, which ``unfold_batched_heads`` reads. The number of folds moved."""
    moved = 0
    for fold in list(model.graph):
        if fold.op_type != "Reshape" or fold.domain not in _ONNX or fold.inputs[0] is None:
            continue
        source, out = fold.inputs[0], fold.outputs[0]
        dims, folded = _dims(source), _dims(out)
        if dims is None or folded is None or len(dims) != 5 or len(folded) != 4 or out.is_graph_output():
            continue
        if not all(same_dim(dims[a], folded[b]) for a, b in ((0, 0), (3, 2), (4, 3))):
            continue
        cuts = [u.node for u in out.uses()]
        if not cuts or not all(_cuts_axis0(c, out) for c in cuts):
            continue
        squeezes = [u.node for c in cuts for o in c.outputs for u in o.uses()]
        if not squeezes or not all(_squeezes_axis0(q) for q in squeezes):
            continue
        if any(o.is_graph_output() for c in cuts for o in c.outputs):
            continue
        prefix = fold.name or f"fold_{moved}"
        lead = ir.node("Constant", [], {"value": ir.tensor(np.array([-1], np.int64))}, name=f"{prefix}/lead")
        rest = ir.node("Shape", [source], {"start": 3}, name=f"{prefix}/rest")
        target = ir.node("Concat", [lead.outputs[0], rest.outputs[0]], {"axis": 0}, name=f"{prefix}/target")
        nodes = [lead, rest, target]
        for index, cut in enumerate(cuts):
            again = ir.node(
                cut.op_type, [source, *cut.inputs[1:]], dict(cut.attributes), num_outputs=len(cut.outputs),
                name=f"{prefix}/cut_{index}",
            )  # fmt: skip
            nodes.append(again)
            for old, new in zip(cut.outputs, again.outputs, strict=True):
                old_dims = _dims(old)
                new.shape = ir.Shape([old_dims[0] if old_dims else 1, *dims[1:]])
                new.dtype = source.dtype
                for use in list(old.uses()):
                    squeeze = use.node
                    flat = ir.node("Squeeze", [new, *squeeze.inputs[1:]], dict(squeeze.attributes),
                                   name=f"{squeeze.name}/4d")  # fmt: skip
                    flat.outputs[0].shape, flat.outputs[0].dtype = ir.Shape(dims[1:]), source.dtype
                    refold = ir.node("Reshape", [flat.outputs[0], target.outputs[0]], name=f"{squeeze.name}/fold")
                    refold.outputs[0].shape = ir.Shape([folded[1], dims[3], dims[4]])
                    refold.outputs[0].dtype = source.dtype
                    nodes += [flat, refold]
                    ir.convenience.replace_all_uses_with(squeeze.outputs[0], refold.outputs[0])
        model.graph.insert_before(fold, nodes)
        moved += 1
    if moved:
        common_passes.RemoveUnusedNodesPass()(model)
        model.graph.sort()
    return moved


def _biased_product_heads(value: ir.Value) -> ir.Value | None:
    """``_folded_product_heads`` of one term of ``Add(product, bias)`` whose sum has the product's folded shape
    (ViTDet's and SAM's decomposed relative positions, ``_softmax_forms.decomposed_rel_pos``), else None."""
    add = value.producer()
    if add is None or add.op_type != "Add" or add.domain not in _ONNX or len(add.inputs) != 2:
        return None
    for term in add.inputs:
        heads = _folded_product_heads(term) if term is not None else None
        if heads is not None and _same_shape(term, value):
            return heads
    return None


def softmax_before_fold(model: ir.Model) -> int:
    """A Softmax over the last axis of folded heads ``[B*h, S, T]`` moved to the 4-D scores (exact: each row
    of T values is normalized alike either way), so that ``unfold_batched_heads`` can drop the folds:

    * ``Softmax(Reshape(x4))``, the Reshape folding ``[B, h, S, T]``: ``Reshape(Softmax(x4))``. XGLM, and the
      BART family and Marian as transformers 4.x exported them, add the mask on the 4-D view of ``bmm``'s
      scores and fold it back before the Softmax;
    * ``Softmax(q3 @ k3^T)`` with no 4-D view (no mask: an encoder such as Whisper's, as transformers 4.x
      exported it), or of such a product plus a bias of its shape (ViTDet's relative positions): the scores are
      unfolded to ``[B, h, S, T]`` first (``[-1, h]`` and their own last sizes).

    The fold after the Softmax then feeds the product with v. The number moved."""
    moved = 0
    for softmax in list(model.graph):
        if softmax.op_type != "Softmax" or softmax.domain not in _ONNX or softmax.inputs[0] is None:
            continue
        folded = softmax.inputs[0]
        if softmax.attributes.get_int("axis", -1) not in (-1, 2) or folded.is_graph_output():
            continue
        if softmax.outputs[0].is_graph_output():  # the probabilities as a model output keep their folded shape
            continue
        if len([u for u in folded.uses() if u.node.op_type != "Shape"]) != 1 or _dims(folded) is None:
            continue
        prefix = softmax.name or f"softmax_{moved}"  # ORT refuses two nodes of one name
        before: list[ir.Node] = []
        source = _unfolded(folded)
        fold = folded.producer() if source is not None else None
        if source is None:
            heads = _folded_product_heads(folded) or _biased_product_heads(folded)
            if heads is None or len(folded.shape) != 3:
                continue
            before, source = _unfold_like(folded, heads, f"{prefix}/unfold")
            shape = ir.node("Shape", [folded], name=f"{prefix}/folded_shape")
            before.append(shape)
            back, attributes = shape.outputs[0], {}
        else:
            back, attributes = fold.inputs[1], dict(fold.attributes)
        normalized = ir.node("Softmax", [source], {"axis": -1}, name=f"{prefix}/4d")
        normalized.outputs[0].shape, normalized.outputs[0].dtype = source.shape, source.dtype
        refold = ir.node("Reshape", [normalized.outputs[0], back], attributes, name=f"{prefix}/fold")
        refold.outputs[0].shape, refold.outputs[0].dtype = softmax.outputs[0].shape, softmax.outputs[0].dtype
        model.graph.insert_before(softmax, [*before, normalized, refold])
        ir.convenience.replace_all_uses_with(softmax.outputs[0], refold.outputs[0])
        model.graph.remove(softmax, safe=True)
        # XGLM views the probabilities as [B, h, S, T] again (for its head mask): that unfold of the new fold
        # is the 4-D Softmax itself
        for use in list(refold.outputs[0].uses()):
            unfold = use.node
            if unfold.op_type == "Reshape" and unfold.domain in _ONNX and _same_shape(unfold.outputs[0], source):
                ir.convenience.replace_all_uses_with(unfold.outputs[0], normalized.outputs[0])
        moved += 1
    if moved:
        common_passes.RemoveUnusedNodesPass()(model)
    return moved


def transpose_through_folds(model: ir.Model) -> int:
    """``Reshape(Transpose(Reshape(k4, [B*h, S, d]), [0, 2, 1]), [B, h, d, S])`` rewritten as ``Transpose(k4, [0, 1,
    3, 2])``: torch's math decomposition of ``scaled_dot_product_attention`` writes ``k.transpose(-2, -1)`` so in
    some dynamo exports (BridgeTower's image tower, one head of 64), and the SDPA rule reads a 4-D transpose of k
    only. Exact: the fold merges the two leading dims (S and d kept, proven by the shapes), the 3-D Transpose swaps
    the last two, and the unfold splits the leading dim back with h and the swapped sizes kept, so element ``[b, n,
    j, s]`` is ``k4[b, n, s, j]`` either way. The number rewritten."""
    done = 0
    for unfold in list(model.graph):
        if unfold.op_type != "Reshape" or unfold.domain not in _ONNX or unfold.outputs[0].is_graph_output():
            continue
        flip = unfold.inputs[0].producer() if unfold.inputs[0] is not None else None
        if flip is None or flip.op_type != "Transpose" or flip.domain not in _ONNX:
            continue
        if list(flip.attributes.get_ints("perm", [])) != [0, 2, 1] or len(list(flip.outputs[0].uses())) != 1:
            continue
        source = _unfolded(flip.inputs[0])
        dims, target = _dims(source), _dims(unfold.outputs[0])
        if source is None or dims is None or target is None or len(target) != 4:
            continue
        if not (same_dim(target[1], dims[1]) and same_dim(target[2], dims[3]) and same_dim(target[3], dims[2])):
            continue
        node = ir.node("Transpose", [source], {"perm": [0, 1, 3, 2]}, name=f"{unfold.name or 'unfold'}/transpose_4d")
        node.outputs[0].shape, node.outputs[0].dtype = unfold.outputs[0].shape, unfold.outputs[0].dtype
        model.graph.insert_before(unfold, node)
        ir.convenience.replace_all_uses_with(unfold.outputs[0], node.outputs[0])
        done += 1
    if done:
        common_passes.RemoveUnusedNodesPass()(model)
    return done


def unfold_batched_heads(model: ir.Model) -> int:
    """Rewrite every proven ``[B*h, S, d]`` attention product to its 4-D form; the number rewritten (the
    unfolds distributed over relative-position sums first, ``distribute_unfolds``)."""
    distribute_unfolds(model)
    sites = []
    for matmul in model.graph:
        if matmul.op_type != "MatMul" or matmul.domain not in _ONNX:
            continue
        after = _scaled_by(matmul)
        out = after[-1][0].outputs[0] if after else matmul.outputs[0]
        uses = [u for u in out.uses() if u.node.op_type != "Shape"]  # TorchScript reads the unfold's sizes
        if len(uses) != 1 or out.is_graph_output():
            continue
        unfold = uses[0].node
        if unfold.outputs[0].is_graph_output():
            continue
        found = _lhs(matmul.inputs[0])
        rhs = _rhs(matmul.inputs[1])
        if unfold.op_type != "Reshape" or unfold.domain not in _ONNX or found is None or rhs is None:
            continue
        target, source, folded = _dims(unfold.outputs[0]), _dims(found[0]), _dims(out)
        other = _dims(rhs[0])
        if target is None or folded is None or len(target) not in (4, 5) or len(folded) != 3 or other is None:
            continue
        # The unfold's batch needs no proof of its own: with its other three dims proven, the element count
        # fixes it (an unfold to [-1, h, S, d] leaves symbolic inference a quotient it cannot simplify: SEW-D).
        lead_ok = same_dim(target[1], source[1]) and all(same_dim(other[i], source[i]) for i in (0, 1))
        if len(target) == 5:  # ViTDet and SAM view probs @ v as [B, h, H, W, d]: the 4-D product viewed so
            if lead_ok and not rhs[1] and same_dim(target[4], folded[2]):
                sites.append((matmul, after, unfold, found, rhs))
        elif lead_ok and same_dim(target[2], folded[1]) and same_dim(target[3], folded[2]):
            sites.append((matmul, after, unfold, found, rhs))
    for index, (matmul, after, unfold, (q4, lhs_scalars), (source, transposed, scalars)) in enumerate(sites):
        prefix = matmul.name or f"bmm_{index}"  # ORT refuses two nodes of one name
        nodes: list[ir.Node] = []
        lhs = q4
        for op in lhs_scalars:  # a scale on q applies to the 4-D q alike
            copy = ir.node(op.op_type, [lhs, op.inputs[1]], name=f"{prefix}/{op.op_type.lower()}_4d_q")
            copy.outputs[0].shape, copy.outputs[0].dtype = q4.shape, q4.dtype
            nodes.append(copy)
            lhs = copy.outputs[0]
        value = source
        if transposed:
            flip = ir.node("Transpose", [value], {"perm": [0, 1, 3, 2]}, name=f"{prefix}/transpose_4d")
            nodes.append(flip)
            value = flip.outputs[0]
        for op in scalars:
            copy = ir.node(op.op_type, [value, op.inputs[1]], name=f"{prefix}/{op.op_type.lower()}_4d")
            nodes.append(copy)
            value = copy.outputs[0]
        product = ir.node("MatMul", [lhs, value], name=f"{prefix}/4d")
        nodes.append(product)
        dims = _dims(unfold.outputs[0]) or []
        shape = unfold.outputs[0].shape
        if len(dims) == 5:
            shape = ir.Shape([*list(lhs.shape)[:2], *list(matmul.outputs[0].shape)[1:]])
        product.outputs[0].shape, product.outputs[0].dtype = shape, unfold.outputs[0].dtype
        # a scale applied to the folded product (baddbmm's alpha) is a scalar: it applies to the 4-D one alike
        last = product
        for op, scalar in after:
            last = ir.node(op.op_type, [last.outputs[0], scalar], name=f"{prefix}/{op.op_type.lower()}_4d_out")
            last.outputs[0].shape, last.outputs[0].dtype = shape, unfold.outputs[0].dtype
            nodes.append(last)
        if len(dims) == 5:  # the export's own view, of the 4-D product now (a Reshape reads only element order)
            last = ir.node(
                "Reshape", [last.outputs[0], unfold.inputs[1]], dict(unfold.attributes), name=f"{prefix}/view"
            )
            last.outputs[0].shape, last.outputs[0].dtype = unfold.outputs[0].shape, unfold.outputs[0].dtype
            nodes.append(last)
        model.graph.insert_before(unfold, nodes)
        for folded in [matmul.outputs[0]] + [op.outputs[0] for op, _ in after]:
            _reshape_readers(model.graph, folded, product if len(dims) == 5 else last, unfold)
        ir.convenience.replace_all_uses_with(unfold.outputs[0], last.outputs[0])
    if sites:
        common_passes.RemoveUnusedNodesPass()(model)
        # a Shape reader of a product whose unfold was distributed sits before the new 4-D product it now reads
        model.graph.sort()
    return len(sites)


def fold_static_sizes(model: ir.Model) -> int:
    """Replace ``Slice``/``Gather`` of a ``Shape`` that select only known dims by constants.

    TorchScript computes the attention scale from q's run-time size (``sqrt(q.size(-1))``: ``Shape ->
    Slice -> Squeeze -> Cast -> Sqrt``); with the head size known after shape inference, this makes the scale
    the constant onnxscript's SDPA rule requires ("key_scale is not a scalar"). onnxscript's optimizer then
    folds the rest of the chain."""
    folded = 0
    for shape_node in list(model.graph):
        if shape_node.op_type != "Shape" or shape_node.domain not in _ONNX or shape_node.inputs[0] is None:
            continue
        dims = _dims(shape_node.inputs[0])
        if dims is None:
            continue
        rank = len(dims)
        start = shape_node.attributes.get_int("start", 0)
        end = shape_node.attributes.get_int("end", rank)
        dims = dims[slice(start, end)]
        for use in list(shape_node.outputs[0].uses()):
            reader = use.node
            picked: list | None = None
            if reader.op_type == "Gather" and reader.attributes.get_int("axis", 0) == 0:
                index = const_ints(reader.inputs[1])
                known = reader.inputs[1] is not None and reader.inputs[1].shape is not None
                if index is not None and known:
                    picked = [dims[i] for i in index]
                    shape = list(reader.inputs[1].shape)
            elif reader.op_type == "Slice" and len(reader.inputs) in (3, 4):
                starts, ends = const_ints(reader.inputs[1]), const_ints(reader.inputs[2])
                axes = const_ints(reader.inputs[3]) if len(reader.inputs) == 4 else [0]
                if starts and ends and len(starts) == 1 and axes in ([0], [-1]):
                    picked = dims[slice(starts[0], max(min(ends[0], len(dims)), -len(dims) - 1))]
                    shape = [len(picked)]
            if picked is None or not all(isinstance(d, int) for d in picked):
                continue
            tensor = ir.tensor(np.array(picked, np.int64).reshape(shape))
            constant = ir.node("Constant", [], {"value": tensor}, name=f"{reader.name}/static")
            model.graph.insert_before(reader, constant)
            ir.convenience.replace_all_uses_with(reader.outputs[0], constant.outputs[0])
            folded += 1
    if folded:
        common_passes.RemoveUnusedNodesPass()(model)
    return folded
