"""``Pass.__call__`` refuses a result that reads a value nothing defines (passes/_dangling.py).

The way LeViT's fused candidate lost one (issue 17): an initializer re-registered under a name already taken
(onnxscript 0.7.2's rewriter does this when two rewrites name a new initializer alike) evicts the first one
while other nodes still read it. ``ir.Value`` keeps its name, so the serialized model still names it and only
ORT, stages later, notices.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from core.errors import PassError
from passes._dangling import dangling_values
from passes._infra import Pass, PassContext, PassOptions, PassResult
from tests.passes._ort_cases import F, build, node


def _model() -> ir.Model:
    """x -Reshape(s)- a, x -Reshape(s)- b: two readers of one shape initializer."""
    inits = {"s": np.array([-1, 4], np.int64)}
    proto = build(
        [node("Reshape", ["x", "s"], "a", "ra"), node("Reshape", ["x", "s"], "b", "rb")],
        {"x": (F, [2, 2, 4])},
        {"a": F, "b": F},
        inits,
    )
    return ir.serde.deserialize_model(proto)


class _Evict(Pass[PassOptions]):
    """Registers a new initializer under the name of one in use, as onnxscript's rewriter does."""

    name = "evict_for_test"
    summary = "test pass"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        (ra,) = [n for n in model.graph if n.name == "ra"]
        fresh = ir.val("s", const_value=ir.tensor(np.array([4, -1], np.int64)))
        model.graph.initializers["s"] = fresh  # evicts the old "s", which rb still reads
        ra.replace_input_with(1, fresh)
        return PassResult(model, modified=True)


class _Touch(Pass[PassOptions]):
    name = "touch_for_test"
    summary = "test pass"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        return PassResult(model, modified=False)


def test_a_pass_that_evicts_a_read_initializer_is_refused_naming_the_reader():
    model = _model()
    assert not dangling_values(model.graph)
    with pytest.raises(PassError, match=r"values nothing defines: rb reads 's'") as info:
        _Evict()(model)
    assert info.value.pass_name == "evict_for_test"


def test_a_graph_that_came_in_dangling_is_not_the_pass_s_doing():
    model = _model()
    model.graph.initializers.pop("s")  # both Reshapes now read a value nothing defines
    assert dangling_values(model.graph) == ["ra reads 's'", "rb reads 's'"]
    assert _Touch()(model).model is model


def test_outer_scope_reads_from_a_subgraph_are_defined_and_a_removed_producer_is_not():
    """If branches reading the outer x and s define nothing missing; a node whose producer was removed is
    reported."""
    model = _model()
    graph = model.graph
    x, s = graph.inputs[0], graph.initializers["s"]
    branches = {}
    for name in ("then_branch", "else_branch"):
        inner = ir.node("Reshape", [x, s])
        branches[name] = ir.Graph([], [inner.outputs[0]], nodes=[inner], name=name)
    cond = ir.val("c", const_value=ir.tensor(np.array(True)))
    graph.register_initializer(cond)
    if_node = ir.node("If", [cond], attributes=branches)
    graph.append(if_node)
    graph.outputs.append(if_node.outputs[0])
    assert not dangling_values(graph)
    (ra,) = [n for n in graph if n.name == "ra"]
    graph.outputs.remove(ra.outputs[0])
    reader = ir.node("Relu", [ra.outputs[0]], name="relu")
    graph.append(reader)
    graph.remove(ra)
    assert dangling_values(graph) == ["relu reads 'a'"]
