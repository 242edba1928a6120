"""GLM-4 MoE's partial rotary keeps its fusions (issues 17/19, held-out decoders, round 4).

GLM rotates the first half of each head (``q[..., :d]``) and concatenates the rest. fuse_rotary fuses the
rotation of the slice; onnxscript's ``partial_rotary_embedding`` rule then merges Slice, rotation and Concat into
``RotaryEmbedding(x, rotary_embedding_dim=d)`` with the inner node's attributes, and a full rotation of a 4-D slice
carries no ``num_heads``. ORT refuses to build that node ("num_heads must be provided if rotary_embedding_dim is
specified"), so on the TorchScript export (heads written as -1 in the view: a symbolic dim) the whole onnxscript
candidate failed to load. The merged rotation now gets its heads from the attention it feeds (``_rotary_heads``).

``tests/models/heldout/glm4_moe_past_ts.onnx``: ``python -m bench.heldout_dec_round4 --only glm4_moe --forms past
--exporters ts_eager --presets --tiny`` (2 layers, hidden 32, 4 heads of 8 with 2 kv heads, rotary over half of
each head, q/k norms, 4 experts top-2 after one dense layer, Optimum's signature).
"""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
import pytest

from passes._infra import PassContext
from passes.fusion import _rotary_heads
from passes.fusion.fuse_transformer import FuseTransformer
from tests.passes._decoder_replay import assert_decodes_like_export, fast_upto
from tests.passes._util import parse

PATH = Path(__file__).resolve().parent.parent / "models" / "heldout" / "glm4_moe_past_ts.onnx"
LAYERS, HEADS, KV_HEADS = 2, 4, 2


def test_the_merged_partial_rotations_carry_their_heads_and_the_candidate_loads() -> None:
    model, _ = fast_upto(PATH)
    result = FuseTransformer({"engines": ["onnxscript"]})(model, PassContext())
    assert not any("rejected" in n.reason for n in result.non_matches), [n.reason for n in result.non_matches]
    rotations = [n for n in result.model.graph if n.op_type == "RotaryEmbedding"]
    assert len(rotations) == 2 * LAYERS
    for node in rotations:
        assert node.attributes.get_int("rotary_embedding_dim", 0) > 0
        assert node.attributes.get_int("num_heads", 0) in (HEADS, KV_HEADS)
    assert sorted(n.attributes.get_int("num_heads", 0) for n in rotations) == [KV_HEADS] * LAYERS + [HEADS] * LAYERS
    assert_decodes_like_export(PATH, result.model)


GRAPH = """
<ir_version: 9, opset_import: ["" : 18, "com.microsoft" : 1]>
g (float[B, N, S, 8] x, int64[B, S] pos, float[16, 2] cos, float[16, 2] sin, float[B, S, 24] k, float[B, S, 24] v)
  => (float[B, S, 24] o) {
    shape = Constant <value = int64[3] {0, 0, 24}> ()
    r = com.microsoft.RotaryEmbedding <interleaved = 0> (x, pos, cos, sin)
    t = Transpose <perm = [0, 2, 1, 3]> (r)
    y = Reshape(t, shape)
    o = %s
}
"""


@pytest.mark.parametrize(
    ("consumer", "heads"),
    [
        ("com.microsoft.MultiHeadAttention <num_heads = 3> (y, k, v)", 3),
        ("com.microsoft.GroupQueryAttention <num_heads = 6, kv_num_heads = 3> (k, y, v)", 3),
        ("Relu(y)", None),
    ],
)
def test_heads_are_read_from_the_attention_the_rotation_feeds(consumer: str, heads: int | None) -> None:
    model = ir.serde.deserialize_model(parse(GRAPH % consumer, check=False))
    rotation = next(n for n in model.graph if n.op_type == "RotaryEmbedding")
    assert _rotary_heads.heads(rotation.inputs[0], rotation.outputs[0]) == heads
