"""The RMS norm forms the torch exporters write (``_rms_norm_opset17``) become ``SimplifiedLayerNormalization``,
exactly, on graphs built here and on the committed T5 exports (TorchScript and dynamo, encoder and both
decoders, opset 18: the TorchScript ``Div(1, Sqrt)`` with the axes as an input that no rule read before).

Each built graph is ``weight * (x * rsqrt(mean(x^2, -1) + eps))`` in one spelling (axes attribute or input,
``Div(1, Sqrt)``, ``Reciprocal``, ``x / Sqrt`` or Gemma 3n's ``Pow(., -0.5)``, the weight on either side, T5's
same-type Cast or none; Gemma 3n's value norm without a weight),
compared with the rewrite under ONNX Runtime (graph optimizations off) at batch and sequence sizes other than
any example. The negatives keep what the kernel would compute differently."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx_ir.passes.common import ShapeInferencePass

from passes._infra import op_histogram
from passes.fusion import _layer_reasons as layer_reasons
from passes.fusion import _onnxscript_adapter as adapter
from passes.fusion import _rms_norm_opset17 as rms
from passes.fusion._decoder_norm import divide_rms_norms
from tests.models.build_seq2seq import ARCHS, KINDS, OUT, filename, folder, seq2seq_feeds
from tests.numerics import assert_equivalent, reference_session, run_named

HIDDEN = 16
SHAPES = [{"x": (3, 5, HIDDEN)}, {"x": (1, 9, HIDDEN)}, {"x": (2, 1, HIDDEN)}]
SLN = "SimplifiedLayerNormalization"


def _norm_graph(
    *,
    axes_input: bool,
    inverse: str,
    weight_first: bool,
    cast: int | None = None,
    weight_shape: tuple[int, ...] = (HIDDEN,),
    axis: int = -1,
    numerator: float = 1.0,
    residual: bool = False,
    unscaled: bool = False,
    exponent: float = -0.5,
) -> onnx.ModelProto:
    """``weight * norm(x)`` in one exporter spelling; ``residual`` adds a second input first (a Skip site);
    ``unscaled``: no weight (Gemma 3n's value norm); ``exponent``: the power of the "pow" inverse."""
    rng = np.random.default_rng(1)
    inits = [
        helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
        helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-6]),
        helper.make_tensor("one", TensorProto.FLOAT, [], [numerator]),
        helper.make_tensor("power", TensorProto.FLOAT, [], [exponent]),
        helper.make_tensor("axes", TensorProto.INT64, [1], [axis]),
        helper.make_tensor("weight", TensorProto.FLOAT, weight_shape, rng.uniform(0.5, 1.5, weight_shape).ravel()),
    ]
    nodes = []
    x = "x"
    if residual:
        nodes += [  # a residual sum of two computed tensors, as a layer's output and its input
            helper.make_node("Relu", ["x"], ["a"], name="branch"),
            helper.make_node("Neg", ["skip"], ["b"], name="stream"),
            helper.make_node("Add", ["a", "b"], ["h"], name="residual"),
        ]
        x = "h"
    if cast is not None:
        nodes.append(helper.make_node("Cast", [x], ["xc"], to=cast, name="cast"))
        x = "xc"
    nodes.append(helper.make_node("Pow", [x, "two"], ["sq"], name="pow"))
    if axes_input:
        nodes.append(helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1, name="mean"))
    else:
        nodes.append(helper.make_node("ReduceMean", ["sq"], ["mean"], axes=[axis], keepdims=1, name="mean"))
    nodes.append(helper.make_node("Add", ["mean", "eps"], ["var"], name="add_eps"))
    if inverse != "pow":
        nodes.append(helper.make_node("Sqrt", ["var"], ["root"], name="sqrt"))
    if inverse == "pow":  # Gemma 3n: x * (mean + eps) ** -0.5
        nodes += [helper.make_node("Pow", ["var", "power"], ["inv"], name="inv"), _mul(x, "inv", "normed")]
    elif inverse == "div_one":
        nodes += [helper.make_node("Div", ["one", "root"], ["inv"], name="inv"), _mul(x, "inv", "normed")]
    elif inverse == "reciprocal":
        nodes += [helper.make_node("Reciprocal", ["root"], ["inv"], name="inv"), _mul(x, "inv", "normed")]
    else:
        nodes.append(helper.make_node("Div", [x, "root"], ["normed"], name="normed"))
    pair = ["weight", "normed"] if weight_first else ["normed", "weight"]
    if unscaled:
        nodes.append(helper.make_node("Identity", ["normed"], ["y"], name="out"))
        inits = [i for i in inits if i.name != "weight"]
    else:
        nodes.append(helper.make_node("Mul", pair, ["y"], name="scale"))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])]
    if residual:
        inputs.append(helper.make_tensor_value_info("skip", TensorProto.FLOAT, ["batch", "seq", HIDDEN]))
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "rms", inputs, [output], inits)
    opset = 18 if axes_input else 17
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _mul(a: str, b: str, out: str) -> onnx.NodeProto:
    return helper.make_node("Mul", [a, b], [out], name=out)


