"""Sizes as products of symbols where ONNX shape inference gives up: ``common_subexpression_elimination``'s proof
that two ``Shape`` nodes return the same tensor, across transformer layers.

ONNX inference has no arithmetic on symbols. TorchScript exports fold heads into the batch with
``view(-1, S, d)``, so the batch of the folded query is ``batch*4`` but inference calls it ``unk__4`` in layer 0
and ``unk__41`` in layer 1; torch's ``expand`` exports ``Where(Equal(shape, -1), 1, shape)``, which its data
propagation does not follow; after a few such ops the residual ``Add`` of layer 0 is ``[unk, unk, 32] +
[batch, sequence, 32]`` and layer 1 no longer knows its own batch::

    layer 0: q [batch, sequence, 32] -> Reshape(-1, sequence, 8) -> [4*batch, sequence, 8]   (ONNX: unk__4)
    layer 1: q [batch, sequence, 32] -> Reshape(-1, sequence, 8) -> [4*batch, sequence, 8]   (ONNX: unk__41)

Here a size is a monomial, ``coef * prod(atom ** exp)`` with an integer ``coef``; atoms are the names of the
fresh inference ``_provable_dims`` ran (graph-input names and the ``unk__N`` it invented). ``refine`` walks the
main graph in order and computes sizes, and the values of small integer tensors (shape arithmetic), with rules
that hold for every input the model accepts:

* products and exact quotients only (a quotient is kept only where the symbols and the coefficient divide, so
  ONNX's truncating integer ``Div`` equals it for every value of the atoms); a sum of symbols is unknown;
* broadcasting keeps a size only against 1 or against the same monomial (or an integer against a symbol, which
  must then be 1 or equal to it); two different symbols give an unknown (either may be 1 at run time);
* ``Reshape``'s -1 is the input's element count divided by the other sizes, exactly as the op requires;
* ``Equal`` of a size (a non-negative number) with a negative constant is false; anything else undecided is
  unknown.

Where a rule gives a size and inference gave one of its invented atoms, the atom stands for that size from
then on (both describe the same run-time number), which carries the knowledge to every value inference copied
the atom to. Where no rule applies, inference's size stands. An unknown size (None) is never equal to anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

Mono = tuple[int, tuple[tuple[str, int], ...]]  # coef, ((atom, exp), ...) sorted by atom
Size = Mono | None
Sizes = tuple[Size, ...]

_ONE: Mono = (1, ())
_MAX_VALUES = 64  # integer tensors tracked element by element: shape arithmetic, not data
_UNARY = frozenset(
    {
        "Abs", "Cast", "Ceil", "Clip", "Cos", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "Identity",
        "IsInf", "IsNaN", "LeakyRelu", "Log", "LogSoftmax", "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu",
        "Sigmoid", "Sign", "Sin", "Softmax", "Softplus", "Sqrt", "Tanh",
    }
)  # fmt: skip
_BROADCAST = frozenset(
    {
        "Add", "And", "BitShift", "Div", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Max",
        "Mean", "Min", "Mod", "Mul", "Or", "Pow", "PRelu", "Sub", "Sum", "Where", "Xor",
    }
)  # fmt: skip
_INT_TYPES = frozenset({ir.DataType.INT64, ir.DataType.INT32})
# Inputs the rules read, by op: fewer is an older opset's form (attributes instead of inputs, or Tile-1's
# ``tiles``/``axis``, another meaning), which the rules leave to inference.
_MIN_INPUTS = {"Expand": 2, "Gather": 2, "GatherElements": 2, "MatMul": 2, "Range": 3, "Reshape": 2, "Slice": 3}


def mono(d: int | str) -> Mono:
    return (d, ()) if isinstance(d, int) else (1, ((d, 1),))


def _mul(a: Mono, b: Mono) -> Mono:
    exps = dict(a[1])
    for atom, e in b[1]:
        exps[atom] = exps.get(atom, 0) + e
    coef = a[0] * b[0]
    return (coef, tuple(sorted(exps.items()))) if coef else (0, ())


def _div(a: Mono, b: Mono) -> Size:
    """``a / b`` when it is an integer monomial for every value of the atoms, else None."""
    if b[0] == 0 or a[0] % b[0]:
        return None
    exps = dict(a[1])
    for atom, e in b[1]:
        left = exps.get(atom, 0) - e
        if left < 0:
            return None
        if left:
            exps[atom] = left
        else:
            exps.pop(atom, None)
    return (a[0] // b[0], tuple(sorted(exps.items())))


def _product(sizes: Sequence[Size]) -> Size:
    total = _ONE
    for s in sizes:
        if s is None:
            return None
        total = _mul(total, s)
    return total


def _int_of(s: Size) -> int | None:
    return s[0] if s is not None and not s[1] else None


def _broadcast(shapes: Sequence[Sizes | None]) -> Sizes | None:
    if any(s is None for s in shapes):
        return None
    rank = max(len(s) for s in shapes)  # type: ignore[arg-type]  # None ruled out above
    out: list[Size] = []
    for axis in range(rank):
        column = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]  # type: ignore[arg-type]
        if any(d is None for d in column):
            out.append(None)  # an unknown size may be 1 or not: the result is unknown too
            continue
        sizes = {d for d in column if d != _ONE}
        ints = {d for d in sizes if not d[1]}  # type: ignore[index]  # None ruled out above
        if not sizes:
            out.append(_ONE)
        elif len(sizes) == 1:
            out.append(sizes.pop())
        elif len(ints) == 1:
            out.append(ints.pop())  # the symbols must be 1 or this number for the op to run
        else:
            out.append(None)  # two symbols (either may be 1), or two numbers the op refuses
    return tuple(out)


class _Walker:
    def __init__(self, inference: dict[ir.Value, tuple[int | str | None, ...]], input_names: set[str]) -> None:
        self.inference = inference
        self.input_names = input_names
        self.subst: dict[str, Mono] = {}
        self.sizes: dict[ir.Value, Sizes] = {}
        self.values: dict[ir.Value, tuple[Sizes, bool]] = {}  # small int tensors: elements, is scalar

    # ------------------------------------------------------------------------------------------ atoms

    def normal(self, s: Size) -> Size:
        if s is None:
            return None
        total: Mono = (s[0], ())
        for atom, e in s[1]:
            # A substitute may hold atoms substituted later; never itself (``_agree`` checks), so this ends.
            part = self.normal(self.subst[atom]) if atom in self.subst else (1, ((atom, 1),))
            for _ in range(e):
                total = _mul(total, part)
        return total

    def _invented_atom(self, s: Size) -> str | None:
        if s is not None and s[0] == 1 and len(s[1]) == 1 and s[1][0][1] == 1 and s[1][0][0] not in self.input_names:
            return s[1][0][0]
        return None

    def _agree(self, ours: Size, theirs: Size) -> Size:
        """One size from two proofs of it: ours (the rules here) and inference's."""
        ours, theirs = self.normal(ours), self.normal(theirs)
        if ours is None or theirs is None or ours == theirs:
            return theirs if ours is None else ours
        for atom, other in ((self._invented_atom(theirs), ours), (self._invented_atom(ours), theirs)):
            if atom is not None and all(a != atom for a, _ in other[1]):  # type: ignore[index]  # not None here
                self.subst[atom] = other  # type: ignore[assignment]  # not None here
                return other
        return None  # two different sizes proven for one axis: one proof is wrong, trust neither

    # ------------------------------------------------------------------------------------------ lookups

    def dims(self, v: ir.Value | None) -> Sizes | None:
        if v is None:
            return None
        if v in self.sizes:
            return tuple(self.normal(s) for s in self.sizes[v])
        if v.const_value is not None and not v.is_graph_input():
            return tuple(mono(int(d)) for d in v.const_value.shape)
        return None

    def value(self, v: ir.Value | None) -> tuple[Sizes, bool] | None:
        if v is None:
            return None
        if v in self.values:
            elements, scalar = self.values[v]
            return tuple(self.normal(e) for e in elements), scalar
        tensor = v.const_value
        if tensor is None or v.is_graph_input() or tensor.dtype not in _INT_TYPES or tensor.size > _MAX_VALUES:
            return None
        array = np.asarray(tensor.numpy())
        if array.ndim > 1:
            return None
        return tuple(mono(int(x)) for x in array.reshape(-1)), array.ndim == 0

    def ints(self, v: ir.Value | None) -> list[int] | None:
        known = self.value(v)
        if known is None or any(_int_of(e) is None for e in known[0]):
            return None
        return [_int_of(e) for e in known[0]]  # type: ignore[misc]  # None ruled out above

    # ------------------------------------------------------------------------------------------ walk

    def visit(self, node: ir.Node) -> None:
        if not node.outputs:
            return
        if node.domain not in ("", "ai.onnx") or len(node.inputs) < _MIN_INPUTS.get(node.op_type, 0):
            ours: list[Sizes | None] = [None] * len(node.outputs)
        else:
            ours = [self._sizes_rule(node)] + [None] * (len(node.outputs) - 1)
            if node.outputs and (value := self._value_rule(node)) is not None:
                self.values[node.outputs[0]] = value
        for output, rule in zip(node.outputs, ours, strict=True):
            inferred = self.inference.get(output)
            theirs = None if inferred is None else tuple(None if d is None else mono(d) for d in inferred)
            if rule is not None and theirs is not None and len(rule) != len(theirs):
                continue  # two ranks for one value: trust neither
            if rule is None or theirs is None:
                chosen = theirs if theirs is not None else rule
            else:
                chosen = tuple(self._agree(o, t) for o, t in zip(rule, theirs, strict=True))
            if chosen is not None:
                self.sizes[output] = chosen

    def _sizes_rule(self, node: ir.Node) -> Sizes | None:
        op, ins = node.op_type, node.inputs
        first = self.dims(ins[0]) if ins else None
        if op in _UNARY or (op == "LayerNormalization" and len(node.outputs) >= 1):
            return first
        if op in _BROADCAST:
            if "broadcast" in node.attributes or "axis" in node.attributes:
                return None  # opset < 7: B aligned at ``axis``, not from the right
            return _broadcast([self.dims(v) for v in ins])
        if op == "Shape":
            return None if first is None else (mono(len(self._shape_slice(node, first))),)
        if op == "Transpose" and first is not None:
            perm = node.attributes.get_ints("perm", list(range(len(first)))[::-1])
            return tuple(first[p] for p in perm) if sorted(perm) == list(range(len(first))) else None
        if op == "MatMul":
            a, b = first, self.dims(ins[1])
            if a is None or b is None or len(a) < 2 or len(b) < 2:
                return None
            batch = _broadcast([a[:-2], b[:-2]])
            return None if batch is None else (*batch, a[-2], b[-1])
        if op == "GatherElements":
            return self.dims(ins[1])
        if op == "Gather" and first is not None:
            indices = self.dims(ins[1])
            axis = node.attributes.get_int("axis", 0)
            axis += len(first) if axis < 0 else 0
            if indices is None or not 0 <= axis < len(first):
                return None
            return (*first[:axis], *indices, *first[axis + 1 :])
        if op == "Reshape":
            return self._reshape(node, first)
        if op == "Expand":
            target = self.value(ins[1])
            return None if target is None else _broadcast([first, target[0]])
        if op == "ConstantOfShape":
            target = self.value(ins[0])
            return None if target is None else target[0]
        if op == "Tile" and len(ins) == 2:
            repeats = self.value(ins[1])
            if first is None or repeats is None or len(repeats[0]) != len(first):
                return None
            return tuple(None if d is None or r is None else _mul(d, r) for d, r in zip(first, repeats[0], strict=True))
        if op in ("Unsqueeze", "Squeeze"):
            return self._squeeze(node, first)
        if op == "Range":
            start, limit, delta = (self.value(v) for v in ins[:3])
            if start is None or limit is None or delta is None or len(limit[0]) != 1:
                return None
            # ceil(max(0, limit - start) / delta) elements: the limit itself from 0 by 1, when it is a size
            # (a product of sizes with a positive coefficient, or a non-negative number)
            top = limit[0][0]
            if start[0] != ((0, ()),) or delta[0] != (_ONE,) or top is None or top[0] < 0:
                return None
            return (top,)
        if op == "Slice":
            return self._slice(node, first)
        return None

    def _slice(self, node: ir.Node, data: Sizes | None) -> Sizes | None:
        """Axes sliced over their whole length keep their size; numbers slice as Python does (as ONNX does for
        step 1); anything else is unknown."""
        ins = node.inputs
        starts, ends = self.value(ins[1]), self.value(ins[2])
        axes = self.ints(ins[3]) if len(ins) > 3 and ins[3] is not None else None
        steps = self.ints(ins[4]) if len(ins) > 4 and ins[4] is not None else None
        if data is None or starts is None or ends is None or len(starts[0]) != len(ends[0]):
            return None
        axes = list(range(len(starts[0]))) if axes is None else [a + len(data) if a < 0 else a for a in axes]
        if len(axes) != len(starts[0]) or any(not 0 <= a < len(data) for a in axes):
            return None
        if (steps or [1] * len(axes)) != [1] * len(axes):
            return None
        out = list(data)
        for axis, start, end in zip(axes, starts[0], ends[0], strict=True):
            size, first, last = data[axis], _int_of(start), _int_of(end)
            if first == 0 and size is not None and (end == size or (last is not None and last >= 1 << 62)):
                continue  # the whole axis
            n = _int_of(size)
            out[axis] = None if n is None or first is None or last is None else mono(len(range(n)[first:last]))
        return tuple(out)

    def _shape_slice(self, node: ir.Node, dims: Sizes) -> Sizes:
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", None)
        return dims[start:end]

    def _reshape(self, node: ir.Node, data: Sizes | None) -> Sizes | None:
        target = self.value(node.inputs[1])
        if target is None:
            return None
        allowzero = node.attributes.get_int("allowzero", 0)
        out: list[Size] = []
        infer_at = None
        for i, t in enumerate(target[0]):
            if t == (0, ()) and not allowzero:
                out.append(data[i] if data is not None and i < len(data) else None)
            elif t == (-1, ()):
                infer_at = i
                out.append(None)
            elif t is not None and t[0] < 0:
                return None  # only -1 may be negative: the op refuses this shape
            else:
                out.append(t)
        if infer_at is not None and data is not None:
            total, others = _product(data), _product([d for i, d in enumerate(out) if i != infer_at])
            if total is not None and others is not None:
                out[infer_at] = _div(total, others)
        return tuple(out)

    def _squeeze(self, node: ir.Node, data: Sizes | None) -> Sizes | None:
        if data is None:
            return None
        axes = self.ints(node.inputs[1]) if len(node.inputs) > 1 else node.attributes.get_ints("axes", None)
        if axes is None:
            return None
        if node.op_type == "Squeeze":
            axes = [a + len(data) if a < 0 else a for a in axes]
            return tuple(d for i, d in enumerate(data) if i not in axes)
        rank = len(data) + len(axes)
        axes = sorted(a + rank if a < 0 else a for a in axes)
        if len(set(axes)) != len(axes) or any(not 0 <= a < rank for a in axes):
            return None  # the op refuses these axes
        rest = iter(data)
        return tuple(_ONE if i in axes else next(rest) for i in range(rank))

    def _value_rule(self, node: ir.Node) -> tuple[Sizes, bool] | None:
        """The elements of a small integer tensor the node computes (shape arithmetic), where proven."""
        op, ins = node.op_type, node.inputs
        out = node.outputs[0]
        if out.dtype is not None and out.dtype not in _INT_TYPES and op not in ("Equal", "Not"):
            return None
        if op == "Shape":
            dims = self.dims(ins[0])
            return None if dims is None else (self._shape_slice(node, dims), False)
        if op == "Constant":
            return self._constant(node)
        first = self.value(ins[0]) if ins else None
        if op in ("Identity", "Cast") and first is not None:
            to = node.attributes.get_int("to", None)
            return first if op == "Identity" or to in (ir.DataType.INT64, ir.DataType.INT32) else None
        if op == "Gather" and first is not None and not first[1] and node.attributes.get_int("axis", 0) == 0:
            index = self.value(ins[1])
            if index is None or any(_int_of(i) is None for i in index[0]):
                return None
            n = len(first[0])
            picks = [_int_of(i) for i in index[0]]
            if any(not -n <= p < n for p in picks):  # type: ignore[operator]  # ints here
                return None
            return tuple(first[0][p] for p in picks), index[1]  # type: ignore[index]  # ints here
        if op == "Reshape" and first is not None:
            target = self.ints(ins[1])
            n = len(first[0])
            if target in ([-1], [n]) or (n == 1 and target == []):
                return first[0], not target  # a vector stays itself; one element may become a scalar
            return None
        if op == "Unsqueeze" and first is not None and first[1]:
            return first[0], False
        if op == "Squeeze" and first is not None and len(first[0]) == 1:
            return first[0], True
        if op == "Concat" and node.attributes.get_int("axis", 0) in (0, -1):
            parts = [self.value(v) for v in ins]
            if any(p is None or p[1] for p in parts):
                return None
            return tuple(e for p in parts for e in p[0]), False  # type: ignore[union-attr]  # None ruled out
        if op == "Slice" and first is not None and not first[1]:
            starts, ends = self.ints(ins[1]), self.ints(ins[2])
            axes = self.ints(ins[3]) if len(ins) > 3 and ins[3] is not None else [0]
            steps = self.ints(ins[4]) if len(ins) > 4 and ins[4] is not None else [1]
            if starts is None or ends is None or axes not in ([0], [-1]) or steps != [1]:
                return None
            return first[0][starts[0] : ends[0]], False
        if op == "ConstantOfShape":
            shape, fill = self.ints(ins[0]), node.attributes.get("value")
            if shape is None or len(shape) != 1 or shape[0] > _MAX_VALUES or fill is None:
                return None
            array = np.asarray(fill.as_tensor().numpy()).reshape(-1)
            if array.size != 1 or array.dtype.kind not in "iu":
                return None
            return (mono(int(array[0])),) * shape[0], False
        if (
            op in ("Mul", "Div", "Add", "Sub", "Equal", "Where")
            and all(v is not None for v in ins)
            and not any(a in node.attributes for a in ("broadcast", "axis"))
        ):
            return self._elementwise(op, [self.value(v) for v in ins])
        return None

    @staticmethod
    def _constant(node: ir.Node) -> tuple[Sizes, bool] | None:
        attr = node.attributes.get("value") or node.attributes.get("value_int") or node.attributes.get("value_ints")
        if attr is None:
            return None
        if attr.name == "value":
            tensor = attr.as_tensor()
            if tensor.dtype not in _INT_TYPES or tensor.size > _MAX_VALUES:
                return None
            array = np.asarray(tensor.numpy())
            if array.ndim > 1:
                return None
            return tuple(mono(int(x)) for x in array.reshape(-1)), array.ndim == 0
        if attr.name == "value_int":
            return (mono(int(attr.as_int())),), True
        ints = list(attr.as_ints())
        return (tuple(mono(int(x)) for x in ints), False) if len(ints) <= _MAX_VALUES else None

    def _elementwise(self, op: str, args: list[tuple[Sizes, bool] | None]) -> tuple[Sizes, bool] | None:
        if any(a is None for a in args):
            return None
        lengths = {len(a[0]) for a in args if not a[1]}  # type: ignore[index]  # None ruled out
        if len(lengths) > 1:
            return None
        n = lengths.pop() if lengths else 1
        scalar = all(a[1] for a in args)  # type: ignore[index]  # None ruled out
        columns = [[a[0][0] if a[1] else a[0][i] for a in args] for i in range(n)]  # type: ignore[index]
        return tuple(self._element(op, c) for c in columns), scalar

    @staticmethod
    def _element(op: str, c: list[Size]) -> Size:
        if op == "Where":
            cond = _int_of(c[0])
            return None if cond is None else (c[1] if cond else c[2])
        a, b = c
        if a is None or b is None:
            return None
        if op == "Mul":
            return _mul(a, b)
        if op == "Div":
            return _div(a, b)
        if op == "Equal":
            if a == b:
                return _ONE
            for x, y in ((a, b), (b, a)):
                # a size is a product of non-negative sizes with a positive coefficient: never negative
                if x[1] and x[0] > 0 and not y[1] and y[0] < 0:
                    return (0, ())
            return (int(a == b), ()) if not a[1] and not b[1] else None
        x, y = _int_of(a), _int_of(b)
        if x is None or y is None:
            return a if op in ("Add", "Sub") and y == 0 else None
        return (x + y, ()) if op == "Add" else (x - y, ())


def refine(
    model: ir.Model,
    inference: dict[ir.Value, tuple[int | str | None, ...]],
    input_names: set[str],
    skip: set[ir.Node],
) -> dict[ir.Value, Sizes]:
    """The sizes of main-graph values, normalized monomials: inference's, refined by the rules here. Nodes in
    ``skip`` (those whose sizes are not proven) and their outputs are left out."""
    walker = _Walker(inference, input_names)
    for value in model.graph.inputs:
        if value in inference:
            walker.sizes[value] = tuple(None if d is None else mono(d) for d in inference[value])
    for node in model.graph:
        if node not in skip:
            walker.visit(node)
    return {v: tuple(walker.normal(s) for s in sizes) for v, sizes in walker.sizes.items()}
