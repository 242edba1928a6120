"""Tests of passes/compute_order/range_gather_to_slice.py: structure, numerics, the (start, limit, delta) sweep.

The sweep builds one model per (delta, limit kind) with one ``Gather(data, Range(s, l, delta))`` branch per
valid (s, l), so 24 models cover 6,912 branches and the file stays fast. Each optimized model runs under
ORT with graph optimizations off *and* at ORT's default level (``ORT_ENABLE_ALL``), because the point of
the guard is that ORT's own ``GatherToSliceFusion`` must not break what the pass leaves behind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.compute_order.range_gather_to_slice import RangeGatherToSlice
from tests.numerics import assert_equivalent, to_proto

N = 8  # data length on the gathered axis
DISABLE = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
DEFAULT = ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # what InferenceSession uses when not told
_NP = {TensorProto.INT64: np.int64, TensorProto.INT32: np.int32}


def _scalar(name: str, value: int, elem: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, _NP[elem]), name)


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[str],
    inits: list[onnx.TensorProto],
    opset: int = 17,
) -> ir.Model:
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    proto = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    return ir.serde.deserialize_model(proto)


def _range_gather(
    start: int | None,
    limit: int | None,
    delta: int | None,
    *,
    axis: int = 0,
    data_shape: Sequence[int] = (N, 3),
    elem: int = TensorProto.INT64,
    opset: int = 17,
) -> ir.Model:
    """y = Gather(x, Range(start, limit, delta), axis); a None operand becomes a scalar graph input."""
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(data_shape))]
    inits = []
    for name, value in (("start", start), ("limit", limit), ("delta", delta)):
        if value is None:
            inputs.append(helper.make_tensor_value_info(name, elem, []))
        else:
            inits.append(_scalar(name, value, elem))
    nodes = [
        helper.make_node("Range", ["start", "limit", "delta"], ["r"], name="range"),
        helper.make_node("Gather", ["x", "r"], ["g"], name="gather", axis=axis),
        helper.make_node("Relu", ["g"], ["y"], name="relu"),
    ]
    return _model(nodes, inputs, ["y"], inits, opset)


def _run(model: ir.Model | onnx.ModelProto, feeds: dict[str, np.ndarray], level: ort.GraphOptimizationLevel):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 3
    session = ort.InferenceSession(to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def _ops(model: ir.Model) -> Counter[str]:
    return Counter(n.op_type for n in model.graph)


def _apply(model: ir.Model):
    original = ir.serde.serialize_model(model)  # a copy: the pass is in place
    result = RangeGatherToSlice()(model)
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    return original, result


def _assert_right(original: onnx.ModelProto, optimized: ir.Model, feeds: dict[str, np.ndarray]) -> None:
    """Optimized model equals the original (graph opts off), at both ORT levels."""
    expected = _run(original, feeds, DISABLE)
    for level in (DISABLE, DEFAULT):
        got = _run(optimized, feeds, level)
        for name, ref in expected.items():
            assert got[name].shape == ref.shape, (level, name, got[name].shape, ref.shape)
            np.testing.assert_array_equal(got[name], ref)


# --- positive cases -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("span", "axis", "data_shape", "elem"),
    [
        pytest.param((0, N, 1), 0, (N, 3), TensorProto.INT64, id="int64-axis0"),
        pytest.param((0, N, 1), 0, (N, 3), TensorProto.INT32, id="int32-axis0"),
        pytest.param((0, 5, 1), 1, (2, N, 3), TensorProto.INT64, id="axis1"),
        pytest.param((1, 6, 1), -1, (2, 3, N), TensorProto.INT64, id="axis-1"),
        pytest.param((3, N, 1), 0, (N, 3), TensorProto.INT64, id="start3"),
        pytest.param((1, N, 2), 0, (N, 3), TensorProto.INT32, id="step2"),
        pytest.param((0, -4, 1), 0, (N, 3), TensorProto.INT64, id="negative-limit-empty"),
        pytest.param((7, -1, -1), 0, (N, 3), TensorProto.INT64, id="full-reverse"),
        pytest.param((7, -1, -2), 0, (N, 3), TensorProto.INT32, id="reverse-step2-int32"),
        pytest.param((5, 1, -1), 0, (N, 3), TensorProto.INT64, id="reverse-to-1"),
        pytest.param((-1, -9, -1), 0, (N, 3), TensorProto.INT64, id="negative-reverse"),
        pytest.param((-8, -1, 3), 0, (N, 3), TensorProto.INT64, id="negative-forward"),
    ],
)
def test_range_gather_becomes_one_slice_when_range_is_exact(span, axis, data_shape, elem):
    """y = Relu(Gather(x, Range(start, limit, delta), axis)) with constant operands -> Relu(Slice(x, ...))."""
    start, limit, delta = span
    original, result = _apply(_range_gather(start, limit, delta, axis=axis, data_shape=data_shape, elem=elem))
    model = result.model
    assert result.modified
    assert result.counts == {"ranges_fused": 1, "guarded": 0}
    assert _ops(model) == Counter({"Slice": 1, "Relu": 1})
    (slice_node,) = [n for n in model.graph if n.op_type == "Slice"]
    assert slice_node.outputs[0].name == "g"  # the Gather's output name survives
    assert slice_node.inputs[0].name == "x"
    steps = slice_node.inputs[4].const_value.numpy()
    assert steps.dtype == _NP[elem] and steps.tolist() == [delta]
    assert slice_node.inputs[3].const_value.numpy().tolist() == [axis]
    if limit == -1 and delta < 0:  # Range's -1 is "before index 0": Slice needs the type's minimum
        assert slice_node.inputs[2].const_value.numpy().tolist() == [np.iinfo(_NP[elem]).min]
    x = np.random.default_rng(0).standard_normal(data_shape).astype(np.float32)
    _assert_right(original, model, {"x": x})


def test_range_gather_becomes_slice_with_max_when_limit_is_dynamic():
    """Range(0, limit, 1) with limit a graph input -> Slice(x, [0], Reshape(Max(limit, 0), [1]), [0], [1])."""
    original, result = _apply(_range_gather(0, None, 1))
    model = result.model
    assert result.counts == {"ranges_fused": 1, "guarded": 0}
    assert _ops(model) == Counter({"Max": 1, "Reshape": 1, "Slice": 1, "Relu": 1})
    (slice_node,) = [n for n in model.graph if n.op_type == "Slice"]
    assert slice_node.inputs[2].producer().op_type == "Reshape"
    x = np.random.default_rng(1).standard_normal((N, 3)).astype(np.float32)
    for limit in (-3, 0, 1, 5, N):  # a negative limit is an empty Range, not Slice's "from the end"
        _assert_right(original, model, {"x": x, "limit": np.array(limit, np.int64)})
    assert_equivalent(original, model)


def test_range_gather_becomes_slice_when_gather_output_is_graph_output():
    """Gather's output y is a graph output: the Slice produces y under the same name."""
    proto = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Range", ["s", "l", "d"], ["r"]),
                helper.make_node("Gather", ["x", "r"], ["y"], axis=0),
            ],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [_scalar("s", 0, TensorProto.INT64), _scalar("l", 1, TensorProto.INT64), _scalar("d", 1, 7)],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model = ir.serde.deserialize_model(proto)
    result = RangeGatherToSlice()(model)
    assert result.counts["ranges_fused"] == 1
    assert [o.name for o in model.graph.outputs] == ["y"]
    assert model.graph.outputs[0].producer().op_type == "Slice"
    assert_equivalent(proto, model)


