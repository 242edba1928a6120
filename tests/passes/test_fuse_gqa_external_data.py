"""fuse_gqa on a decoder whose weights live in an external-data file (every model over the protobuf limit,
Qwen2.5-0.5B in fp32 included): its probes load the weights from the model's folder, so it fuses as it does
in memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from passes._infra import PassContext, op_histogram
from passes.fusion.fuse_gqa import FuseGqa
from passes.fusion.fuse_rotary import FuseRotary

DECODERS = Path(__file__).resolve().parents[1] / "models" / "decoders"


def _feeds(batch: int, seq: int, past: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seq + past)
    return {
        "input_ids": rng.integers(0, 100, size=(batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, past + seq), np.int64),
        "position_ids": np.broadcast_to(np.arange(past, past + seq), (batch, seq)).astype(np.int64),
    }


def test_fuse_gqa_fuses_every_layer_when_the_weights_are_external(tmp_path: Path) -> None:
    source = ir.load(DECODERS / "llama_past_ts.onnx")
    ir.save(source, tmp_path / "model.onnx", external_data="model.onnx.data", size_threshold_bytes=0)
    model = ir.load(tmp_path / "model.onnx")
    assert any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())

    model = FuseRotary()(model, PassContext()).model
    result = FuseGqa()(model, PassContext())

    assert result.modified, result.non_matches
    assert op_histogram(result.model).get("com.microsoft::GroupQueryAttention") == 2
    assert "Softmax" not in op_histogram(result.model)
    fused = tmp_path / "fused.onnx"
    ir.save(result.model, fused, external_data="fused.onnx.data", size_threshold_bytes=1024)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    reference = ort.InferenceSession(str(DECODERS / "llama_past_ts.onnx"), options)
    candidate = ort.InferenceSession(str(fused), options)
    past = {i.name: i.shape for i in reference.get_inputs() if i.name.startswith("past_key_values")}
    for batch, seq, length in ((1, 5, 0), (2, 1, 7)):
        feeds = _feeds(batch, seq, length)
        for name, shape in past.items():
            dims = [batch, shape[1], length, shape[3]]
            feeds[name] = np.random.default_rng(len(name)).standard_normal(dims).astype(np.float32)
        want, got = reference.run(None, feeds), candidate.run(None, feeds)
        for a, b in zip(want, got, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_fuse_gqa_fuses_when_the_weights_in_memory_are_past_the_protobuf_limit(monkeypatch) -> None:
    """The pipeline loads a large upload's weights into memory, where a session cannot be built from bytes
    (protobuf's 2 GB): the probes write the model out once instead. The limit is lowered to take that path."""
    from passes.fusion import _gqa_probe

    monkeypatch.setattr(_gqa_probe, "PROTOBUF_SAFE_BYTES", 0)
    model = FuseRotary()(ir.load(DECODERS / "llama_past_ts.onnx"), PassContext()).model

    result = FuseGqa()(model, PassContext())

    assert result.modified, result.non_matches
    assert op_histogram(result.model).get("com.microsoft::GroupQueryAttention") == 2
