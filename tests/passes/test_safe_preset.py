"""The five cleanup passes in preset order on mlp_cleanup.onnx: the end result, and a fixed point."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from core.config import PassSpec
from passes import registry
from passes._infra import PassContext
from tests.numerics import assert_equivalent
from tests.passes._util import MLP_CLEANUP, checked, ops


def _run_safe(model: ir.Model) -> dict[str, tuple[bool, dict[str, int]]]:
    """Run the safe preset; the log keeps each pass's first run (a preset may run a pass twice)."""
    passes = registry.build_passes([PassSpec(name=name) for name in registry.get_preset("safe").passes])
    ctx = PassContext()
    log: dict[str, tuple[bool, dict[str, int]]] = {}
    for p in passes:
        result = p(model, ctx)
        log.setdefault(p.name, (result.modified, result.counts))
    return log


def test_safe_preset_leaves_two_matmuls_two_adds_and_one_relu_when_model_is_mlp_cleanup() -> None:
    """Identities, the constant bias subexpression, the duplicate Relu and the dead Sigmoid all go.

    ``add_branches`` stays as Add(r_a, r_a): rewriting x + x as 2 * x is not a cleanup pass's job.
    """
    original = onnx.load(MLP_CLEANUP)
    model = ir.serde.deserialize_model(original)
    log = _run_safe(model)
    assert ops(model) == {"MatMul": 2, "Add": 2, "Relu": 1}
    assert [n.name for n in model.graph] == ["matmul_1", "add_bias_1", "relu_a", "add_branches", "matmul_2"]
    assert list(model.graph.initializers) == ["W1", "W2", "b1_folded"]
    assert log["identity_elimination"] == (True, {"identities_removed": 2, "identities_kept": 0})
    assert log["constant_folding"][1]["nodes_removed"] == 5
    assert log["common_subexpression_elimination"] == (True, {"nodes_merged": 1})
    assert log["dead_node_elimination"][1]["nodes_removed"] == 1
    proto = checked(model)
    assert [o.name for o in proto.graph.output] == ["y"] and [i.name for i in proto.graph.input] == ["x"]
    assert_equivalent(original, proto, n_random=5)


def test_safe_preset_changes_nothing_when_run_on_its_own_output() -> None:
    model = ir.serde.deserialize_model(onnx.load(MLP_CLEANUP))
    _run_safe(model)
    second = _run_safe(model)
    assert {name: modified for name, (modified, _) in second.items()} == dict.fromkeys(second, False)