# --- refusals ---------------------------------------------------------------------------------------


def _shared_range(start: int, limit: int | None, delta: int, *, through_reshape: bool) -> ir.Model:
    """XLNet's relative shift: one Range r read by two Gathers (axis 3 and axis 1), directly or through
    Reshape(r, [-1]), and by an Unsqueeze -> Equal mask; a None limit is a scalar graph input."""
    idx = "r_flat" if through_reshape else "r"
    nodes = [helper.make_node("Range", ["s", "l", "d"], ["r"], name="range")]
    if through_reshape:
        nodes.append(helper.make_node("Reshape", ["r", "minus_one"], ["r_flat"], name="flatten"))
    nodes += [
        helper.make_node("Gather", ["x", idx], ["g0"], name="gather0", axis=3),
        helper.make_node("Gather", ["x", idx], ["g1"], name="gather1", axis=1),
        helper.make_node("Unsqueeze", ["r", "zero_axis"], ["r_row"], name="unsqueeze"),
        helper.make_node("Equal", ["r_row", "r"], ["eye"], name="equal"),
        helper.make_node("Cast", ["eye"], ["z"], name="cast", to=TensorProto.FLOAT),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, N, 3, N])]
    inits = [
        _scalar("s", start, TensorProto.INT64),
        _scalar("d", delta, TensorProto.INT64),
        numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
        numpy_helper.from_array(np.array([0], np.int64), "zero_axis"),
    ]
    if limit is None:
        inputs.append(helper.make_tensor_value_info("l", TensorProto.INT64, []))
    else:
        inits.append(_scalar("l", limit, TensorProto.INT64))
    if not through_reshape:
        inits = [i for i in inits if i.name != "minus_one"]
    return _model(nodes, inputs, ["g0", "g1", "z"], inits)