def _fused(proto: onnx.ModelProto) -> tuple[ir.Model, int]:
    model = ir.serde.deserialize_model(proto)
    ShapeInferencePass()(model)
    return model, rms.rules.apply_to_model(model)


FORMS = list(
    itertools.product(
        (False, True), ("div_one", "reciprocal", "div_x", "pow"), (True, False), (None, TensorProto.FLOAT)
    )
)


@pytest.mark.parametrize(("axes_input", "inverse", "weight_first", "cast"), FORMS)
def test_rms_norm_becomes_simplified_layer_norm_when_exporter_form(axes_input, inverse, weight_first, cast):
    """weight * (x * rsqrt(mean(x^2) + eps)) in each spelling becomes one SimplifiedLayerNormalization."""
    proto = _norm_graph(axes_input=axes_input, inverse=inverse, weight_first=weight_first, cast=cast)
    model, count = _fused(proto)
    ops = op_histogram(model)
    assert count == 1
    assert ops[SLN] == 1 and not {"Pow", "ReduceMean", "Sqrt", "Reciprocal", "Div"} & set(ops)
    assert ops["Cast"] == (cast is not None)  # a Cast before the statistics stays: the norm reads its output
    (node,) = [n for n in model.graph if n.op_type == SLN]
    assert node.attributes.get_float("epsilon") == pytest.approx(1e-6)
    assert_equivalent(proto, model, SHAPES, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axes_input", [False, True])
def test_an_unscaled_norm_becomes_simplified_layer_norm_with_a_scale_of_ones(axes_input):
    """Gemma 3n's value norm, ``v * (mean(v^2) + eps) ** -0.5`` with no weight: the weighted rules leave it, the
    unscaled ones fuse it with ones as the kernel's scale."""
    proto = _norm_graph(axes_input=axes_input, inverse="pow", weight_first=True, unscaled=True)
    model, count = _fused(proto)
    assert count == 0
    assert rms.unscaled_rules.apply_to_model(model) == 1
    ops = op_histogram(model)
    assert ops[SLN] == 1 and not {"Pow", "ReduceMean"} & set(ops)
    assert_equivalent(proto, model, SHAPES, rtol=1e-5, atol=1e-5)


def test_a_weighted_norm_keeps_its_weight_in_the_kernel_when_both_rule_sets_run():
    proto = _norm_graph(axes_input=True, inverse="pow", weight_first=False)
    model, count = _fused(proto)
    assert count == 1 and rms.unscaled_rules.apply_to_model(model) == 0
    (node,) = [n for n in model.graph if n.op_type == SLN]
    assert node.inputs[1].name == "weight" and "Mul" not in op_histogram(model)


def test_onnxscripts_form_fuses_to_the_node_onnxscripts_rule_writes_when_opset_18():
    """Reciprocal with the axes as an input (and noop_with_empty_axes spelled out, as onnxscript's pattern
    wants it): our rule, which runs first, writes the node onnxscript's rms_normalization would."""
    proto = _norm_graph(axes_input=True, inverse="reciprocal", weight_first=True)
    for node in proto.graph.node:
        if node.op_type == "ReduceMean":
            node.attribute.append(helper.make_attribute("noop_with_empty_axes", 0))
    ours, count = _fused(proto)
    theirs = ir.serde.deserialize_model(proto)
    ShapeInferencePass()(theirs)
    assert count == 1 and adapter.rule_set("rms_normalization").apply_to_model(theirs) == 1
    (mine,), (their,) = ([n for n in m.graph if n.op_type == SLN] for m in (ours, theirs))
    assert [v.name for v in mine.inputs] == [v.name for v in their.inputs]
    assert {k: a.value for k, a in mine.attributes.items()} == {k: a.value for k, a in their.attributes.items()}


@pytest.mark.parametrize(
    "variant",
    [
        {"weight_shape": (1,)},  # a scalar weight: the kernel's scale is one per hidden unit
        {"weight_shape": (2, 1, HIDDEN)},  # a weight with a batch extent broadcasts otherwise
        {"axis": 1},  # the statistics over the sequence, not the hidden units
        {"cast": TensorProto.DOUBLE},  # the statistics in another precision
        {"numerator": 2.0},  # 2 / sqrt(..) is not an inverse root
        {"inverse": "pow", "exponent": -1.0},  # (mean + eps) ** -1 is not an inverse root
    ],
    ids=lambda v: next(iter(v)),
)
def test_rms_norm_is_left_when_the_kernel_would_compute_otherwise(variant):
    proto = _norm_graph(**{"axes_input": True, "inverse": "div_one", "weight_first": True, **variant})
    model, count = _fused(proto)
    assert count == 0 and SLN not in op_histogram(model)
    if "cast" not in variant:  # Cast to double then Mul by a float weight: not a valid graph to run
        shapes = [{"x": (2, 5, HIDDEN)}]
        assert_equivalent(proto, model, shapes, rtol=1e-6, atol=1e-6, n_random=0)


def test_layer_reason_names_the_rms_rule_and_the_layer_when_a_residual_norm_stays():
    """A residual norm left unfused is reported with its layer and our rule's own reason, not a
    LayerNormalization rule's first-node mismatch (the RMS rule's root is six ops below the Pow)."""
    proto = _norm_graph(axes_input=True, inverse="div_one", weight_first=True, axis=1, residual=True)
    model = ir.serde.deserialize_model(proto)
    ShapeInferencePass()(model)
    reasons = layer_reasons.layer_reasons(model, model, "t5", {"skip_layer_norm"})
    assert len(reasons) == 1
    text = reasons[0].reason
    assert "residual norm layer 0" in text and "RmsNormOpset18WeightFirst" in text
    assert "ReduceMean over axis 1, not the last one" in text


# ------------------------------------------------------------------------------------- the T5 exports

T5_FILES = [(exporter, kind) for exporter in ("ts", "dynamo") for kind in KINDS]


@pytest.mark.parametrize(("exporter", "kind"), T5_FILES)
def test_every_t5_norm_fuses_exactly_when_committed_export(exporter, kind):
    """Every RMS norm of each T5 file (TorchScript's Div(1, Sqrt) + axes input; dynamo's Reciprocal after
    fuse_rotary's division) becomes SimplifiedLayerNormalization; outputs unchanged at other sizes."""
    path = OUT / folder("t5", exporter) / filename(kind)
    model = ir.load(path)
    norms = sum(1 for n in model.graph if n.op_type == "Pow")
    divided = divide_rms_norms(model.graph)
    assert divided == (norms if exporter == "dynamo" else 0)
    ShapeInferencePass()(model)
    assert rms.rules.apply_to_model(model) == norms > 0
    ops = op_histogram(model)
    assert ops[SLN] == norms and "Pow" not in ops and "Sqrt" not in ops
    arch = ARCHS["t5"]
    want, got = reference_session(path), reference_session(model)
    for batch, dec, past, enc in ((3, 2, 5, 10), (1, 4, 0, 3)):
        feeds = seq2seq_feeds(arch, kind, batch, dec=dec, past=past, enc=enc, seed=batch)
        expected, actual = run_named(want, feeds), run_named(got, feeds)
        for name, value in expected.items():
            np.testing.assert_allclose(actual[name], value, atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("constants", ["initializers", "nodes"])
@pytest.mark.parametrize("weight_first", [True, False])
def test_a_pow_inverse_root_is_divided_so_the_session_fuses_the_norm(tmp_path, constants, weight_first):
    """Gemma 4's ``x * pow(mean(x^2) + eps, -0.5) * weight`` in a decoder whose family the adapter's rules do not
    run on: ``divide_rms_norms`` writes the root as ``Div(1, Sqrt(.))``, which ORT's session fuses into
    SimplifiedLayerNormalization at its default level (it fuses the Pow form not at all). The exponent and
    epsilon as initializers (dynamo) or Constant nodes (TorchScript, no value_info)."""
    proto = _norm_graph(axes_input=True, inverse="pow", weight_first=weight_first)
    if constants == "nodes":
        for init in [i for i in proto.graph.initializer if i.name in ("two", "eps", "power")]:
            proto.graph.node.insert(0, helper.make_node("Constant", [], [init.name], value=init))
            proto.graph.initializer.remove(init)
    model = ir.serde.deserialize_model(proto)
    assert divide_rms_norms(model.graph) == 1
    ops = op_histogram(model)
    assert ops["Pow"] == 1 and ops["Sqrt"] == 1 and ops["Div"] == 1  # the square stays, the root is divided
    assert_equivalent(proto, model, SHAPES, rtol=1e-6, atol=1e-6)

    def session_ops(m: onnx.ModelProto, name: str) -> set[str]:
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / name)
        options.log_severity_level = 3
        ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return {n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node}

    assert SLN not in session_ops(proto, "upload.onnx")
    assert session_ops(ir.serde.serialize_model(model), "divided.onnx") == {SLN}


def test_a_pow_of_another_exponent_or_of_no_mean_square_is_left():
    for proto in (
        _norm_graph(axes_input=True, inverse="pow", weight_first=True, exponent=-1.0),
        _norm_graph(axes_input=True, inverse="pow", weight_first=True, axis=1),  # not over the last axis
    ):
        assert divide_rms_norms(ir.serde.deserialize_model(proto).graph) == 0
