"""Output adapters: the ZipMap a scikit-learn classifier ends in, taken off for the job and put back after it.

skl2onnx ends every classifier it converts with default options in ``ai.onnx.ml.ZipMap``: the probabilities
tensor becomes a sequence of maps (class label -> probability), one map per row. onnx-ir, the graph library
every pass works on, has no map type, and the verifier compares tensors. ZipMap has no weights and computes
nothing a pass could change (it relabels the tensor's columns), so the job runs on the upload with each
trailing ZipMap removed and the tensor it read made the graph output in its place (``detach``); the model it
hands back gets the same ZipMap nodes and the upload's outputs again (``reattach``), and ``check_reattached``
runs both on one input set to prove the maps equal. Verification and timing therefore see the probabilities
themselves, which is a stricter comparison than the maps, and time the graph without the (fixed) ZipMap.

Only a ZipMap whose output is a graph output read by nothing else is detached; any other map-typed value
(DictVectorizer's input, a ZipMap inside the graph) still refuses the model (``workers.artifacts``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx

from core.config import Tolerance
from core.errors import VerificationError

ML_DOMAIN = "ai.onnx.ml"
_Message = TypeVar("_Message", onnx.NodeProto, onnx.ValueInfoProto)


@dataclasses.dataclass(frozen=True)
class DetachedOutputs:
    """What ``detach`` took off: the ZipMap nodes and the upload's outputs, in order."""

    nodes: tuple[onnx.NodeProto, ...]
    outputs: tuple[onnx.ValueInfoProto, ...]
    ml_opset: int

    @property
    def tensors(self) -> dict[str, str]:
        """ZipMap output -> the probabilities tensor it reads (a graph output while the job runs)."""
        return {n.output[0]: n.input[0] for n in self.nodes}

    def note(self) -> str:
        pairs = ", ".join(f"{out!r} (from {tensor!r})" for out, tensor in self.tensors.items())
        return (
            f"ZipMap output {pairs} taken off while the passes ran (onnx-ir has no map type): verification and "
            "timing compared the probabilities tensor it reads; the model handed back ends in the same ZipMap, "
            "its maps checked equal to the upload's"
        )


def count_zipmaps(histogram: Counter[str], taken: DetachedOutputs | None) -> Counter[str]:
    """``histogram`` (``op_histogram`` of a model without its trailing ZipMaps) with them counted back in."""
    if taken is not None:
        histogram[f"{ML_DOMAIN}::ZipMap"] += len(taken.nodes)
    return histogram


def detach(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, DetachedOutputs | None]:
    """``proto`` with every trailing ZipMap taken off (a copy), and what was taken; ``(proto, None)`` if none."""
    graph = proto.graph
    outputs = {o.name for o in graph.output}
    read = {name for node in graph.node for name in node.input}
    zipmaps = [
        n
        for n in graph.node
        if n.op_type == "ZipMap" and n.domain == ML_DOMAIN and n.output[0] in outputs and n.output[0] not in read
    ]
    if not zipmaps:
        return proto, None
    opset = next((o.version for o in proto.opset_import if o.domain == ML_DOMAIN), 1)
    taken = DetachedOutputs(tuple(_copy(n) for n in zipmaps), tuple(_copy(o) for o in graph.output), opset)
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    tensors = taken.tensors
    kept_nodes = [n for n in out.graph.node if not (n.op_type == "ZipMap" and n.output[0] in tensors)]
    del out.graph.node[:]
    out.graph.node.extend(kept_nodes)
    new_outputs: list[onnx.ValueInfoProto] = []
    for value in taken.outputs:
        name = tensors.get(value.name)
        if name is None:
            new_outputs.append(_copy(value))
        elif name not in outputs and all(v.name != name for v in new_outputs):
            # ZipMap takes float probabilities [N, C] (ai.onnx.ml spec); the row count stays free
            new_outputs.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [None, None]))
    del out.graph.output[:]
    out.graph.output.extend(new_outputs)
    return out, taken


def reattach(path: Path, taken: DetachedOutputs) -> None:
    """Put the ZipMap nodes and the upload's outputs back on the model at ``path`` (rewritten in place; its
    external weights, if any, stay where they are)."""
    proto = onnx.load(str(path), load_external_data=False)
    current = {o.name: o for o in proto.graph.output}
    tensors = taken.tensors
    missing = [t for t in tensors.values() if t not in current]
    if missing:
        raise VerificationError(f"the optimized model no longer outputs {missing}, which the upload's ZipMap reads")
    proto.graph.node.extend(_copy(n) for n in taken.nodes)
    restored = [_copy(v) if v.name in tensors else _copy(current.get(v.name, v)) for v in taken.outputs]
    del proto.graph.output[:]
    proto.graph.output.extend(restored)
    if all(o.domain != ML_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid(ML_DOMAIN, taken.ml_opset))
    onnx.save(proto, str(path))


def check_reattached(upload: Path, returned: Path, feeds: dict[str, np.ndarray], tolerance: Tolerance) -> None:
    """Both models on ``feeds`` (ORT's optimizations off): each ZipMap output's maps have the same keys in every
    row and values within ``tolerance``. VerificationError when not."""
    import onnxruntime as ort

    def run(path: Path) -> dict[str, Any]:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(None, feeds), strict=True))

    want, got = run(upload), run(returned)
    for name in [n for n, v in want.items() if isinstance(v, list) and n in got]:  # the sequences of maps
        rows_want, rows_got = want[name], got[name]
        if len(rows_want) != len(rows_got) or any(set(a) != set(b) for a, b in zip(rows_want, rows_got, strict=True)):
            raise VerificationError(f"ZipMap output {name!r}: the optimized model's maps have other rows or keys")
        keys = sorted(rows_want[0]) if rows_want else []
        a = np.array([[row[k] for k in keys] for row in rows_want], dtype=np.float64)
        b = np.array([[row[k] for k in keys] for row in rows_got], dtype=np.float64)
        if not np.allclose(b, a, atol=tolerance.atol, rtol=tolerance.rtol):
            worst = float(np.max(np.abs(a - b))) if a.size else 0.0
            raise VerificationError(f"ZipMap output {name!r}: the maps differ from the upload's by up to {worst:.3g}")


def _copy(message: _Message) -> _Message:
    out = type(message)()
    out.CopyFrom(message)
    return out