@pytest.mark.parametrize("through_reshape", [False, True], ids=["direct", "through-reshape"])
def test_each_gather_of_a_shared_range_becomes_a_slice_when_the_range_has_other_consumers(through_reshape):
    """ORT fuses none of these (the Range has several edges); each Gather becomes a Slice, the Range stays
    for the mask, and a Reshape(-1) that only the Gathers read goes. Dynamic limit: clamped once."""
    model = _shared_range(0, None, 1, through_reshape=through_reshape)
    original, result = _apply(model)
    assert result.counts == {"ranges_fused": 2, "guarded": 0}
    assert _ops(model) == Counter(
        {"Range": 1, "Max": 1, "Reshape": 1, "Slice": 2, "Unsqueeze": 1, "Equal": 1, "Cast": 1}
    )
    slices = [n for n in model.graph if n.op_type == "Slice"]
    assert [s.outputs[0].name for s in slices] == ["g0", "g1"]
    assert slices[0].inputs[2] is slices[1].inputs[2]  # one clamped limit for both
    x = np.arange(2 * N * 3 * N, dtype=np.float32).reshape(2, N, 3, N)
    for limit in (0, 1, 3, N, -2):
        _assert_right(original, model, {"x": x, "l": np.array(limit, np.int64)})


def test_shared_range_and_its_reshape_go_when_only_gathers_read_them():
    """Range(1, 7, 2) -> Reshape(-1) -> two Gathers and nothing else: two Slices remain, no Range."""
    nodes = [
        helper.make_node("Range", ["s", "l", "d"], ["r"], name="range"),
        helper.make_node("Reshape", ["r", "minus_one"], ["r_flat"], name="flatten"),
        helper.make_node("Gather", ["x", "r_flat"], ["g0"], name="gather0", axis=0),
        helper.make_node("Gather", ["x", "r_flat"], ["g1"], name="gather1", axis=1),
    ]
    inits = [
        _scalar("s", 1, TensorProto.INT64),
        _scalar("l", 7, TensorProto.INT64),
        _scalar("d", 2, TensorProto.INT64),
        numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
    ]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, N])], ["g0", "g1"], inits)
    original, result = _apply(model)
    assert result.counts == {"ranges_fused": 2, "guarded": 0}
    assert _ops(model) == Counter({"Slice": 2})
    assert not [name for name, v in model.graph.initializers.items() if not list(v.uses())]
    _assert_right(original, model, {"x": np.arange(N * N, dtype=np.float32).reshape(N, N)})


