"""Raw audio whose feature encoder normalizes channels-last between convolutions (data2vec-audio's
``feat_extract_norm="layer"``: Conv -> Transpose -> LayerNorm -> Transpose -> GELU per layer) is sized for its
whole convolution stack. The walk from the input to the convolutions stopped at the first Transpose, so the
audio was sized for the first convolution alone (45 samples) and the upload failed with MODEL_RUN_FAILED on
its own input sets (bench.heldout_vision_audio: data2vec_audio under all three exporters)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.config import Tolerance
from core.inputs import analyze, generate_input_sets
from workers.verify import Verifier

# (kernel, stride) of each convolution: data2vec-audio's first three layers
STACK = ((10, 5), (3, 2), (3, 2))
CHANNELS = 8


def _channels_last_norm_encoder() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    nodes = [helper.make_node("Unsqueeze", ["input_values", "axis1"], ["x0"])]
    current, cin = "x0", 1
    for i, (kernel, stride) in enumerate(STACK):
        inits += [
            numpy_helper.from_array(rng.standard_normal((CHANNELS, cin, kernel)).astype(np.float32), f"w{i}"),
            numpy_helper.from_array((1 + 0.1 * rng.standard_normal(CHANNELS)).astype(np.float32), f"g{i}"),
            numpy_helper.from_array((0.1 * rng.standard_normal(CHANNELS)).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node("Conv", [current, f"w{i}"], [f"c{i}"], kernel_shape=[kernel], strides=[stride]),
            helper.make_node("Transpose", [f"c{i}"], [f"t{i}"], perm=[0, 2, 1]),
            helper.make_node("LayerNormalization", [f"t{i}", f"g{i}", f"b{i}"], [f"n{i}"], axis=-1),
            helper.make_node("Transpose", [f"n{i}"], [f"u{i}"], perm=[0, 2, 1]),
            helper.make_node("Sigmoid", [f"u{i}"], [f"s{i}"]),
            helper.make_node("Mul", [f"u{i}", f"s{i}"], [f"a{i}"]),
        ]
        current, cin = f"a{i}", CHANNELS
    inits.append(numpy_helper.from_array(rng.standard_normal((CHANNELS, 16)).astype(np.float32), "proj"))
    nodes += [
        helper.make_node("Transpose", [current], ["frames"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["frames", "proj"], ["hidden"]),
    ]
    graph = helper.make_graph(
        nodes,
        "channels_last_norm_audio",
        [helper.make_tensor_value_info("input_values", TensorProto.FLOAT, ["batch", "samples"])],
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "sequence", 16])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _min_samples() -> int:
    length = 1
    for kernel, stride in reversed(STACK):
        length = (length - 1) * stride + kernel
    return length


def test_audio_is_sized_for_every_convolution_when_layernorms_sit_between_transposes(tmp_path: Path) -> None:
    model = _channels_last_norm_encoder()
    role = analyze(model).roles["input_values"]
    assert role.role == "audio"
    assert [(s.kernel[0], s.stride[0]) for s in role.convs] == list(STACK)
    assert role.min_length() == _min_samples() == 40
    # one sample short of the stack's minimum is what ORT refuses: the bound is the real one
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    session.run(None, {"input_values": np.zeros((1, _min_samples()), np.float32)})
    with pytest.raises(Exception, match="Conv"):
        session.run(None, {"input_values": np.zeros((1, _min_samples() - 1), np.float32)})

    path = tmp_path / "audio.onnx"
    onnx.save(model, str(path))
    sets = generate_input_sets(model, 3)
    assert all(s.feeds["input_values"].shape[1] >= _min_samples() for s in sets)
    assert len({s.feeds["input_values"].shape for s in sets}) > 1  # several shapes, not the minimum alone
    assert Verifier(path, sets, Tolerance()).check(path).ok  # every set runs the original
    assert f">= {_min_samples()} samples" in sets[0].provenance["inputs"]["input_values"]["why"]
