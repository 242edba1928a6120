"""A float16 decoder converted the way ORT's tools convert one (``onnxruntime.transformers.float16``,
``keep_io_types=True``), sent with padded samples: fuse_gqa falls back to MultiHeadAttention and guards its
output against the NaN rows of fully masked queries (``_nan_guard.zero_nan_rows``).

The guard's zero was a float32 constant whenever the fused op's output carried no type (a new node's output):
``Where(IsNaN(y), 0.0f, y)`` beside a float16 ``y`` is a graph ORT refuses to load ("Type parameter (T) of
Optype (Where) bound to different types"), so fuse_gqa was rolled back and fuse_transformer failed on the
held-out probe (bench/README.md, stop 32). The zero now takes the attention's float type.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnxruntime.transformers.float16 import convert_float_to_float16

from core.config import HALF_PRECISION_FLOOR
from passes import registry
from passes._infra import PassContext, op_histogram
from tests.numerics import reference_session, run_named

LLAMA = Path(__file__).resolve().parent.parent / "models" / "corpus" / "llama_dynamo.onnx"
TOL = HALF_PRECISION_FLOOR["float16"]


def _feeds(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[-1, seq // 2 :] = 0  # the last row padded: GroupQueryAttention does not fit
    return {"input_ids": rng.integers(3, 200, (batch, seq), dtype=np.int64), "attention_mask": mask}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fp16") / "llama_fp16.onnx"
    onnx.save(convert_float_to_float16(onnx.load(str(LLAMA)), keep_io_types=True), str(path))
    return path


@pytest.fixture(scope="module")
def fused(converted: Path) -> ir.Model:
    """The fast preset's passes through fuse_gqa, with padded samples as a job synthesizes them."""
    specs = registry.PRESETS["fast"].specs
    upto = [s for s in specs[: [s.name for s in specs].index("fuse_gqa") + 1] if s.name != "padding_elimination"]
    model, ctx = ir.load(converted), PassContext(samples=[_feeds(2, 8, 0)])
    for p in registry.build_passes(upto):
        model = p(model, ctx).model
    return model


def test_guarded_multi_head_attention_of_a_float16_decoder_loads_and_is_typed(fused: ir.Model) -> None:
    ops = op_histogram(fused)
    assert ops["com.microsoft::MultiHeadAttention"] == 2 and "Softmax" not in ops
    guards = [n for n in fused.graph if n.op_type == "Where" and n.inputs[0].producer().op_type == "IsNaN"]
    assert len(guards) == 2
    for where in guards:
        zero = where.inputs[1].producer().attributes["value"].as_tensor()
        assert zero.dtype == ir.DataType.FLOAT16
    reference_session(fused)  # ORT refused the float32 zero


@pytest.mark.parametrize(("batch", "seq"), [(1, 5), (3, 13)])
def test_float16_guarded_decoder_matches_the_upload_on_valid_tokens(converted: Path, fused, batch, seq) -> None:
    feeds = _feeds(batch, seq, seed=batch + seq)
    want = run_named(reference_session(converted), feeds)["logits"]
    got = run_named(reference_session(fused), feeds)["logits"]
    valid = feeds["attention_mask"].astype(bool)
    assert np.isfinite(got[valid]).all()
    np.testing.assert_allclose(got[valid], want[valid], atol=TOL, rtol=TOL)