@pytest.mark.parametrize("through_reshape", [False, True], ids=["direct", "through-reshape"])
def test_shared_range_is_kept_unguarded_when_slice_would_be_wrong(through_reshape):
    """Range(-3, 1, 1) read by two Gathers and a mask: refused (it crosses zero), and with several edges
    it is not ORT's pattern, so no guard is added and ORT's default level stays right."""
    model = _shared_range(-3, 1, 1, through_reshape=through_reshape)
    before = _ops(model)
    original, result = _apply(model)
    assert not result.modified
    assert _ops(model) == before
    assert result.counts == {"ranges_fused": 0, "guarded": 0}
    assert "may cross zero" in result.non_matches[0].reason
    _assert_right(original, model, {"x": np.arange(2 * N * 3 * N, dtype=np.float32).reshape(2, N, 3, N)})


def test_range_is_kept_unguarded_when_no_consumer_is_a_gather():
    """r = Range(0, 4, 1) feeds a Cast and an Unsqueeze: nothing to fuse, nothing for ORT to match."""
    nodes = [
        helper.make_node("Range", ["s", "l", "d"], ["r"], name="range"),
        helper.make_node("Cast", ["r"], ["z"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["r", "a"], ["u"]),
    ]
    inits = [_scalar("s", 0, 7), _scalar("l", 4, 7), _scalar("d", 1, 7)]
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "a"))
    model = _model(nodes, [], ["z", "u"], inits)
    before = _ops(model)
    result = RangeGatherToSlice()(model)
    assert not result.modified
    assert _ops(model) == before
    assert result.counts == {"ranges_fused": 0, "guarded": 0}
    assert "2 uses, none a Gather's indices" in result.non_matches[0].reason


