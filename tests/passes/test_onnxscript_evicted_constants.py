"""fuse_for_ort never hands on a graph that reads an evicted initializer (issue 17, LeViT's dynamo export).

onnxscript 0.7.2's rewriter registers a rule's new initializer under its name even when that name is taken,
unregistering the one there while other nodes still read it; its ``ReshapeReshape`` names the collapsed
shape ``<output>/shape``. The smallest graph that shows it: ``Reshape(Reshape(x))`` producing ``y`` beside
another Reshape that reads an initializer already called ``y/shape``. On LeViT (after upstream_reshape) the
first collapse made ``y/shape`` and a later optimizer round collapsed onto ``y`` again: the fused candidate
read a value nothing produced and was refused (0/5 attentions).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from passes._dangling import dangling_values
from passes.fusion._onnxscript_adapter import fuse_for_ort
from tests.passes._ort_cases import F, build, node


def _graph():
    nodes = [
        node("Reshape", ["x", "s1"], "m", "r1"),
        node("Reshape", ["m", "flat"], "y", "r2"),
        node("Relu", ["y"], "out", "relu"),
        node("Reshape", ["z", "y/shape"], "w", "other"),
    ]
    inits = {
        "s1": np.array([2, -1, 8], np.int64),
        "flat": np.array([-1, 8], np.int64),
        "y/shape": np.array([-1, 8], np.int64),
    }
    return build(nodes, {"x": (F, ["a", 8]), "z": (F, ["k", 16])}, {"out": F, "w": F}, inits)


def _run(proto, feed):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feed)


def test_an_initializer_evicted_by_a_collapse_is_registered_again():
    proto = _graph()
    model = ir.serde.deserialize_model(_graph())  # its own protos: renaming an initializer renames the proto's tensor
    counts = fuse_for_ort(model)
    assert not dangling_values(model.graph)
    assert counts["constants_reattached"] == 1  # the collapse's y/shape evicted the one "other" reads
    (other,) = [n for n in model.graph if n.name == "other"]
    assert other.inputs[1].is_initializer() and other.inputs[1].const_value.numpy().tolist() == [-1, 8]
    assert sum(n.op_type == "Reshape" for n in model.graph) == 2  # the chain did collapse
    fused = ir.serde.serialize_model(model)
    rng = np.random.default_rng(0)
    for a, k in ((6, 3), (10, 5), (2, 1)):
        feed = {"x": rng.standard_normal((a, 8), dtype=np.float32), "z": rng.standard_normal((k, 16), dtype=np.float32)}
        for got, expected in zip(_run(fused, feed), _run(proto, feed), strict=True):
            np.testing.assert_array_equal(got, expected)
