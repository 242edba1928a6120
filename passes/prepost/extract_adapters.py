"""extract_adapters: move the LoRA pairs of an exported peft model out of the graph, into an adapter file.

A ``torch.onnx`` export of an unmerged peft model computes every adapted layer as ``base(x) + s * (x @ A) @ B``,
with the peft names gone (``onnx::MatMul_123`` / ``val_87`` initializers, nodes ``.../query/default/MatMul``).
This pass finds the pairs by structure, reads names only as hints for the module path, folds the scale into
``B``, and turns ``A`` and ``B`` into graph inputs whose default is an empty initializer::

    Before                                               After
    x --> MatMul(W) --> [Add(bias)] ------> Add --> y    x --> MatMul(W) --> [Add(bias)] ---> Add --> y
    x --> MatMul(A) --> MatMul(B) --> Mul(s) --^        x --> MatMul(A_in) --> MatMul(B_in) --^
          A: const [in, r]   B: const [r, out]                A_in: input [in, R] = zeros [in, 0]
                                                              B_in: input [R, out] = zeros [0, out]

The rank axis ``R`` is symbolic, so adapters of any rank fit. Without an adapter the rank is 0, ``x @ A_in @
B_in`` is zeros and the model computes its base; with the extracted ``.onnx_adapter`` active
(``onnxruntime.LoraAdapter`` + ``RunOptions.add_active_adapter``; values ``A`` and ``s * B``) it computes what
the uploaded model computed. The adapter bytes go to ``ctx.side_files[".onnx_adapter"]`` (declared in
``adds_files``; the pipeline writes them next to the artifact) and the result's ``verify_with_side_file``
names it: verification must activate it (the notes say so too, for people).

Matched, per ``Add``: one side is ``MatMul(MatMul(x, A), B)`` with optional ``Mul`` by scalar constants
before or after ``B`` (also ``Gemm`` without bias, ``transA=0``, for 2-D exports); ``A``, ``B`` constants
(initializers, ``Constant`` nodes, or their ``Identity`` or ``Transpose``) with a rank ``r <= max_rank`` and
``r < min(in, out)``; the other side is the base layer on the same ``x``: ``MatMul(x, W)``, ``Add(MatMul(x,
W), bias)`` (either operand order; the bias may be an ``Identity`` of an equal initializer, as TorchScript
exports a model with its initial zero biases) or ``Gemm(x, W[, C])`` with ``W`` of shape ``[in, out]``
(``[out, in]`` with ``transB``), or GPT-2's ``Conv1D`` on flattened rows, ``Reshape(Gemm(Reshape(x, [-1,
in]), W, bias))``. The intermediate values must have no other consumer and not be graph outputs.

Module path hints, first found wins: the exporter's ``pkg.torch.onnx.name_scopes`` node metadata (dynamo),
the common prefix of the nodes' scoped names (TorchScript: ``/encoder/layer.0/.../query/default/MatMul``),
the base layer's weight or bias name (``...query.base_layer.bias``), peft names on ``A``/``B``. Without any,
the pair is still extracted, as ``lora<i>`` (a peft adapter cannot then be mapped onto it by module).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from typing import Any

import numpy as np
import onnx_ir as ir
from pydantic import Field

from core.adapters import ADAPTER_SUFFIX, SLOTS_KEY, Slot, adapter_bytes, normalize_module, slots_json
from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult

_DEFAULT = ("", "ai.onnx")
_PASS_THROUGH = {"Identity", "Dropout"}
_SCOPE_OPS = re.compile(r"^(MatMul|Gemm|Mul|Add|Transpose|Constant|Identity)(_\d+)?$")
_PEFT_PARTS = {"base_layer", "lora_A", "lora_B", "lora_dropout", "default", "weight", "bias"}


class ExtractAdaptersOptions(PassOptions):
    max_rank: int = Field(
        256,
        ge=1,
        description="Largest inner dimension of x @ A @ B taken as a LoRA rank (it must also be below the "
        "layer's in and out features).",
    )


@dataclasses.dataclass
class _Pair:
    add: ir.Node  # the Add summing the base and the LoRA branch
    lora_index: int  # which input of add is the LoRA branch
    mm_a: ir.Node
    mm_b: ir.Node
    muls: list[ir.Node]  # scale multiplications removed by the rewrite
    a: np.ndarray  # [in, r], as x @ A uses it
    b: np.ndarray  # [r, out]
    scale: float
    base_nodes: list[ir.Node]
    base_weight: ir.Value
    base_bias: ir.Value | None
    module: str = ""
    module_known: bool = False

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])


class ExtractAdapters(Pass[ExtractAdaptersOptions]):
    name = "extract_adapters"
    summary = "Move LoRA pairs (found by structure) into an .onnx_adapter; the artifact runs as the base without it."
    exact = True  # with the adapter active, the function is unchanged up to float rounding
    in_place = True
    adds_files = (ADAPTER_SUFFIX,)

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        options = self.options
        graph = model.graph
        non_matches: list[NonMatch] = []
        pairs: list[_Pair] = []
        for node in list(graph):
            if node.op_type == "Add" and node.domain in _DEFAULT and len(node.inputs) == 2:
                pair = _match(node, options.max_rank, non_matches)
                if pair is not None:
                    pairs.append(pair)
        if not pairs:
            return PassResult(
                model,
                False,
                {"lora_pairs": 0},
                non_matches,
                {"code": "NO_LORA_PAIR", "decision": "skipped: no LoRA pair (base + x @ A @ B) in the graph"},
            )
        _name_pairs(pairs)

        params: dict[str, np.ndarray] = {}
        slots: list[Slot] = []
        replaced: list[ir.Value] = []
        taken = {v.name for v in _all_values(graph)}
        for pair in pairs:
            a_name = _unique(f"{pair.module}.lora_A.weight", taken)
            b_name = _unique(f"{pair.module}.lora_B.weight", taken)
            rank_dim = ir.SymbolicDim(f"{pair.module}.rank")
            fan_in, fan_out = int(pair.a.shape[0]), int(pair.b.shape[1])
            dtype = ir.DataType.from_numpy(pair.a.dtype)
            a_in = _overridable(graph, a_name, ir.Shape([fan_in, rank_dim]), dtype, np.zeros((fan_in, 0), pair.a.dtype))
            b_in = _overridable(
                graph, b_name, ir.Shape([rank_dim, fan_out]), dtype, np.zeros((0, fan_out), pair.a.dtype)
            )
            params[a_name] = pair.a
            params[b_name] = (pair.b.astype(np.float64) * pair.scale).astype(pair.b.dtype)
            replaced.extend(_rewrite(graph, pair, a_in, b_in))
            slots.append(
                Slot(pair.module, pair.module_known, a_name, b_name, fan_in, fan_out, pair.rank, pair.a.dtype.name)
            )
        for value in replaced:
            _drop_if_dead(graph, value)

        data = adapter_bytes(params)
        ctx.side_files[ADAPTER_SUFFIX] = data
        model.metadata_props[SLOTS_KEY] = slots_json(slots)
        report = [
            {
                "module": s.module,
                "module_known": s.module_known,
                "rank": s.rank,
                "scale": p.scale,
                "a_shape": [s.in_features, s.rank],
                "b_shape": [s.rank, s.out_features],
                "inputs": [s.a_input, s.b_input],
                "bytes": int(params[s.a_input].nbytes + params[s.b_input].nbytes),
            }
            for s, p in zip(slots, pairs, strict=True)
        ]
        notes: dict[str, Any] = {
            "decision": f"extracted {len(pairs)} LoRA pair(s) into {ADAPTER_SUFFIX}",
            "pairs": report,
            "adapter_bytes": len(data),
            "verify_with_adapter": ADAPTER_SUFFIX,
        }
        unknown = [s.module for s in slots if not s.module_known]
        if unknown:
            notes["modules_unknown"] = unknown
        return PassResult(
            model, True, {"lora_pairs": len(pairs)}, non_matches, notes, verify_with_side_file=ADAPTER_SUFFIX
        )


# ------------------------------------------------------------------------------------------ matching


def _skip(value: ir.Value | None) -> ir.Value | None:
    while value is not None:
        node = value.producer()
        if node is None or node.op_type not in _PASS_THROUGH or node.domain not in _DEFAULT or not node.inputs:
            return value
        if node.op_type == "Dropout" and len(node.inputs) > 2 and node.inputs[2] is not None:
            return value  # training_mode given: not provably identity
        value = node.inputs[0]
    return value


def _const(value: ir.Value | None) -> np.ndarray | None:
    """The value of a constant (initializer that is not an overridable input, Constant, or an Identity or
    Transpose of one)."""
    if value is None or value.is_graph_input():
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is None or node.domain not in _DEFAULT:
        return None
    if node.op_type == "Identity":
        # The TorchScript exporter keeps one of several equal initializers (the zero biases of a model as
        # transformers initialises it) and gives the others as Identity nodes reading it.
        return _const(node.inputs[0])
    if node.op_type == "Constant":
        attr = node.attributes.get("value")
        return None if attr is None else attr.as_tensor().numpy()
    if node.op_type == "Transpose":
        inner = _const(node.inputs[0])
        if inner is None:
            return None
        perm = node.attributes.get_ints("perm", None)
        return np.transpose(inner, perm) if perm is not None else inner.T
    return None


def _single_use(value: ir.Value) -> bool:
    return len(value.uses()) == 1 and not value.is_graph_output()


def _linear(node: ir.Node | None) -> tuple[ir.Value, np.ndarray, float] | None:
    """(x, W as [in, out], alpha) of ``x @ W`` as MatMul, or Gemm without bias and transA=0; else None."""
    if node is None or node.domain not in _DEFAULT:
        return None
    if node.op_type == "MatMul":
        w = _const(node.inputs[1])
        if w is None or w.ndim != 2 or node.inputs[0] is None:
            return None
        return node.inputs[0], w, 1.0
    if node.op_type == "Gemm" and (len(node.inputs) < 3 or node.inputs[2] is None):
        if node.attributes.get_int("transA", 0):
            return None
        w = _const(node.inputs[1])
        if w is None or w.ndim != 2 or node.inputs[0] is None:
            return None
        w = w.T if node.attributes.get_int("transB", 0) else w
        return node.inputs[0], w, float(node.attributes.get_float("alpha", 1.0))
    return None


def _scalar_mul(node: ir.Node | None, value: ir.Value) -> tuple[ir.Value, float] | None:
    """(the other operand, the scalar) if ``node`` is Mul(value-side, scalar constant)."""
    if node is None or node.op_type != "Mul" or node.domain not in _DEFAULT or len(node.inputs) != 2:
        return None
    for i in (0, 1):
        c = _const(node.inputs[i])
        other = node.inputs[1 - i]
        if c is not None and c.size == 1 and other is not None:
            return other, float(c.reshape(-1)[0])
    return None


def _strip_muls(value: ir.Value, muls: list[ir.Node]) -> tuple[ir.Value, float] | None:
    scale = 1.0
    while True:
        node = value.producer()
        hit = _scalar_mul(node, value)
        if hit is None:
            return value, scale
        if not _single_use(value):
            return None
        assert node is not None
        muls.append(node)
        value, s = hit
        scale *= s


def _match(add: ir.Node, max_rank: int, non_matches: list[NonMatch]) -> _Pair | None:
    for lora_index in (0, 1):
        branch, base_out = add.inputs[lora_index], add.inputs[1 - lora_index]
        if branch is None or base_out is None:
            continue
        muls: list[ir.Node] = []
        stripped = _strip_muls(branch, muls)
        if stripped is None:
            continue
        v_b, scale_out = stripped
        mm_b = v_b.producer()
        lin_b = _linear(mm_b)
        if lin_b is None or (v_b is not branch and not _single_use(v_b)):
            continue
        u, b, alpha_b = lin_b
        stripped = _strip_muls(u, muls)
        if stripped is None:
            continue
        v_a, scale_mid = stripped
        mm_a = v_a.producer()
        lin_a = _linear(mm_a)
        if lin_a is None or not _single_use(v_a):
            continue
        x, a, alpha_a = lin_a
        assert mm_a is not None and mm_b is not None
        if a.shape[1] != b.shape[0]:
            continue
        rank, fan_in, fan_out = int(a.shape[1]), int(a.shape[0]), int(b.shape[1])
        if v_b is branch and not _single_use(v_b):
            non_matches.append(_nm(mm_b, "the x @ A @ B product has other consumers"))
            continue
        if rank > max_rank or rank >= min(fan_in, fan_out):
            non_matches.append(
                _nm(
                    mm_a,
                    f"inner dim {rank} of x @ A @ B ({fan_in} -> {fan_out}) is not a small LoRA rank "
                    f"(max_rank {max_rank}, and below in and out features)",
                )
            )
            continue
        if a.dtype != b.dtype or a.dtype.kind != "f":
            non_matches.append(_nm(mm_a, f"A and B are {a.dtype} and {b.dtype}, not one float type"))
            continue
        base = _match_base(base_out, x, fan_in, fan_out)
        if isinstance(base, str):
            non_matches.append(_nm(add, f"LoRA-shaped branch, but {base}"))
            continue
        base_nodes, weight, bias = base
        return _Pair(
            add=add,
            lora_index=lora_index,
            mm_a=mm_a,
            mm_b=mm_b,
            muls=muls,
            a=a,
            b=b,
            scale=scale_out * scale_mid * alpha_a * alpha_b,
            base_nodes=base_nodes,
            base_weight=weight,
            base_bias=bias,
        )
    return None


def _reshape_input(node: ir.Node | None) -> ir.Value | None:
    """The data input of a Reshape node, else None."""
    if node is None or node.op_type != "Reshape" or node.domain not in _DEFAULT or not node.inputs:
        return None
    return node.inputs[0]


def _match_base(
    value: ir.Value, x: ir.Value, fan_in: int, fan_out: int
) -> tuple[list[ir.Node], ir.Value, ir.Value | None] | str:
    node = value.producer()
    bias: ir.Value | None = None
    nodes: list[ir.Node] = []
    # GPT-2's Conv1D (peft fan_in_fan_out) runs as addmm on rows: Reshape(Gemm(Reshape(x, [-1, in]), W, b)).
    flat = _reshape_input(node)
    if flat is not None and flat.producer() is not None:
        assert node is not None
        nodes, node = [node], flat.producer()
    if node is not None and node.op_type == "Add" and node.domain in _DEFAULT:
        for i in (0, 1):
            c = _const(node.inputs[i])
            inner = node.inputs[1 - i]
            if c is not None and inner is not None and inner.producer() is not None:
                bias, nodes, node = node.inputs[i], [*nodes, node], inner.producer()
                break
    if node is None or node.domain not in _DEFAULT or node.op_type not in ("MatMul", "Gemm"):
        return "the other side of the Add is not a base MatMul/Gemm layer"
    x_base = node.inputs[0]
    w = _const(node.inputs[1]) if len(node.inputs) > 1 else None
    if w is None or w.ndim != 2 or x_base is None:
        return "the base layer has no constant 2-D weight"
    if node.op_type == "Gemm":
        if node.attributes.get_int("transA", 0):
            return "the base Gemm transposes its input"
        if node.attributes.get_int("transB", 0):
            w = w.T
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            bias = node.inputs[2]
    if _skip(x_base) is not _skip(x):
        flatten = _skip(x_base).producer()
        if not (nodes and nodes[0].op_type == "Reshape") or _skip(_reshape_input(flatten)) is not _skip(x):
            return "the base layer and x @ A @ B read different inputs"
        assert flatten is not None
        nodes.append(flatten)  # the Conv1D form's row flattening of x
    if tuple(w.shape) != (fan_in, fan_out):
        return f"the base weight is {list(w.shape)}, x @ A @ B maps {fan_in} -> {fan_out}"
    weight = node.inputs[1]
    assert weight is not None
    return [node, *nodes], weight, bias


# -------------------------------------------------------------------------------------------- naming


def _scope_hint(node: ir.Node) -> str | None:
    raw = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if not raw:
        return None
    try:
        scopes = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return None
    if not isinstance(scopes, list) or len(scopes) < 2:
        return None
    # The last entry names the op (add_119); the one before is the innermost module.
    return str(scopes[-2]) or None


def _name_hint(nodes: list[ir.Node]) -> str | None:
    """Common scope of TorchScript-style node names (``/a/b/query/default/MatMul``)."""
    parts = [n.name.strip("/").split("/") for n in nodes if n.name and "/" in n.name]
    if len(parts) < 2:
        return None
    common: list[str] = []
    for segs in zip(*(p[:-1] for p in parts), strict=False):
        if len(set(segs)) != 1:
            break
        common.append(segs[0])
    while common and (common[-1] in _PEFT_PARTS or _SCOPE_OPS.match(common[-1])):
        common.pop()
    return ".".join(common) or None


def _value_hint(value: ir.Value | None) -> str | None:
    if value is None or not value.name:
        return None
    name = value.name
    m = re.match(r"^(?P<module>.+?)(\.base_layer)?\.(weight|bias)$", name)
    if m and not re.search(r"(^|[._])(onnx|val)[:_]", name):
        return re.sub(r"\.lora_[AB](\.[^.]+)?$", "", m["module"])
    return None


def _hint(pair: _Pair) -> str | None:
    for node in (pair.add, *pair.base_nodes, pair.mm_a, pair.mm_b):
        hint = _scope_hint(node)
        if hint:
            return hint
    hint = _name_hint([pair.add, *pair.base_nodes, pair.mm_a, pair.mm_b, *pair.muls])
    if hint:
        return hint
    for value in (pair.base_bias, pair.base_weight, pair.mm_a.inputs[1], pair.mm_b.inputs[1]):
        hint = _value_hint(value)
        if hint:
            return hint
    return None


def _name_pairs(pairs: list[_Pair]) -> None:
    seen: set[str] = set()
    for index, pair in enumerate(pairs):
        hint = _hint(pair)
        module = normalize_module(hint) if hint else ""
        if module and module not in seen:
            pair.module, pair.module_known = module, True
        else:
            pair.module, pair.module_known = f"lora{index}", False
        seen.add(pair.module)


# ------------------------------------------------------------------------------------------- rewrite


def _all_values(graph: ir.Graph) -> list[ir.Value]:
    values = list(graph.inputs) + list(graph.initializers.values())
    for node in ir.traversal.RecursiveGraphIterator(graph):
        values.extend(v for v in node.outputs)
    return values


def _unique(name: str, taken: set[str]) -> str:
    candidate, i = name, 1
    while candidate in taken:
        candidate = f"{name}_{i}"
        i += 1
    taken.add(candidate)
    return candidate


def _overridable(graph: ir.Graph, name: str, shape: ir.Shape, dtype: ir.DataType, default: np.ndarray) -> ir.Value:
    """A graph input that is also an initializer (ORT lets a feed or an active adapter override it)."""
    value = ir.Value(name=name, shape=shape, type=ir.TensorType(dtype), const_value=ir.tensor(default, name=name))
    graph.inputs.append(value)
    graph.register_initializer(value)
    return value


def _rewire_linear(node: ir.Node, weight: ir.Value) -> None:
    if node.op_type == "Gemm":
        node.attributes["transB"] = ir.AttrInt64("transB", 0)
        node.attributes["alpha"] = ir.AttrFloat32("alpha", 1.0)  # folded into B
    node.replace_input_with(1, weight)


def _rewrite(graph: ir.Graph, pair: _Pair, a_in: ir.Value, b_in: ir.Value) -> list[ir.Value]:
    """Feed the LoRA MatMuls from the new inputs and drop the scale Muls; returns the replaced constants."""
    replaced = [v for v in (pair.mm_a.inputs[1], pair.mm_b.inputs[1]) if v is not None]
    _rewire_linear(pair.mm_a, a_in)
    _rewire_linear(pair.mm_b, b_in)
    for mul in pair.muls:
        out = mul.outputs[0]
        keep = next(v for v in mul.inputs if v is not None and _const(v) is None)
        replaced.extend(v for v in mul.inputs if v is not None and v is not keep)
        ir.convenience.replace_all_uses_with(out, keep)
        graph.remove(mul, safe=True)
    return replaced


def _drop_if_dead(graph: ir.Graph, value: ir.Value) -> None:
    """Remove a replaced constant (initializer, or Constant/Transpose chain) once nothing uses it."""
    if value.uses() or value.is_graph_output() or value.is_graph_input():
        return
    node = value.producer()
    if node is None:
        if value.name in graph.initializers and graph.initializers[value.name] is value:
            del graph.initializers[value.name]
        return
    if node.op_type not in ("Constant", "Transpose") or node.domain not in _DEFAULT or node.graph is not graph:
        return
    inputs = [v for v in node.inputs if v is not None]
    graph.remove(node, safe=True)
    for inner in inputs:
        _drop_if_dead(graph, inner)


def _nm(node: ir.Node, reason: str) -> NonMatch:
    return NonMatch(reason=reason, node=node.name, op_type=node.op_type)
