"""Helpers of the upstream_slice tests (``test_upstream_slice.py``, ``test_upstream_slice_driver.py``): run the
pass on a fresh IR copy, find nodes, and compare with the original under ORT with graph optimizations off."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from passes._infra import PassResult
from passes.compute_order.upstream_slice import UpstreamSlice
from tests.numerics import to_proto

TOL = {"rtol": 1e-4, "atol": 1e-4}
MODELS = Path(__file__).resolve().parents[1] / "models"


def optimize(proto: onnx.ModelProto) -> tuple[ir.Model, PassResult]:
    model = ir.serde.deserialize_model(proto)  # a fresh IR copy: the pass is in place
    result = UpstreamSlice()(model)
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    unread = [name for name, v in model.graph.initializers.items() if not list(v.uses())]
    assert not unread, f"initializers left behind: {unread}"  # our shapes agree with ONNX's
    return model, result


def named(model: ir.Model, name: str) -> ir.Node:
    (found,) = [n for n in model.graph if n.name == name]
    return found


def ops_of(model: ir.Model, op: str) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == op]


def producer_of(value: ir.Value | None) -> ir.Node:
    assert value is not None and value.producer() is not None
    return value.producer()


def dims_of(value: ir.Value) -> list:
    return [d if isinstance(d, int) else d.value for d in value.shape]


def assert_same_feeds(
    original: onnx.ModelProto, optimized: ir.Model, feeds: Sequence[Mapping[str, np.ndarray]]
) -> None:
    """Explicit feeds, for inputs whose values must stay in range (GatherND positions)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sessions = [
        ort.InferenceSession(to_proto(m).SerializeToString(), options, providers=["CPUExecutionProvider"])
        for m in (original, optimized)
    ]
    for feed in feeds:
        expected, got = (s.run(None, dict(feed)) for s in sessions)
        for e, g in zip(expected, got, strict=True):
            assert e.shape == g.shape
            np.testing.assert_allclose(g, e, **TOL)


def assert_unchanged(proto: onnx.ModelProto) -> PassResult:
    model, result = optimize(proto)
    assert not result.modified
    assert [n.op_type for n in model.graph] == [n.op_type for n in proto.graph.node]
    return result
