"""How a quantized model compares with the original: per-output accuracy, the pass's budget, and the ORT
runs (graph optimizations off) of the model files both quantization passes write.

Shared by the driver (``_quantization.py``) and the sensitivity ranking (``_sensitivity.py``); it imports
neither.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir


@dataclass
class OutputAccuracy:
    """How one output of the quantized model compares with the original's, worst over the samples."""

    max_abs: float = 0.0
    rel_l2: float = 0.0
    cosine: float = 1.0

    def to_dict(self) -> dict[str, float]:
        return {
            "max_abs": round_sig(self.max_abs),
            "rel_l2": round_sig(self.rel_l2),
            "cosine": round_sig(self.cosine, 8),
        }


def round_sig(x: float, digits: int = 4) -> float:
    if not math.isfinite(x) or x == 0:
        return float(x)
    return float(f"{x:.{digits}g}")


def compare_arrays(ref: np.ndarray, got: np.ndarray) -> OutputAccuracy:
    r = np.asarray(ref, dtype=np.float64).ravel()
    g = np.asarray(got, dtype=np.float64).ravel()
    if r.shape != g.shape:
        return OutputAccuracy(math.inf, math.inf, -1.0)
    if not r.size:
        return OutputAccuracy()
    diff = g - r
    if not np.all(np.isfinite(diff)):
        return OutputAccuracy(math.inf, math.inf, -1.0)
    nr, ng = float(np.linalg.norm(r)), float(np.linalg.norm(g))
    max_abs = float(np.abs(diff).max())
    rel = float(np.linalg.norm(diff)) / nr if nr else (0.0 if not ng else math.inf)
    cosine = float(np.dot(r, g)) / (nr * ng) if nr and ng else (1.0 if nr == ng else 0.0)
    return OutputAccuracy(max_abs, rel, cosine)


def worst(acc: Sequence[OutputAccuracy]) -> OutputAccuracy:
    return OutputAccuracy(
        max((a.max_abs for a in acc), default=0.0),
        max((a.rel_l2 for a in acc), default=0.0),
        min((a.cosine for a in acc), default=1.0),
    )


@dataclass
class Budget:
    min_cosine: float
    max_rel_error: float | None
    max_abs_error: float | None

    def misses(self, accuracy: dict[str, OutputAccuracy]) -> list[str]:
        """Why ``accuracy`` misses the budget, one line per failed output and criterion; empty when it holds."""
        problems = []
        for name, a in accuracy.items():
            if a.cosine < self.min_cosine:
                problems.append(f"{name}: cosine {a.cosine:.6f} < {self.min_cosine}")
            if self.max_rel_error is not None and a.rel_l2 > self.max_rel_error:
                problems.append(f"{name}: relative L2 error {a.rel_l2:.4g} > {self.max_rel_error}")
            if self.max_abs_error is not None and a.max_abs > self.max_abs_error:
                problems.append(f"{name}: max abs error {a.max_abs:.4g} > {self.max_abs_error}")
        return problems

    def to_dict(self) -> dict[str, Any]:
        return {"min_cosine": self.min_cosine, "max_rel_error": self.max_rel_error, "max_abs_error": self.max_abs_error}


def session(path: Path, threads: int = 0) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feeds_for(sess: Any, samples: Sequence[dict[str, np.ndarray]], limit: int) -> list[dict[str, np.ndarray]]:
    """The samples that give every input of ``sess``, restricted to its inputs, at most ``limit``."""
    names = [i.name for i in sess.get_inputs()]
    feeds = [{n: s[n] for n in names} for s in samples if all(n in s for n in names)]
    return feeds[:limit]


def float_outputs(sess: Any) -> list[str]:
    return [o.name for o in sess.get_outputs() if o.type in ("tensor(float)", "tensor(float16)", "tensor(double)")]


def run_outputs(path: Path, feeds: Sequence[dict[str, np.ndarray]], names: Sequence[str]) -> list[list[np.ndarray]]:
    sess = session(path)
    return [sess.run(list(names), f) for f in feeds]


def measure(
    path: Path, feeds: Sequence[dict[str, np.ndarray]], names: Sequence[str], reference: list[list[np.ndarray]]
) -> dict[str, OutputAccuracy]:
    """Per-output accuracy of the model at ``path`` against the reference outputs, worst over the feeds."""
    got = run_outputs(path, feeds, names)
    return {
        name: worst([compare_arrays(ref[i], out[i]) for ref, out in zip(reference, got, strict=True)])
        for i, name in enumerate(names)
    }


def save_proto(proto: onnx.ModelProto, path: Path, large: bool) -> None:
    if large:
        onnx.save_model(proto, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(proto, str(path))


def load_ir(path: Path) -> ir.Model:
    """Load a model with its external data into memory (the temporary directory is about to go)."""
    return ir.serde.deserialize_model(onnx.load(str(path), load_external_data=True))
