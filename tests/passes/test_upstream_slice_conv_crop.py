"""upstream_slice takes a Slice that crops a Conv's trailing outputs (``x[..., :-r]``, wav2vec2's ``SamePad``)
into the Conv's end padding: the Slice goes, the Conv computes the kept columns only, from the same inputs and
weights (exact). Refused where the Conv's output has another reader, where the padding left would be less than
a 'same' convolution's, under auto_pad, and for any other slice."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.compute_order.upstream_slice import UpstreamSlice
from tests.numerics import assert_equivalent
from tests.passes._slice_helpers import MODELS, assert_same_feeds, assert_unchanged, ops_of, optimize


def conv_crop(
    *,
    kernel: int = 4,
    pads: tuple[int, int] = (2, 2),
    stride: int = 1,
    dilation: int = 1,
    crop: int = 1,
    start: int = 0,
    auto_pad: str | None = None,
    second_reader: bool = False,
) -> onnx.ModelProto:
    """x [N, 3, L] -> Conv(4 out channels) -> Slice(axis 2, start, -crop) -> y."""
    rng = np.random.default_rng(kernel + crop)
    weight = numpy_helper.from_array(rng.standard_normal((4, 3, kernel)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    consts = [
        numpy_helper.from_array(np.array([v], np.int64), name)
        for name, v in (("starts", start), ("ends", -crop), ("axes", 2))
    ]
    attrs = {"kernel_shape": [kernel], "strides": [stride], "dilations": [dilation]}
    attrs |= {"auto_pad": auto_pad} if auto_pad else {"pads": list(pads)}
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", **attrs),
        helper.make_node("Slice", ["c", "starts", "ends", "axes"], ["y"], name="crop"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, "M"])]
    if second_reader:
        nodes.append(helper.make_node("Relu", ["c"], ["z"], name="other"))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 4, "K"]))
    graph = helper.make_graph(
        nodes,
        "conv_crop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "L"])],
        outputs,
        [weight, bias, *consts],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def feeds(lengths: range) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((2, 3, n)).astype(np.float32)} for n in lengths]


@pytest.mark.parametrize(
    ("kernel", "pads", "stride", "dilation", "crop", "folded_pads"),
    [
        (4, (2, 2), 1, 1, 1, [2, 1]),  # SamePad: even kernel, one extra output
        (128, (64, 64), 1, 1, 1, [64, 63]),  # wav2vec2's positional convolution
        (3, (2, 4), 1, 1, 2, [2, 2]),  # a causal-style crop of 2
        (3, (1, 3), 2, 1, 1, [1, 1]),  # stride 2: the end pad shrinks by the stride
        (3, (2, 4), 1, 2, 2, [2, 2]),  # dilation 2
    ],
)
def test_trailing_crop_goes_into_the_conv_end_padding(kernel, pads, stride, dilation, crop, folded_pads):
    proto = conv_crop(kernel=kernel, pads=pads, stride=stride, dilation=dilation, crop=crop)
    model, result = optimize(proto)
    assert result.modified and result.counts["conv_crops_folded"] == 1
    assert not ops_of(model, "Slice")
    (conv,) = ops_of(model, "Conv")
    assert list(conv.attributes.get_ints("pads")) == folded_pads
    assert model.graph.outputs[0].name == "y" and model.graph.outputs[0].producer() is conv
    assert_same_feeds(proto, model, feeds(range(1, 12)))  # lengths down to 1: never empty, same values


@pytest.mark.parametrize(
    "variant",
    [
        {"second_reader": True},  # the uncropped output is read elsewhere
        {"kernel": 4, "pads": (1, 2), "crop": 1},  # 1 + 1 < 3: less than a 'same' convolution's padding
        {"crop": 3},  # more than the end pad holds
        {"auto_pad": "SAME_UPPER"},
        {"start": 1},  # not a trailing crop
    ],
)
def test_other_slices_of_a_conv_stay(variant):
    assert_unchanged(conv_crop(**variant))


@pytest.mark.parametrize("exporter", ["ts_eager", "dynamo"])
def test_wav2vec2_positional_convolution_crop_is_folded(exporter):
    path = MODELS / "corpus" / f"wav2vec2_{exporter}.onnx"
    proto = onnx.load(str(path))
    model = ir.serde.deserialize_model(proto)
    pads = {n.name: list(n.attributes.get_ints("pads", [])) for n in model.graph if n.op_type == "Conv"}
    result = UpstreamSlice()(model)
    assert result.counts["conv_crops_folded"] == 1
    changed = {n.name: (pads[n.name], list(n.attributes.get_ints("pads"))) for n in model.graph if n.op_type == "Conv"}
    ((before, after),) = [v for v in changed.values() if v[0] != v[1]]  # the positional convolution's
    assert after == [before[0], before[1] - 1]
    assert len(ops_of(model, "Slice")) == sum(n.op_type == "Slice" for n in proto.graph.node) - 1
    shapes = [{"input_values": (1, 400)}, {"input_values": (2, 1600)}, {"input_values": (1, 3201)}]
    assert_equivalent(proto, model, shapes, rtol=1e-4, atol=1e-5, n_random=0)
