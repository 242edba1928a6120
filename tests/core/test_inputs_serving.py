"""core/inputs: the gate's serving-length set (``serving_input_set``), one full row at a length teams serve.

A ``fast`` artifact whose attention is fused ties with the upload on the generated sets' 8-32 tokens and pays at
256 (docs/coverage.md's bench table); the gate times such a tie once more on this set (workers/gate.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from core.config import Tolerance
from core.inputs import InputSynthesis, analyze, make_input_sets, serving_input_set
from workers.verify import Verifier

MODELS = Path(__file__).resolve().parent.parent / "models"


def _serving(name: str, length: int = 256):
    proto = onnx.load(str(MODELS / name))
    synthesis = InputSynthesis(proto)
    sets = make_input_sets(proto, count=3, synthesis=synthesis)
    return proto, sets, serving_input_set(synthesis, sets, length=length)


def test_serving_set_is_one_full_row_of_the_length_when_an_encoder_reads_token_ids() -> None:
    proto, _, serving = _serving("corpus/bert_ts_eager.onnx")
    assert serving is not None and serving.name.endswith("(serving length)")
    assert {k: v.shape for k, v in serving.feeds.items()} == dict.fromkeys(serving.feeds, (1, 256))
    assert serving.feeds["attention_mask"].all()  # one full row: no padding to leave undefined
    assert serving.feeds["input_ids"].max() < analyze(proto).roles["input_ids"].high
    assert serving.provenance["why"].startswith("a serving length: one row of 256 tokens")
    assert (
        Verifier(MODELS / "corpus/bert_ts_eager.onnx", [serving], Tolerance())
        .check(MODELS / "corpus/bert_ts_eager.onnx")
        .ok
    )


def test_serving_set_stays_within_the_position_table_and_keeps_the_eos_marker_when_bart_classifies() -> None:
    path = MODELS / "roles_bart_cls.onnx"
    proto, _, serving = _serving("roles_bart_cls.onnx")
    assert analyze(proto).max_positions == 66 and serving is not None
    ids = serving.feeds["input_ids"]
    assert ids.shape == (1, 64)  # the table's 66 rows less BART's 2-row offset
    assert ids[0, -1] == 2 and np.count_nonzero(ids == 2) == 1  # the EOS its head gathers, once, at the end
    Verifier(path, [serving], Tolerance())  # the original runs it (raises otherwise)


@pytest.mark.parametrize(
    "name",
    ["roles_gpt2_past.onnx", "roles_wav2vec2.onnx", "corpus/vit_ts_eager.onnx"],
    ids=["key-value cache", "raw audio", "pixels"],
)
def test_serving_set_is_none_when_the_model_has_no_token_sequence_to_lengthen(name: str) -> None:
    assert _serving(name)[2] is None


def test_serving_set_is_none_when_no_longer_than_the_generated_sets() -> None:
    assert _serving("corpus/bert_ts_eager.onnx", length=32)[2] is None
    assert _serving("corpus/bert_ts_eager.onnx", length=0)[2] is None


def test_image_serving_set_is_one_image_of_the_side_only_where_the_size_is_free(tmp_path: Path) -> None:
    """A graph that fixes the image size (the corpus ViT: its position table) has full-sized sets and no second
    look; the same model with its sides declared free but read by a convnet-style graph gets one image."""
    from onnx import TensorProto, helper, numpy_helper

    proto = onnx.load(str(MODELS / "corpus/vit_dynamo.onnx"))
    synthesis = InputSynthesis(proto)
    sets = make_input_sets(proto, count=3, synthesis=synthesis)
    assert serving_input_set(synthesis, sets, length=256, image_side=224) is None
    weight = numpy_helper.from_array(np.full((4, 3, 3, 3), 0.1, np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["pixel_values", "w"], ["c"], strides=[2, 2]),
            helper.make_node("GlobalAveragePool", ["c"], ["p"]),
            helper.make_node("Flatten", ["p"], ["out"]),
        ],
        "g",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 4])],
        [weight],
    )
    convnet = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    synthesis = InputSynthesis(convnet)
    sets = make_input_sets(convnet, count=3, synthesis=synthesis)
    assert max(s.feeds["pixel_values"].shape[-1] for s in sets) <= 32
    serving = serving_input_set(synthesis, sets, length=256, image_side=224)
    assert serving is not None and serving.name == "pixel_values=1x3x224x224 (serving size)"
    assert serving.provenance["why"].startswith("a serving size: one image of 224 x 224 pixels")
    assert serving_input_set(synthesis, sets, length=256, image_side=0) is None
    path = tmp_path / "convnet.onnx"
    onnx.save(convnet, path)
    assert Verifier(path, [serving], Tolerance()).check(path).ok
