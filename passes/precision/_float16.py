"""Shared machinery of ``float16`` and ``mixed_precision``: the fp32 -> fp16 rewrite and the numerics probe.

The rewrite re-implements what onnxconverter-common's ``convert_float_to_float16`` (and ORT's
``transformers.float16``) do, on onnx-ir and with the decisions spelled out, so that a caller can name the
nodes to keep in float32 and get back the list of nodes converted and the reason each other one was not:

* a node is converted when its op has a float16 form in the table below (standard ops whose float inputs
  and outputs share one type ``T``, plus ORT's transformer contrib ops), no input or output type is unknown,
  it carries no subgraph, and neither ``op_block_list`` nor ``node_block_list`` names it;
* float32 initializers and ``Constant`` values read only by converted nodes become float16 in place; one
  read by both kinds gets a float16 copy;
* where a float32 value meets a converted node (or a float16 value meets a float32 node) a ``Cast`` is
  inserted once per value and direction, right after the producer;
* ``keep_io_types``: graph inputs stay float32 (cast in) and float16 graph outputs are cast back to
  float32 under their original names, so callers feed and read what they did before.

::

    x(f32) --MatMul(W)--Add(b)--Exp--> y(f32)
    ==>  x(f32) --Cast(f16)--MatMul(W16)--Add(b16)--Exp--Cast(f32)--> y(f32)

``fp32_activation_ranges`` runs the float32 model once with every float intermediate exposed, to find the
values that overflow float16 (|x| > 65504): the first nodes ``mixed_precision`` keeps in float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from passes._infra import NonMatch, PassResult

FP16_MAX = 65504.0
FLOAT, FLOAT16 = ir.DataType.FLOAT, ir.DataType.FLOAT16

# Ops whose float inputs and outputs share one type T (or whose other inputs are ints/bools), so the node
# is valid with every float input and output in float16. Anything else stays float32.
_STANDARD = frozenset(
    [
        "Abs",
        "Add",
        "AveragePool",
        "BatchNormalization",
        "Ceil",
        "Clip",
        "Concat",
        "Conv",
        "ConvTranspose",
        "Cos",
        "DepthToSpace",
        "Div",
        "Einsum",
        "Elu",
        "Erf",
        "Exp",
        "Expand",
        "Flatten",
        "Floor",
        "Gather",
        "GatherElements",
        "GatherND",
        "Gelu",
        "Gemm",
        "GlobalAveragePool",
        "GlobalMaxPool",
        "HardSigmoid",
        "HardSwish",
        "Identity",
        "InstanceNormalization",
        "LayerNormalization",
        "LeakyRelu",
        "Log",
        "LogSoftmax",
        "MatMul",
        "Max",
        "MaxPool",
        "Mean",
        "Min",
        "Mish",
        "Mul",
        "Neg",
        "Pad",
        "Pow",
        "PRelu",
        "Reciprocal",
        "ReduceMax",
        "ReduceMean",
        "ReduceMin",
        "ReduceSum",
        "Relu",
        "Reshape",
        "Selu",
        "Sigmoid",
        "Sign",
        "Sin",
        "Slice",
        "Softmax",
        "Softplus",
        "SpaceToDepth",
        "Split",
        "Sqrt",
        "Squeeze",
        "Sub",
        "Sum",
        "Tanh",
        "Tile",
        "Transpose",
        "Unsqueeze",
        "Where",
        "Equal",
        "Greater",
        "GreaterOrEqual",
        "Less",
        "LessOrEqual",
        "SimplifiedLayerNormalization",
    ]
)
_CONTRIB = frozenset(
    [
        "Attention",
        "MultiHeadAttention",
        "SkipLayerNormalization",
        "SkipSimplifiedLayerNormalization",
        "BiasGelu",
        "FastGelu",
        "Gelu",
        "QuickGelu",
        "BiasAdd",
        "BiasSplitGelu",
        "RotaryEmbedding",
        "EmbedLayerNormalization",
    ]
)
_COMPARISONS = frozenset({"Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual"})
# Consumers that accept any input type: no Cast is inserted in front of them.
_ANY_INPUT = frozenset({"Shape", "Size", "Cast", "CastLike"})


def convertible_op(node: ir.Node) -> bool:
    if node.domain in ("", "ai.onnx"):
        return node.op_type in _STANDARD
    return node.domain == "com.microsoft" and node.op_type in _CONTRIB


@dataclasses.dataclass
class Conversion:
    converted: list[str]  # node names (or op_type#index when unnamed) now computing in float16
    kept: dict[str, str]  # node -> why it stays float32 (float nodes only)
    casts_added: int = 0
    initializers_converted: int = 0


def node_label(node: ir.Node, index: int) -> str:
    return node.name or f"{node.op_type}#{index}"


def _propagate_types(graph: ir.Graph) -> None:
    """Fill in unknown output types of table ops (contrib ops escape ONNX shape inference): same as input T."""
    for node in graph:
        if not convertible_op(node):
            continue
        floats = [v.dtype for v in node.inputs if v is not None and v.dtype in (FLOAT, FLOAT16)]
        for out in node.outputs:
            if out.type is None and floats:
                out.dtype = ir.DataType.BOOL if node.op_type in _COMPARISONS else floats[0]


def float_nodes(model: ir.Model) -> list[tuple[str, ir.Node]]:
    """(label, node) of every top-level node reading or writing a float32 tensor, in graph order."""
    out = []
    for i, node in enumerate(model.graph):
        if node.domain in ("", "ai.onnx") and (node.op_type == "Constant" or node.op_type in _ANY_INPUT):
            continue  # constants follow their readers; Shape/Size/Cast read any type
        values = [*node.inputs, *node.outputs]
        if any(v is not None and v.dtype == FLOAT for v in values):
            out.append((node_label(node, i), node))
    return out


def _decide(
    model: ir.Model, op_block: set[str], node_block: set[str]
) -> tuple[set[ir.Node], dict[str, str], list[str]]:
    to_fp16: set[ir.Node] = set()
    kept: dict[str, str] = {}
    converted: list[str] = []
    for label, node in float_nodes(model):
        values = [v for v in (*node.inputs, *node.outputs) if v is not None]
        if node.op_type in op_block:
            kept[label] = f"op type {node.op_type} is in op_block_list"
        elif label in node_block or node.name in node_block:
            kept[label] = "named in node_block_list"
        elif not convertible_op(node):
            kept[label] = f"{node.domain + '::' if node.domain else ''}{node.op_type} has no float16 rule here"
        elif any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            kept[label] = "carries a subgraph"
        elif any(v.type is None for v in values):
            kept[label] = "an input or output has no known element type"
        elif node.op_type == "LayerNormalization" and len(node.outputs) > 1:
            kept[label] = "LayerNormalization with mean/inv_std_dev outputs"
        else:
            to_fp16.add(node)
            converted.append(label)
    return to_fp16, kept, converted


def _cast_node(value: ir.Value, to: ir.DataType, name: str) -> ir.Node:
    out = ir.Value(name=name, type=ir.TensorType(to), shape=value.shape)
    return ir.node("Cast", [value], attributes={"to": int(to)}, outputs=[out], name=f"{name}_node")


def convert(
    model: ir.Model,
    *,
    keep_io_types: bool = True,
    op_block_list: Iterable[str] = (),
    node_block_list: Iterable[str] = (),
) -> Conversion:
    """Convert ``model`` (typed: run shape inference first) to float16 in place; see the module docstring."""
    graph = model.graph
    _propagate_types(graph)
    to_fp16, kept, converted = _decide(model, set(op_block_list), set(node_block_list))
    result = Conversion(converted, kept)
    if not to_fp16:
        return result
    originally_float = {id(v) for n in graph for v in (*n.inputs, *n.outputs) if v is not None and v.dtype == FLOAT}
    originally_float |= {id(v) for v in graph.inputs if v.dtype == FLOAT}
    graph_outputs = set(graph.outputs)

    def wants(node: ir.Node, value: ir.Value) -> ir.DataType | None:
        if id(value) not in originally_float or node.op_type in _ANY_INPUT:
            return None
        return FLOAT16 if node in to_fp16 else FLOAT

    # 1. Outputs of converted nodes become float16.
    for node in to_fp16:
        for out in node.outputs:
            if id(out) in originally_float:
                out.dtype = FLOAT16
    # 2. Constants (initializers, Constant nodes) read only by converted nodes become float16 in place.
    fp16_copies: dict[int, ir.Value] = {}
    for value in list(graph.initializers.values()):
        if id(value) not in originally_float and value.dtype != FLOAT:
            continue
        if value.const_value is None or value in graph_outputs or value in graph.inputs:
            continue
        users = [u.node for u in value.uses()]
        want = {wants(n, value) for n in users} - {None}
        if want == {FLOAT16}:
            value.const_value = ir.tensor(value.const_value.numpy().astype(np.float16), name=value.name)
            value.dtype = FLOAT16
            result.initializers_converted += 1
        elif FLOAT16 in want:
            copy = ir.Value(name=f"{value.name}_fp16", type=ir.TensorType(FLOAT16), shape=value.shape)
            copy.const_value = ir.tensor(value.const_value.numpy().astype(np.float16), name=copy.name)
            graph.register_initializer(copy)
            fp16_copies[id(value)] = copy
            result.initializers_converted += 1
    for node in list(graph):
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            continue
        out = node.outputs[0]
        attr = node.attributes.get("value")
        if out.dtype != FLOAT or attr is None or out in graph_outputs:
            continue
        users = [u.node for u in out.uses()]
        if users and all(n in to_fp16 for n in users):
            array = attr.as_tensor().numpy().astype(np.float16)
            node.attributes["value"] = ir.AttrTensor("value", ir.tensor(array))
            out.dtype = FLOAT16
            result.initializers_converted += 1
    # Casts from another type to float32 read only by converted nodes cast to float16 directly.
    for node in list(graph):
        if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or node.outputs[0] in graph_outputs:
            continue
        out = node.outputs[0]
        users = [u.node for u in out.uses()]
        if out.dtype == FLOAT and users and all(n in to_fp16 for n in users):
            node.attributes["to"] = ir.AttrInt64("to", int(FLOAT16))
            out.dtype = FLOAT16
    # 3. Graph inputs: cast in (keep_io_types) or become float16 when every reader is converted.
    if not keep_io_types:
        for value in graph.inputs:
            if value.dtype == FLOAT and value.uses() and all(u.node in to_fp16 for u in value.uses()):
                value.dtype = FLOAT16
    # 4. Casts where a value's type differs from what its reader now wants.
    casts: dict[tuple[int, ir.DataType], ir.Value] = {}
    first = next(iter(graph), None)
    for node in list(graph):
        for idx, value in enumerate(node.inputs):
            if value is None:
                continue
            want = wants(node, value)
            if want is None or value.dtype == want:
                continue
            if want == FLOAT16 and id(value) in fp16_copies:
                node.replace_input_with(idx, fp16_copies[id(value)])
                continue
            key = (id(value), want)
            if key not in casts:
                suffix = "fp16" if want == FLOAT16 else "fp32"
                cast = _cast_node(value, want, f"{value.name}_cast_{suffix}")
                producer = value.producer()
                if producer is not None:
                    graph.insert_after(producer, cast)
                else:
                    graph.insert_before(first, cast) if first is not None else graph.append(cast)
                casts[key] = cast.outputs[0]
                result.casts_added += 1
            node.replace_input_with(idx, casts[key])
    # 5. Graph outputs now float16: cast back under the original name (keep_io_types).
    if keep_io_types:
        for i, value in enumerate(list(graph.outputs)):
            if value.dtype != FLOAT16 or id(value) not in originally_float:
                continue
            name = value.name
            value.name = f"{name}_fp16"
            cast = _cast_node(value, FLOAT, name or "output")
            producer = value.producer()
            if producer is not None:
                graph.insert_after(producer, cast)
            else:
                graph.append(cast)
            graph.outputs[i] = cast.outputs[0]
            result.casts_added += 1
    return result


def infer_types(model: ir.Model, ctx: Any) -> None:
    """ONNX shape inference onto ``model``, keeping the declared shapes of graph inputs and outputs."""
    from passes.cleanup.shape_inference import ShapeInference

    declared = {id(v): v.shape for v in (*model.graph.inputs, *model.graph.outputs)}
    ShapeInference()(model, ctx)
    for value in (*model.graph.inputs, *model.graph.outputs):
        value.shape = declared.get(id(value), value.shape)


# ------------------------------------------------------------------------------------------ numerics


def session(proto: onnx.ModelProto, providers: Sequence[str]) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), sess_options=options, providers=list(providers))


def providers(target: str) -> list[str]:
    import onnxruntime as ort

    wanted = {
        "cpu": ["CPUExecutionProvider"],
        "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
        "tensorrt": ["CUDAExecutionProvider", "CPUExecutionProvider"],  # verify the graph, not TRT's engine
    }[target]
    available = set(ort.get_available_providers())
    return [p for p in wanted if p in available] or ["CPUExecutionProvider"]


def sample_feeds(model: ir.Model, samples: Sequence[dict[str, np.ndarray]], limit: int = 3) -> list[dict[str, Any]]:
    """The context's samples, else one generated set (dims: 1 for unknown/symbolic, normal floats)."""
    if samples:
        return [dict(s) for s in samples[:limit]]
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.inputs:
        if value.name in model.graph.initializers:
            continue
        dims = [d if isinstance(d, int) else 1 for d in (value.shape or [])]
        dtype = value.dtype.numpy() if value.dtype is not None else np.float32
        if np.issubdtype(dtype, np.floating):
            feeds[value.name or ""] = rng.standard_normal(dims).astype(dtype)
        else:
            feeds[value.name or ""] = np.zeros(dims, dtype=dtype)
    return [feeds]