def test_range_is_kept_unguarded_when_range_output_is_graph_output():
    """r is a graph output: fusing would delete it; ORT does not fuse either (checked on 1.32)."""
    nodes = [
        helper.make_node("Range", ["s", "l", "d"], ["r"], name="range"),
        helper.make_node("Gather", ["x", "r"], ["y"], name="gather"),
    ]
    inits = [_scalar("s", 0, 7), _scalar("d", 1, 7)]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, 3]),
        helper.make_tensor_value_info("l", TensorProto.INT64, []),
    ]
    proto = helper.make_model(
        helper.make_graph(
            nodes,
            "g",
            inputs,
            [
                helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                helper.make_tensor_value_info("r", TensorProto.INT64, None),
            ],
            inits,
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model = ir.serde.deserialize_model(proto)
    result = RangeGatherToSlice()(model)
    assert not result.modified
    assert "graph output" in result.non_matches[0].reason
    feeds = {"x": np.ones((N, 3), np.float32), "l": np.array(2, np.int64)}
    assert _run(model, feeds, DEFAULT)["y"].shape == (2, 3)


@pytest.mark.parametrize(
    ("start", "limit", "delta", "why"),
    [
        pytest.param(-3, 1, 1, "may cross zero", id="-3..1"),  # 4 rows; ORT's fused Slice gives 0
        pytest.param(-3, 0, 1, "may cross zero", id="-3..0"),  # last 3 rows; ORT gives none
        pytest.param(2, -3, -1, "crosses zero", id="2..-3"),  # wraps below zero
        pytest.param(None, 4, 1, "not a constant", id="dynamic-start"),
        pytest.param(0, 4, None, "not a constant", id="dynamic-delta"),
    ],
)
def test_range_gather_is_guarded_when_slice_would_be_wrong(start, limit, delta, why):
    """Refused pairs keep their Gather and get Reshape(r, [-1]) so ORT's fusion cannot match them."""
    original, result = _apply(_range_gather(start, limit, delta))
    model = result.model
    assert result.counts == {"ranges_fused": 0, "guarded": 1}
    assert _ops(model) == Counter({"Range": 1, "Reshape": 1, "Gather": 1, "Relu": 1})
    (gather,) = [n for n in model.graph if n.op_type == "Gather"]
    guard = gather.inputs[1].producer()
    assert guard.op_type == "Reshape" and guard.inputs[0].producer().op_type == "Range"
    assert guard.inputs[1].const_value.numpy().tolist() == [-1]
    (non_match,) = result.non_matches
    assert why in non_match.reason and "GatherToSliceFusion would miscompile" in non_match.reason
    assert result.notes["guarded_ranges"] == ["range"]
    feeds = {"x": np.arange(N * 3, dtype=np.float32).reshape(N, 3)}
    feeds |= {"start": np.array(-3, np.int64)} if start is None else {}
    feeds |= {"delta": np.array(1, np.int64)} if delta is None else {}
    _assert_right(original, model, feeds)


@pytest.mark.parametrize(("start", "limit", "delta"), [(-3, 1, 1), (-3, 0, 1), (7, -1, -1)])
def test_range_gather_is_guarded_when_limit_is_dynamic_and_ort_would_miscompile(start, limit, delta):
    """The spec's three ORT miscompiles, with a graph-input limit so ORT cannot constant-fold the Range."""
    original, result = _apply(_range_gather(start, None, delta))
    assert result.counts == {"ranges_fused": 0, "guarded": 1}
    feeds = {"x": np.arange(N * 3, dtype=np.float32).reshape(N, 3), "limit": np.array(limit, np.int64)}
    raw_default = _run(original, feeds, DEFAULT)["y"]
    expected = np.maximum(feeds["x"][np.arange(start, limit, delta)], 0)
    assert raw_default.shape != expected.shape  # the ORT bug, on the unguarded graph
    _assert_right(original, result.model, feeds)


def test_range_gather_is_guarded_when_opset_lacks_integer_max():
    """Opset 11 has Range but no integer Max, so a dynamic limit cannot be clamped: guard instead."""
    _, result = _apply(_range_gather(0, None, 1, opset=11))
    assert result.counts == {"ranges_fused": 0, "guarded": 1}
    assert "opset 12" in result.non_matches[0].reason


def test_range_gather_pass_is_idempotent_when_run_twice():
    """A guarded pair is not guarded again, and a fused one leaves nothing to fuse."""
    model = _range_gather(-3, None, 1)
    RangeGatherToSlice()(model)
    again = RangeGatherToSlice()(model)
    assert not again.modified
    assert _ops(model)["Reshape"] == 1


# --- the sweep ----------------------------------------------------------------------------------------

STARTS, LIMITS, DELTAS = range(-8, 8), range(-9, 9), (-3, -2, -1, 1, 2, 3)


def _valid_cases(delta: int) -> list[tuple[int, int]]:
    """(start, limit) whose Range indexes only rows -N..N-1, i.e. where the original Gather runs."""
    cases = []
    for s in STARTS:
        for lim in LIMITS:
            idx = np.arange(s, lim, delta)
            if idx.size == 0 or (idx.min() >= -N and idx.max() < N):
                cases.append((s, lim))
    return cases


def _sweep_model(delta: int, dynamic_limit: bool, elem: int) -> tuple[ir.Model, dict[str, np.ndarray], dict]:
    """One branch y_i = Gather(x, Range(s_i, l_i, delta)) per valid case; l_i an input when dynamic."""
    x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, 3])]
    feeds: dict[str, np.ndarray] = {"x": x}
    expected, nodes, inits, outputs = {}, [], [_scalar("delta", delta, elem)], []
    for i, (s, lim) in enumerate(_valid_cases(delta)):
        inits.append(_scalar(f"s{i}", s, elem))
        if dynamic_limit:
            inputs.append(helper.make_tensor_value_info(f"l{i}", elem, []))
            feeds[f"l{i}"] = np.array(lim, _NP[elem])
        else:
            inits.append(_scalar(f"l{i}", lim, elem))
        nodes.append(helper.make_node("Range", [f"s{i}", f"l{i}", "delta"], [f"r{i}"], name=f"range{i}"))
        nodes.append(helper.make_node("Gather", ["x", f"r{i}"], [f"y{i}"], name=f"gather{i}"))
        outputs.append(f"y{i}")
        expected[f"y{i}"] = x[np.arange(s, lim, delta)]
    return _model(nodes, inputs, outputs, inits), feeds, expected


