"""Raw audio sized from a convolution stack that ORT's quantizers rewrote (issue 17, converted uploads).

A wav2vec2 sent after ``quantize_dynamic`` reaches its feature encoder through ``DynamicQuantizeLinear ->
ConvInteger``, and after ``quantize_static`` (QDQ) through ``QuantizeLinear -> DequantizeLinear -> Conv`` whose
weight is a ``DequantizeLinear`` of an int8 constant. The walk stopped at the first of those ops, so the audio
was sized as if there were no convolution (8 samples) and the job failed before any pass ("the original model
fails on input set 'input_values=1x8'"). Both forms now give the float model's 400-sample minimum.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, quantize_static

from core.inputs import analyze
from tests.core.test_inputs import verified_sets

WAV2VEC2 = Path(__file__).resolve().parent.parent / "models" / "roles_wav2vec2.onnx"


class _Audio(CalibrationDataReader):
    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.sets = iter([{"input_values": rng.standard_normal((1, 1600), dtype=np.float32)} for _ in range(4)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.sets, None)


@pytest.fixture(scope="module", params=["int8_dynamic", "qdq_static"])
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp("quantized") / f"{request.param}.onnx"
    if request.param == "int8_dynamic":
        quantize_dynamic(str(WAV2VEC2), str(path), weight_type=QuantType.QInt8, op_types_to_quantize=["Conv"])
    else:
        quantize_static(str(WAV2VEC2), str(path), _Audio(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["Conv"])
    return request.param, path


def test_quantized_wav2vec2_audio_is_sized_from_its_rewritten_conv_stack(quantized) -> None:
    form, path = quantized
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert ("ConvInteger" in ops) if form == "int8_dynamic" else ("DequantizeLinear" in ops and "Conv" in ops)
    float_role = analyze(onnx.load(str(WAV2VEC2))).roles["input_values"]
    role = analyze(onnx.load(str(path))).roles["input_values"]
    assert role.role == "audio" and role.min_length() == float_role.min_length() == 400
    sets = verified_sets(path)  # the quantized upload runs on every generated set
    assert all(s.feeds["input_values"].shape[1] >= 400 for s in sets)