def run(proto: onnx.ModelProto, feeds: Sequence[dict[str, Any]], target: str) -> list[list[np.ndarray]]:
    sess = session(proto, providers(target))
    names = {i.name for i in sess.get_inputs()}
    return [sess.run(None, {k: v for k, v in f.items() if k in names}) for f in feeds]


def fp32_activation_ranges(model: ir.Model, feeds: Sequence[dict[str, Any]], target: str) -> dict[str, float]:
    """Largest |value| of every float32 value (by name) over the feeds, from one run of the float model."""
    probe = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    present = {v.name for v in probe.graph.outputs}
    extra = []
    for node in probe.graph:
        for out in node.outputs:
            if out.dtype == FLOAT and out.name not in present:
                probe.graph.outputs.append(out)
                extra.append(out.name)
                present.add(out.name)
    proto = ir.serde.serialize_model(probe)
    names = [o.name for o in probe.graph.outputs]
    ranges: dict[str, float] = {}
    for values in run(proto, feeds, target):
        for name, array in zip(names, values, strict=True):
            arr = np.asarray(array)
            if arr.dtype.kind == "f" and arr.size:
                finite = arr[np.isfinite(arr)]
                peak = float(np.abs(finite).max()) if finite.size else 0.0
                ranges[name or ""] = max(ranges.get(name or "", 0.0), peak)
    for value in model.graph.inputs:
        for f in feeds:
            arr = f.get(value.name or "")
            if arr is not None and np.asarray(arr).dtype.kind == "f" and np.asarray(arr).size:
                ranges[value.name or ""] = max(ranges.get(value.name or "", 0.0), float(np.abs(arr).max()))
    return ranges


