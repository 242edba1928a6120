"""Rules for padding_elimination: which ops are token-wise, and which readers of re-padded tensors are safe.

Two halves, both pure (they read the graph, never edit it):

* **Growth** (``token_rule``, ``operand_kind``, ``pull_up``): whether a node can run on the unpadded
  ``[K, ...]`` tensors, which of its other operands must be unpadded and how, and the rank-dependent
  attributes to shift (the token dims ``[B, S]`` become the single dim ``[K]``).
* **Pad reads** (``PadReads``): a forward dataflow over everything that reads a re-padded tensor, tracking
  where values may differ from the original graph. A taint ``(kind, b, s)`` says: entries whose
  coordinates on axes ``b`` (batch) and ``s`` (sequence) name a pad token may differ. ``row``: they may
  differ arbitrarily; ``masked``: they differ but carry the attention mask's large negative additive;
  ``zero``: they are ~0 in both graphs (a softmax over masked scores). A reader is accepted when it
  provably ignores those entries; anything not understood is refused with the op named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

Dim = int | str | None
Taint = tuple[str, int, int]  # (kind, batch axis, sequence axis)
ROW, MASKED, ZERO = "row", "masked", "zero"

UNARY = {"Relu", "Gelu", "Erf", "Tanh", "Sigmoid", "Sqrt", "Cast", "Dropout", "Identity", "Neg", "Abs",
         "Exp", "Log", "Reciprocal", "Softplus"}  # fmt: skip
BINARY = {"Add", "Sub", "Mul", "Div", "Pow"}
# Readers of re-padded tensors: element-wise, so pad entries stay where they are.
_READ_UNARY = UNARY | {"Not", "Sign", "Floor", "Ceil", "Round", "Sin", "Cos", "LeakyRelu", "Elu", "Selu",
                       "Celu", "Softsign", "HardSigmoid", "HardSwish", "IsNaN", "IsInf", "Clip", "Mish"}  # fmt: skip
_READ_MULTI = BINARY | {"Max", "Min", "Where", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
                        "And", "Or", "Xor", "Mod", "PRelu", "Sum", "Mean", "Expand"}  # fmt: skip
_ZERO_KEEPING = {"Identity", "Dropout", "Cast", "Relu", "Neg", "Abs", "Tanh", "Erf", "Gelu", "Sqrt"}
_MASKED_KEEPING = {"Identity", "Dropout", "Cast"}
_REDUCE = {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
           "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin"}  # fmt: skip
_SHAPE_ONLY = {"Shape", "Size"}
_MASK01_CHAIN = {"Cast", "Unsqueeze", "Reshape", "Expand", "Identity", "Squeeze"}


# ---------------------------------------------------------------------------------------------- helpers


def dims(value: ir.Value) -> list[Dim] | None:
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else d.value for d in value.shape]


def rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def const_array(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def is_default(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")


def _axes(node: ir.Node, in_rank: int) -> list[int] | None:
    """The normalised ``axes`` of a Reduce/Squeeze/Unsqueeze node (attribute or constant input)."""
    if "axes" in node.attributes:
        raw = list(node.attributes.get_ints("axes"))
    elif len(node.inputs) > 1 and node.inputs[1] is not None:
        array = const_array(node.inputs[1])
        if array is None:
            return None
        raw = [int(a) for a in array.reshape(-1)]
    elif node.op_type in ("ArgMax", "ArgMin"):
        raw = [node.attributes.get_int("axis", 0)]
    else:
        return [] if node.attributes.get_int("noop_with_empty_axes", 0) else list(range(in_rank))
    return [a + in_rank if a < 0 else a for a in raw]


def _axis(node: ir.Node, in_rank: int, default: int) -> int:
    axis = node.attributes.get_int("axis", default)
    return axis + in_rank if axis < 0 else axis


# ----------------------------------------------------------------------------------------------- growth


@dataclasses.dataclass
class Rule:
    """How a token-wise node joins the unpadded subgraph: its token input and the attribute edit."""

    token_input: int
    update: Callable[[ir.Node], None] | None = None


def _shift_axis(node: ir.Node) -> None:
    axis = node.attributes.get_int("axis", -1)
    if axis >= 0:
        node.attributes["axis"] = ir.AttrInt64("axis", axis - 1)


def token_rule(node: ir.Node, token_input: int, opset: int) -> Rule | str:
    """Whether ``node`` computes each token's output from that token's input alone, or why not."""
    op, r = node.op_type, rank(node.inputs[token_input])
    if r is None:
        return f"{op}: input rank unknown"
    if op == "Gather" and is_default(node) and token_input == 1:
        table = node.inputs[0]
        if node.attributes.get_int("axis", 0) == 0 and const_array(table) is not None and rank(table) == 2:
            return Rule(1)
        return "Gather: not an embedding lookup (constant 2-D table, axis 0)"
    if r < 3 and op != "Gather":
        return f"{op}: a rank-{r} input has no feature axis to keep"
    if op == "Gelu" and node.domain == "com.microsoft" and token_input == 0:
        return Rule(0)
    if not is_default(node):
        return f"{node.domain}::{op} is not known to be token-wise"
    if op in UNARY and token_input == 0:
        if op == "Dropout" and len(node.inputs) > 2 and node.inputs[2] is not None:
            training = const_array(node.inputs[2])
            if training is None or bool(training):
                return "Dropout: training_mode is not a constant false"
        return Rule(0)
    if op in BINARY:
        return Rule(token_input)
    if op == "MatMul" and token_input == 0:
        if rank(node.inputs[1]) != 2:
            return "MatMul: the right input is not a 2-D weight"
        return Rule(0)
    if op == "LayerNormalization" and token_input == 0:
        if _axis(node, r, -1) < 2:
            return "LayerNormalization: normalises over a token axis"
        return Rule(0, _shift_axis)
    if op in ("Softmax", "LogSoftmax") and token_input == 0:
        if _axis(node, r, -1 if opset >= 13 else 1) < 2:
            return f"{op}: over a token axis"
        return Rule(0, _shift_axis)
    if op in ("ReduceMean", "ReduceSum") and token_input == 0:
        axes = _axes(node, r)
        if axes is None or not axes or min(axes) < 2:
            return f"{op}: reduces over a token axis (or over axes that are not constant)"
        return Rule(0, _shift_reduce_axes)
    return f"{op} is not token-wise"


def _shift_reduce_axes(node: ir.Node) -> None:
    if "axes" in node.attributes:
        raw = list(node.attributes.get_ints("axes"))
        node.attributes["axes"] = ir.AttrInt64s("axes", [a - 1 if a >= 0 else a for a in raw])
        return
    raw_array = const_array(node.inputs[1])
    assert raw_array is not None
    shifted = np.array([a - 1 if a >= 0 else a for a in raw_array.reshape(-1)], dtype=np.int64)
    const = ir.node("Constant", [], {"value": ir.tensor(shifted)}, name=f"{node.name}/axes_unpadded")
    const.outputs[0].name = f"{node.name}/axes_unpadded"
    assert node.graph is not None
    node.graph.insert_before(node, const)
    original = node.inputs[1]
    node.replace_input_with(1, const.outputs[0])
    if original is not None and original.is_initializer() and not original.uses() and original.name:
        node.graph.initializers.pop(original.name)  # ORT warns about unused initializers


def operand_kind(value: ir.Value, out_rank: int, token_dims: list[Dim]) -> str:
    """How an operand outside the subgraph must be brought to the ``[K, ...]`` layout.

    ``leave`` (broadcasts over both token dims as it is), ``squeeze`` ([1,1,...]: drop one leading dim),
    ``tokens`` ([B,S,...]), ``seq`` ([1,S,...]: row ``idx mod S``), ``batch`` ([B,1,...]: row
    ``idx div S``), ``expand`` (a leading dim shape inference cannot name: Expand to [B,S] first, as ORT
    does), or ``refuse: <why>``.
    """
    d = dims(value)
    if d is None:
        return "refuse: operand shape unknown"
    if len(d) > out_rank:
        return "refuse: operand has a higher rank than the token tensor"
    aligned = [1] * (out_rank - len(d)) + d
    if out_rank - len(d) >= 2:
        return "leave"
    classes = []
    for dim, ref in zip(aligned[:2], token_dims[:2], strict=True):
        if dim == 1:
            classes.append("1")
        elif dim is not None and dim == ref:
            classes.append("tok")
        elif isinstance(dim, int) and isinstance(ref, int):
            return f"refuse: operand dim {dim} does not broadcast to the token dim {ref}"
        else:
            classes.append("?")
    if "?" in classes:
        return "expand"
    return {
        ("tok", "tok"): "tokens",
        ("1", "tok"): "seq",
        ("tok", "1"): "batch",
        ("1", "1"): "leave" if len(d) < out_rank else "squeeze",
    }[(classes[0], classes[1])]


def pull_up(value: ir.Value, opset: int, inside: set[ir.Value]) -> tuple[list[tuple[ir.Node, Rule]], ir.Value]:
    """Token-wise single-consumer producers above ``value`` that can run unpadded instead of it.

    Returns the chain (nearest producer first) and the value the unpad moves to. An op joins the chain
    only if its other inputs broadcast over the token dims as they are (biases, weights, scalars).
    """
    chain: list[tuple[ir.Node, Rule]] = []
    while True:
        producer = value.producer()
        if producer is None or value.is_graph_output() or len(value.uses()) != 1:
            break
        if any(v in inside for v in producer.inputs):
            break
        if len([o for o in producer.outputs if o.uses() or o.is_graph_output()]) != 1:
            break
        rule = _pull_rule(producer, value, opset)
        if rule is None:
            break
        chain.append((producer, rule))
        token = producer.inputs[rule.token_input]
        assert token is not None
        value = token
    return chain, value


def _pull_rule(node: ir.Node, output: ir.Value, opset: int) -> Rule | None:
    out_rank = rank(output)
    if out_rank is None:
        return None
    candidates = [1] if node.op_type == "Gather" else list(range(len(node.inputs)))
    for index in candidates:
        token = node.inputs[index]
        if token is None:
            continue
        want = out_rank - 1 if node.op_type == "Gather" else out_rank
        if rank(token) != want:
            continue
        rule = token_rule(node, index, opset)
        if isinstance(rule, str):
            return None
        others = [v for i, v in enumerate(node.inputs) if i != index and v is not None]
        if node.op_type not in BINARY or all(operand_kind(v, out_rank, [None, None]) == "leave" for v in others):
            return rule
        return None
    return None


# ------------------------------------------------------------------------------------------- pad reads


@dataclasses.dataclass
class PadReads:
    """Forward check that nothing outside the unpadded subgraph reads pad positions unmasked."""

    inside_nodes: set[ir.Node]
    unpad_sites: set[tuple[ir.Node, int]]  # (joined node, input index) that reads an unpadded operand
    mask_additive: set[ir.Value]  # pure functions of the validity inputs (an extended attention mask)
    mask01: set[ir.Value]  # the 0/1 mask itself behind shape-only ops (multiplicative masking)
    opset: int
    taints: dict[ir.Value, frozenset[Taint]] = dataclasses.field(default_factory=dict)

    def run(self, graph: ir.Graph, sources: list[ir.Value]) -> tuple[str, ir.Node | None] | None:
        """Trace from every re-padded value; the first refusal (reason, node), or None when all is safe."""
        for value in sources:
            self.taints[value] = frozenset({(ROW, 0, 1)})
        for node in graph:
            read = [(i, v) for i, v in enumerate(node.inputs) if v is not None and self.taints.get(v)]
            if not read:
                continue
            if node in self.inside_nodes:
                for i, v in read:
                    if v in sources:
                        continue  # the subgraph reading its own (unpadded) value
                    if (node, i) not in self.unpad_sites or any(t[1:] != (0, 1) for t in self.taints[v]):
                        return f"{node.op_type} reads a re-padded tensor other than by its token rows", node
                continue
            outcome = self._propagate(node)
            if isinstance(outcome, str):
                return outcome, node
            for out in node.outputs:
                if outcome:
                    self.taints[out] = outcome
        for value in self.taints:
            for use in value.uses():
                if use.node.graph is not graph:  # an If/Loop body: not traced
                    return f"{use.node.op_type} in a subgraph reads a re-padded tensor", use.node
        return None

    def output_taint(self, value: ir.Value) -> frozenset[Taint]:
        return self.taints.get(value, frozenset())

    def _propagate(self, node: ir.Node) -> frozenset[Taint] | str:
        op = node.op_type
        ins = [(v, self.taints.get(v, frozenset())) if v is not None else (None, frozenset())
               for v in node.inputs]  # fmt: skip
        out_rank = rank(node.outputs[0]) if node.outputs else None
        if op in _SHAPE_ONLY:
            return frozenset()
        if out_rank is None or any(t and rank(v) is None for v, t in ins):
            return f"{op}: shapes unknown on a path from a re-padded tensor (run shape_inference first)"
        if not is_default(node) and not (op == "Gelu" and node.domain == "com.microsoft"):
            return f"{node.domain}::{op} reads a re-padded tensor and is not known to ignore pad positions"
        taints = ins[0][1]
        if op in _READ_UNARY and not any(t for _, t in ins[1:]):
            return _unary(op, taints)
        if op in _READ_MULTI:
            return self._elementwise(node, ins, out_rank)
        if op == "Transpose":
            perm = list(node.attributes.get_ints("perm", list(range(out_rank))[::-1]))
            return frozenset((k, perm.index(b), perm.index(s)) for k, b, s in taints)
        if op == "Reshape":
            return _reshape(node, taints)
        if op in ("Unsqueeze", "Squeeze"):
            return _squeeze(node, taints, out_rank)
        if op == "MatMul":
            return _matmul(ins, out_rank)
        if op in ("Softmax", "LogSoftmax"):
            return _softmax(node, taints, out_rank, self.opset)
        if op in ("LayerNormalization", "InstanceNormalization", "LpNormalization"):
            axis = _axis(node, out_rank, -1)
            if any(b >= axis or s >= axis for _, b, s in taints):
                return f"{op} normalises over the sequence axis of a re-padded tensor"
            return _unary("LayerNormalization", taints)
        if op in _REDUCE:
            return _reduce(node, taints, rank(ins[0][0]) or 0)
        if op in ("Gather", "Slice"):
            return _select(node, ins)
        return f"{op} reads a re-padded tensor and is not known to ignore pad positions"

    def _elementwise(
        self, node: ir.Node, ins: list[tuple[ir.Value | None, frozenset[Taint]]], out_rank: int
    ) -> frozenset[Taint] | str:
        op = node.op_type
        result: set[Taint] = set()
        for value, taints in ins:
            shift = out_rank - (rank(value) or 0)
            result |= {(k, b + shift, s + shift) for k, b, s in taints}
        clean = [v for v, t in ins if v is not None and not t]
        out: set[Taint] = set()
        for kind, b, s in result:
            if (
                op == "Add"
                and kind == ROW
                and any(v in self.mask_additive and varies(v, out_rank, b, s) for v in clean)
            ):
                out.add((MASKED, b, s))  # scores + (1 - mask) * -large
            elif (
                op == "Mul"
                and kind in (ROW, ZERO)
                and any(v in self.mask01 and varies(v, out_rank, b, s) for v in clean)
            ):
                continue  # h * mask: pad entries are 0 in both graphs
            elif kind == MASKED and not _keeps_masked(op, clean):
                out.add((ROW, b, s))  # no longer provably masked: pad entries are just different
            elif kind == ZERO and not (op == "Where" and all(_is_zero(v) for v in clean if v is not ins[0][0])):
                continue  # ~0 in both graphs: the results agree (Where(isnan, 0, probs) keeps the zeros)
            else:
                out.add((kind, b, s))
        return frozenset(out)


def _is_zero(value: ir.Value) -> bool:
    array = const_array(value)
    return array is not None and not np.any(array)


def varies(mask: ir.Value, out_rank: int, b: int, s: int) -> bool:
    """Whether a mask operand has its own batch and sequence dims at the tainted axes (no broadcast)."""
    d = dims(mask)
    if d is None:
        return False
    aligned = [1] * (out_rank - len(d)) + d
    return aligned[b] != 1 and aligned[s] != 1


def _keeps_masked(op: str, clean: list[ir.Value]) -> bool:
    if op in ("Add", "Sub"):
        return True  # a further additive bias keeps the mask's large negative
    if op in ("Mul", "Div") and len(clean) == 1:
        scale = const_array(clean[0])
        return scale is not None and scale.size == 1 and float(scale.reshape(-1)[0]) > 0
    return False


def _unary(op: str, taints: frozenset[Taint]) -> frozenset[Taint] | str:
    out = set()
    for kind, b, s in taints:
        if kind == ZERO and op not in _ZERO_KEEPING:
            continue
        # masked scores that are no longer provably masked: their pad entries are just different
        out.add((ROW if kind == MASKED and op not in _MASKED_KEEPING else kind, b, s))
    return frozenset(out)


def _reshape(node: ir.Node, taints: frozenset[Taint]) -> frozenset[Taint] | str:
    data, out = node.inputs[0], node.outputs[0]
    din, dout = dims(data) if data else None, dims(out)
    spec = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
    if din is None or dout is None:
        return "Reshape: shapes unknown on a path from a re-padded tensor"
    keep = 0
    for i in range(min(len(din), len(dout))):
        copies = spec is not None and i < spec.size and int(spec[i]) == 0
        copies = copies and not node.attributes.get_int("allowzero", 0)
        if not (copies or (din[i] is not None and din[i] == dout[i])):
            break
        keep = i + 1
    if any(max(b, s) >= keep for _, b, s in taints):
        return "Reshape: may merge or move the token axes of a re-padded tensor"
    return taints


def _squeeze(node: ir.Node, taints: frozenset[Taint], out_rank: int) -> frozenset[Taint] | str:
    in_rank = rank(node.inputs[0]) or 0
    if node.op_type == "Unsqueeze":
        axes = _axes(node, out_rank)
        if axes is None:
            return "Unsqueeze: axes not constant"
        kept = [i for i in range(out_rank) if i not in axes]  # kept[old axis] = new axis
        return frozenset((k, kept[b], kept[s]) for k, b, s in taints)
    axes = _axes(node, in_rank)
    if axes is None or any(b in axes or s in axes for _, b, s in taints):
        return "Squeeze: removes a token axis of a re-padded tensor"

    def new(a: int) -> int:
        return a - sum(1 for x in axes if x < a)

    return frozenset((k, new(b), new(s)) for k, b, s in taints)


def _matmul(ins: list[tuple[ir.Value | None, frozenset[Taint]]], ro: int) -> frozenset[Taint] | str:
    (a, ta), (b_val, tb) = ins[0], ins[1]
    ra, rb = rank(a) or 0, rank(b_val) or 0
    if (ta and ra < 2) or (tb and rb < 2):
        return "MatMul: a 1-D operand read from a re-padded tensor"
    out: set[Taint] = set()
    zero_contraction = {b + ro - ra for k, b, s in ta if k == ZERO and s == ra - 1} | {
        b + ro - rb for k, b, s in tb if k == ZERO and s == rb - 2
    }
    for side, (taints, r) in enumerate(((ta, ra), (tb, rb))):
        m_axis, c_axis, o_axis = (r - 2, r - 1, ro - 2) if side == 0 else (r - 1, r - 2, ro - 1)
        for kind, b, s in taints:
            if b >= r - 2:
                return "MatMul: the batch axis of a re-padded tensor is a matrix axis"
            bo = b + ro - r
            if s == c_axis:
                if kind != ZERO and bo not in zero_contraction:
                    return "MatMul: contracts over pad positions without a masked (zero) operand"
            elif s == m_axis:
                if kind != ZERO:  # zero rows/columns give zero rows/columns in both graphs
                    out.add((ROW, bo, o_axis))
            else:
                out.add((kind if kind != MASKED else ROW, bo, s + ro - r))
    return frozenset(out)


def _softmax(node: ir.Node, taints: frozenset[Taint], r: int, opset: int) -> frozenset[Taint] | str:
    axis = _axis(node, r, -1 if opset >= 13 else 1)
    if opset < 13 and axis != r - 1:
        return f"{node.op_type}: opset < 13 flattens from axis {axis} over a re-padded tensor"
    out = set()
    for kind, b, s in taints:
        if b == axis or (s == axis and kind == ROW):
            return f"{node.op_type} over the sequence axis reads pad positions without the attention mask"
        if s == axis and kind == MASKED:
            out.add((ZERO if node.op_type == "Softmax" else ROW, b, s))
        elif kind in (ROW, MASKED):  # e.g. a [B,1,S,S] mask also masks query rows: still token-aligned
            out.add((ROW, b, s))
    return frozenset(out)


def _reduce(node: ir.Node, taints: frozenset[Taint], in_rank: int) -> frozenset[Taint] | str:
    axes = _axes(node, in_rank)
    if axes is None:
        return f"{node.op_type}: axes not constant"
    keepdims = node.attributes.get_int("keepdims", 1)
    out = set()
    for kind, b, s in taints:
        if s in axes or b in axes:
            if kind == ZERO and node.op_type == "ReduceSum":
                continue
            return (
                f"{node.op_type} over axis {s if s in axes else b} (a token axis of a re-padded tensor) reads "
                "pad positions without the mask (e.g. unmasked mean pooling)"
            )

        def new(a: int) -> int:
            return a if keepdims else a - sum(1 for x in axes if x < a)

        if kind != ZERO:
            out.add((ROW, new(b), new(s)))
    return frozenset(out)


def _select(node: ir.Node, ins: list[tuple[ir.Value | None, frozenset[Taint]]]) -> frozenset[Taint] | str:
    """Gather/Slice: position 0 of the sequence axis is always computed exactly (it is forced valid)."""
    (data, taints), rest = ins[0], ins[1:]
    if any(t for _, t in rest):
        return f"{node.op_type}: indices read from a re-padded tensor"
    r = rank(data) or 0
    if node.op_type == "Gather":
        axis, indices = _axis(node, r, 0), const_array(node.inputs[1])
        first_only = indices is not None and indices.size > 0 and not np.any(indices)
        q = rank(node.inputs[1]) or 0
    else:
        starts, ends = const_array(node.inputs[1]), const_array(node.inputs[2])
        axes_v = const_array(node.inputs[3]) if len(node.inputs) > 3 else None
        steps = const_array(node.inputs[4]) if len(node.inputs) > 4 else None
        if starts is None or ends is None or starts.size != 1:
            return "Slice: bounds not constant on a re-padded tensor"
        axis = int(axes_v.reshape(-1)[0]) if axes_v is not None else 0
        axis = axis + r if axis < 0 else axis
        step = 1 if steps is None else int(steps.reshape(-1)[0])
        first_only = int(starts.reshape(-1)[0]) == 0 and int(ends.reshape(-1)[0]) == 1 and step == 1
        q = 1
    out = set()
    for kind, b, s in taints:
        if axis == s and first_only:
            continue  # position 0 of every row is forced valid: computed exactly
        if axis in (b, s):
            return f"{node.op_type} on a token axis at a position that may be padding"

        def new(a: int) -> int:
            return a if a < axis else a - 1 + q

        out.add((kind if kind != MASKED else ROW, new(b), new(s)))
    return frozenset(out)
