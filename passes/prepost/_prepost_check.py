"""The prepost pass's verification harness: sessions on the original and the artifact, and the numpy
reference of the post chain."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from passes.prepost._prepost_options import PoolPost, TopKPost


class Runner:
    """ORT sessions on the original and the artifact; the artifact's with the extensions library registered
    from the installed package's allow-listed path (never a path named by a model)."""

    def __init__(self, original: Path, artifact: Path, library: str, target: str) -> None:
        import onnxruntime as ort

        def options() -> Any:
            o = ort.SessionOptions()
            o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            o.log_severity_level = 3
            o.intra_op_num_threads = int(os.environ.get("ONNXFORGE_PREPOST_THREADS", "0") or 0)
            return o

        providers = ["CPUExecutionProvider"]  # raw-input graphs decode and tokenize on the CPU anyway
        self.original = ort.InferenceSession(str(original), options(), providers=providers)
        artifact_options = options()
        artifact_options.register_custom_ops_library(library)
        self.artifact = ort.InferenceSession(str(artifact), artifact_options, providers=providers)
        self.library = library
        self.original_outputs = [o.name for o in self.original.get_outputs()]
        self.artifact_outputs = [o.name for o in self.artifact.get_outputs()]
        self.original_inputs = {i.name: i for i in self.original.get_inputs()}

    def session(self, proto: onnx.ModelProto) -> Any:
        import onnxruntime as ort

        o = ort.SessionOptions()
        o.log_severity_level = 3
        o.register_custom_ops_library(self.library)
        return ort.InferenceSession(proto.SerializeToString(), o, providers=["CPUExecutionProvider"])


# ------------------------------------------------------------------------------------ numpy reference


def apply_post(post: list[Any], values: list[np.ndarray], chosen: int, mask: np.ndarray | None) -> list[np.ndarray]:
    """The post chain in numpy on the original's outputs; no chain: the outputs themselves."""
    if not post:
        return values
    x = values[chosen]
    result: list[np.ndarray] = []
    for item in post:
        if item == "softmax":
            e = np.exp(x - x.max(axis=-1, keepdims=True))
            x = e / e.sum(axis=-1, keepdims=True)
        elif item == "argmax":
            x = np.argmax(x, axis=-1).astype(np.int64)
        elif item == "l2norm":
            x = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
        elif isinstance(item, TopKPost):
            order = np.argsort(-x, axis=-1, kind="stable")[..., : item.topk]
            return [np.take_along_axis(x, order, axis=-1), order.astype(np.int64)]
        elif isinstance(item, PoolPost):
            assert mask is not None
            m = mask.astype(x.dtype)[..., None]
            x = (x * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    result.append(np.asarray(x))
    return result


def compare(expected: list[np.ndarray], got: list[np.ndarray], atol: float, exact: bool) -> dict[str, Any]:
    """Max abs difference of float outputs; integer outputs must be equal (reported only when lossy)."""
    max_abs, ints_equal, problems = 0.0, True, []
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        e, g = np.asarray(want), np.asarray(have)
        if e.shape != g.shape:
            problems.append(f"output {i}: shape {list(g.shape)} instead of {list(e.shape)}")
            continue
        if e.dtype.kind == "f":
            if e.size:
                max_abs = max(max_abs, float(np.max(np.abs(e.astype(np.float64) - g.astype(np.float64)))))
        elif not np.array_equal(e, g):
            ints_equal = False
    ok = not problems and max_abs <= atol and (ints_equal or not exact)
    return {"max_abs": max_abs, "integers_equal": ints_equal, "ok": ok, "problems": problems}