@dataclasses.dataclass
class Accuracy:
    ok: bool
    reason: str | None
    max_abs: float
    min_cosine: float


def accuracy(
    ref: Sequence[Sequence[np.ndarray]],
    got: Sequence[Sequence[np.ndarray]],
    atol: float,
    rtol: float,
    min_cosine: float,
) -> Accuracy:
    worst_abs, worst_cos, reason = 0.0, 1.0, None
    for r_set, g_set in zip(ref, got, strict=True):
        for i, (r, g) in enumerate(zip(r_set, g_set, strict=True)):
            r64, g64 = np.asarray(r, np.float64), np.asarray(g, np.float64)
            if r64.shape != g64.shape:
                return Accuracy(False, f"output {i}: shape {g64.shape} instead of {r64.shape}", float("inf"), -1.0)
            if np.isfinite(g64).sum() != np.isfinite(r64).sum():
                return Accuracy(False, f"output {i}: NaN/Inf appear (float16 overflow)", float("inf"), -1.0)
            both = np.isfinite(r64) & np.isfinite(g64)
            if not both.any():
                continue
            diff = np.abs(r64[both] - g64[both])
            worst_abs = max(worst_abs, float(diff.max()))
            if not np.all(diff <= atol + rtol * np.abs(r64[both])) and reason is None:
                reason = f"output {i}: max abs error {float(diff.max()):.3g} outside atol={atol:g} rtol={rtol:g}"
            a, b = r64[both].ravel(), g64[both].ravel()
            na, nb = np.linalg.norm(a), np.linalg.norm(b)
            cos = 1.0 if na == nb == 0 else (0.0 if na == 0 or nb == 0 else float(np.dot(a, b) / (na * nb)))
            worst_cos = min(worst_cos, cos)
            if a.size > 1 and cos < min_cosine and reason is None:
                reason = f"output {i}: cosine {cos:.6f} < {min_cosine}"
    return Accuracy(reason is None, reason, worst_abs, worst_cos)


def refused(model: ir.Model, reason: str) -> PassResult:
    """A float16 pass's answer when it will not convert this model (a cpu target unforced, an unknown node)."""
    return PassResult(model, False, {"nodes_fp16": 0}, [NonMatch(reason)], {"decision": "refused"})
