"""quantize_static: QDQ structure with MinMax/Entropy/Percentile calibration on samples, int8 numerics,
chunked calibration over samples of mixed shapes, the accuracy loop, and refusal without samples."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from core.errors import InvalidPassOptionsError
from passes._infra import PassContext
from passes.precision import _accuracy
from passes.precision.quantize_static import QuantizeStatic
from tests.models.build_hf import make_inputs
from tests.passes.test_quantize_dynamic import BERT, bert_samples, outlier_model, outlier_samples, run


def ops(model: ir.Model) -> Counter:
    return Counter(n.op_type for n in model.graph)


def quantize(options=None, samples=None):
    model = ir.load(BERT)
    result = QuantizeStatic(options)(model, PassContext(samples=bert_samples() if samples is None else samples))
    return model, result


@pytest.mark.parametrize("method", ["MinMax", "Percentile", "Entropy"])
def test_qdq_calibrated_on_samples(method):
    original, result = quantize({"calibrate_method": method})
    assert result.modified and result.model is not original
    after = ops(result.model)
    assert after["QuantizeLinear"] > 0 and after["DequantizeLinear"] > after["QuantizeLinear"]
    assert after["MatMul"] == ops(original)["MatMul"] == 16  # QDQ keeps the float op between DQ and Q
    assert result.counts["nodes_quantized"] == 16
    for node in result.model.graph:
        if node.op_type == "DequantizeLinear" and node.inputs[0].const_value is not None:
            assert node.inputs[0].const_value.dtype == ir.DataType.INT8  # weights stored as int8
    notes = result.notes
    assert notes["format"] == "QDQ" and notes["calibrate_method"] == method and notes["calibration_samples"] == 3
    assert notes["ranges"]["tensors"] > 0 and notes["ranges"]["widest"][0]["max"] > 0
    proto, quantized = ir.serde.serialize_model(original), ir.serde.serialize_model(result.model)
    onnx.checker.check_model(quantized, full_check=True)
    for i, (b, s) in enumerate([(1, 9), (3, 20)]):
        feeds = make_inputs("bert_encoder", b, s, pad_fraction=0.2, seed=20 + i, size="tiny")
        assert _accuracy.compare_arrays(run(proto, feeds)[0], run(quantized, feeds)[0]).cosine >= 0.99


def test_percentile_ranges_are_symmetric_and_not_wider_than_minmax():
    _, minmax = quantize({"calibrate_method": "MinMax"})
    _, pct = quantize({"calibrate_method": "Percentile", "percentile": 99.0})
    widest_mm = minmax.notes["ranges"]["widest"][0]
    widest_pct = pct.notes["ranges"]["widest"][0]
    assert widest_pct["min"] == pytest.approx(-widest_pct["max"])
    assert widest_pct["max"] - widest_pct["min"] <= widest_mm["max"] - widest_mm["min"]


def test_calibration_runs_in_same_shape_chunks():
    samples = bert_samples([(2, 8), (1, 16), (2, 8), (1, 16)])
    _, result = quantize({"calibrate_method": "Percentile", "calibration_chunk": 4}, samples=samples)
    assert result.modified and result.notes["calibration_chunk"] == 2  # two chunks of one shape each
    _, capped = quantize({"max_calibration_samples": 2}, samples=samples)
    assert capped.notes["calibration_samples"] == 2


def test_refused_without_samples():
    model, result = quantize(samples=[])
    assert not result.modified and result.model is not model
    assert "no calibration samples" in result.non_matches[0].reason
    assert "input_ids" in result.non_matches[0].reason
    # samples lacking an input count as none
    _, partial = quantize(samples=[{"input_ids": np.zeros((1, 4), np.int64)}])
    assert not partial.modified


def test_accuracy_loop_keeps_the_outlier_float():
    result = QuantizeStatic()(ir.serde.deserialize_model(outlier_model()), PassContext(samples=outlier_samples()))
    assert result.modified
    assert result.notes["accuracy_all_quantized"]["y_outlier"]["cosine"] < 0.99
    assert [e["node"] for e in result.notes["excluded_for_accuracy"]] == ["outlier"]
    producers = {v.name: n for n in result.model.graph for v in n.outputs}
    outlier = next(n for n in result.model.graph if n.name == "outlier")
    assert all(producers.get(v.name) is None or producers[v.name].op_type != "DequantizeLinear" for v in outlier.inputs)
    assert result.counts["nodes_quantized"] == 1


def test_unknown_exclusion_refused_and_options_validated():
    _, result = quantize({"nodes_to_exclude": ["bert.encoder.layer.0"]})
    assert not result.modified and "names no node" in result.non_matches[0].reason
    with pytest.raises(InvalidPassOptionsError):
        QuantizeStatic({"calibrate_method": "KL"})
    assert all(f.get("description") for f in QuantizeStatic.options_schema()["properties"].values())
