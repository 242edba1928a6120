"""upstream_reshape followed by fuse_transformer, as in the ``fast`` preset (issue 17, LeViT's dynamo export).

upstream_reshape used to put its flatten on a merged-heads Reshape, leaving ``Reshape(Reshape(x))`` chains;
onnxscript 0.7.2 collapses each chain into an initializer named ``<output>/shape`` once per optimizer
round, and the second collapse on one output re-registers that name, evicting the initializer other
Reshapes still read: the onnxscript candidate referred to a value nothing produced and was refused (0/5
attentions fused). The copies now read the source of a Reshape they land on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from passes._dangling import dangling_values
from passes._infra import PassContext
from passes.compute_order.upstream_reshape import UpstreamReshape
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._ort_cases import F, build, node

LEVIT = Path(__file__).resolve().parents[1] / "models" / "levit_tiny_dynamo.onnx"


def _run(proto: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def test_levit_attentions_fuse_after_upstream_reshape():
    """Tiny LeViT (tests/models/build_levit_tiny.py, 5 attentions): every attention fuses after the flattens
    moved, the graph handed on has no dangling value, and the result matches the export at batches 1, 2, 5."""
    proto = onnx.load(str(LEVIT))
    softmaxes = sum(n.op_type == "Softmax" for n in proto.graph.node)
    model = ir.serde.deserialize_model(proto)
    moved = UpstreamReshape()(model)
    assert moved.counts["reshapes_moved"] > 0
    assert not dangling_values(model.graph)
    chains = [
        n.name
        for n in model.graph
        if n.op_type == "Reshape" and (p := n.inputs[0].producer()) is not None and p.op_type == "Reshape"
    ]
    result = FuseTransformer({"pack_qkv": True})(model, PassContext())
    assert not dangling_values(result.model.graph)
    assert result.counts.get("fused_attention") == softmaxes == 5, result.notes.get("reason")
    fused = ir.serde.serialize_model(result.model)
    assert not any(n.op_type == "Softmax" for n in fused.graph.node)
    rng = np.random.default_rng(1)
    for batch in (1, 2, 5):
        feed = {"pixel_values": rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)}
        (expected,), (got,) = _run(proto, feed), _run(fused, feed)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert not chains, f"Reshape(Reshape) chains handed on: {chains}"


def test_copy_on_a_reshape_reads_its_source_and_keeps_it_for_other_readers():
    """x[2,6,8] -Reshape[2,3,16]- r -Add(bias)- a -Reshape[-1,16]- Identity: the copy above Add flattens x itself;
    a second reader of r (Sigmoid, an output) keeps the first Reshape alive."""
    nodes = [
        node("Reshape", ["x", "s3"], "r", "merge"),
        node("Add", ["r", "bias"], "a", "add"),
        node("Reshape", ["a", "flat"], "f", "flatten"),
        node("Identity", ["f"], "y", "identity"),
        node("Sigmoid", ["r"], "z", "side"),
    ]
    inits = {
        "s3": np.array([2, 3, 16], np.int64),
        "flat": np.array([-1, 16], np.int64),
        "bias": np.linspace(-1, 1, 16, dtype=np.float32),
    }
    proto = build(nodes, {"x": (F, [2, 6, 8])}, {"y": F, "z": F}, inits, 17)
    model = ir.serde.deserialize_model(proto)
    assert UpstreamReshape()(model).counts["ops_crossed"] == 1
    (add,) = [n for n in model.graph if n.op_type == "Add"]
    copy = add.inputs[0].producer()
    assert copy.op_type == "Reshape" and copy.inputs[0].name == "x"
    assert [n.name for n in model.graph if n.op_type == "Reshape"].count("merge") == 1  # Sigmoid still reads it
    assert not dangling_values(model.graph)
    feed = {"x": np.random.default_rng(0).standard_normal((2, 6, 8), dtype=np.float32)}
    for got, expected in zip(_run(ir.serde.serialize_model(model), feed), _run(proto, feed), strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=0)