def _mismatches(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> int:
    return sum(got[k].shape != v.shape or not np.array_equal(got[k], v) for k, v in expected.items())


def _sweep(dynamic_limit: bool, elem: int) -> dict[str, int]:
    figures = Counter()
    for delta in DELTAS:
        model, feeds, expected = _sweep_model(delta, dynamic_limit, elem)
        original = ir.serde.serialize_model(model)
        RangeGatherToSlice()(model)
        figures["cases"] += len(expected)
        figures["raw_disable_wrong"] += _mismatches(_run(original, feeds, DISABLE), expected)
        figures["raw_default_wrong"] += _mismatches(_run(original, feeds, DEFAULT), expected)
        figures["pass_disable_wrong"] += _mismatches(_run(model, feeds, DISABLE), expected)
        figures["pass_default_wrong"] += _mismatches(_run(model, feeds, DEFAULT), expected)
        figures["fused"] += _ops(model)["Slice"]
        figures["guarded"] += _ops(model)["Gather"]
    return dict(figures)


@pytest.mark.parametrize("elem", [TensorProto.INT64, TensorProto.INT32], ids=["int64", "int32"])
@pytest.mark.parametrize("dynamic_limit", [False, True], ids=["constant-limit", "dynamic-limit"])
def test_range_gather_sweep_has_no_mismatch_when_run_at_either_ort_level(dynamic_limit, elem):
    """start -8..7, limit -9..8, delta +-1..3 on n=8: 0 mismatches after the pass, at both ORT levels."""
    figures = _sweep(dynamic_limit, elem)
    print(f"sweep dynamic_limit={dynamic_limit} elem={elem}: {figures}")
    # Every (start, limit) of the grid indexes within -8..7, so none is skipped. With constants, 1,104 are
    # exact Slices (the spec's count of safe cases); with a dynamic limit only delta > 0 from start >= 0
    # (8 starts x 18 limits x 3 deltas = 432) is. The rest keep a guarded Gather.
    assert figures["cases"] == 16 * 18 * 6
    assert figures["fused"] == (432 if dynamic_limit else 1104)
    assert figures["raw_disable_wrong"] == 0  # the reference semantics are numpy's
    assert figures["pass_disable_wrong"] == 0
    assert figures["pass_default_wrong"] == 0
    assert figures["fused"] + figures["guarded"] == figures["cases"]
    if dynamic_limit:
        # Stock ORT at its default level on the raw graph: the bug the guard exists for.
        # ORT 1.32: 600 of the 1,728 branches come out wrong (492 crossing zero, 108 with a negative limit).
        assert figures["raw_default_wrong"] > 0
    else:
        assert figures["raw_default_wrong"] == 0  # ORT constant-folds a fully constant Range first


def test_guard_survives_when_the_cleanup_passes_run_after():
    """Constant folding (onnxscript's, which turns same-shape Reshapes into Identity), identity elimination,
    CSE and dead-node elimination must not strip the guard: the sweep stays right at ORT's default level."""
    from passes.registry import get_pass_class

    cleanup = [
        get_pass_class(n)()
        for n in (
            "shape_inference",
            "constant_folding",
            "identity_elimination",
            "common_subexpression_elimination",
            "dead_node_elimination",
        )
    ]
    for delta in (-1, 2):
        model, feeds, expected = _sweep_model(delta, True, TensorProto.INT64)
        RangeGatherToSlice()(model)
        for cleanup_pass in cleanup:
            cleanup_pass(model)
        assert _ops(model)["Gather"] == _ops(model)["Reshape"] - _ops(model)["Slice"] > 0  # guards kept
        assert _mismatches(_run(model, feeds, DEFAULT), expected) == 0
