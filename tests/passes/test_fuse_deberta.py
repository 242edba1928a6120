"""DeBERTa-v3's disentangled attention (issue 17 item 2: relative position bias as ``attention_bias``).

DeBERTa-v3 (``relative_attention``, ``pos_att_type=["p2c", "c2p"]``, log-bucketed positions, shared q/k
projections of the relative embeddings) adds its relative terms to the folded ``[B*h, S, S]`` scores before
they are unfolded for the mask::

    Reshape(Add(MatMul(q3, kT3 / sqrt(3d)), Add(c2p / sqrt(3d), p2c / sqrt(3d))), [B, h, S, S])

so the product's reader was the Add and ``_batched_heads`` left the product folded: no attention fused
(Softmax left). ``distribute_unfolds`` unfolds each term instead; the relative terms then reach
``MultiHeadAttention`` as its ``attention_bias`` with the mask folded in. The exports are the committed
corpus's (transformers config, the exporters users run); numerics are checked at shapes other than the
export's 2 x 16, and at sequences past the tiny config's 16 position buckets (the log-bucketed positions).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import pytest

from passes._infra import PassContext, op_histogram
from passes.fusion._attention_bias import drop_noop_bias_expands
from passes.fusion._batched_heads import distribute_unfolds, unfold_batched_heads
from passes.fusion._fusion_families import detect_family
from passes.fusion.fuse_transformer import FuseTransformer
from tests.models import corpus
from tests.passes._util import parse, session

LAYERS = 2
SHAPES = ((1, 5), (3, 37), (2, 70))  # the export's is 2 x 16; 37 and 70 reach the log buckets (> 16 / 2)
_ATTENTION_BIAS = 5  # MultiHeadAttention's input: query, key, value, bias, key_padding_mask, attention_bias

pytestmark = pytest.mark.filterwarnings("ignore")


def _load(exporter: str) -> ir.Model:
    path = corpus.committed_path("deberta_v3", exporter)
    assert path.exists(), f"{path.name} is committed: python -m tests.models.corpus --committed --only deberta_v3"
    return ir.serde.deserialize_model(onnx.load(path))


@pytest.mark.parametrize("exporter", ["ts_eager", "dynamo"])  # transformers has no SDPA DeBERTa-v2
def test_fuse_transformer_fuses_attention_with_relative_terms_as_attention_bias_when_deberta_v3(exporter):
    original = _load(exporter)
    assert sum(n.op_type == "GatherElements" for n in original.graph) == 2 * LAYERS  # c2p and p2c per layer
    result = FuseTransformer({"engines": ["onnxscript"]})(_load(exporter), PassContext(samples=[]))
    assert result.modified, [m.reason for m in result.non_matches]
    report = result.notes["candidates"]["onnxscript"]
    assert report["verified"], report.get("error")
    assert report["bmm_unfolded"] == 2 * LAYERS and report["where_masks"] == LAYERS
    ops = op_histogram(result.model)
    assert result.counts["fused_attention"] == LAYERS and "Softmax" not in ops
    assert "attention" not in result.notes["missing"]
    fused = [n for n in result.model.graph if n.op_type in ("MultiHeadAttention", "Attention")]
    assert len(fused) == LAYERS
    for node in fused:
        bias = node.inputs[_ATTENTION_BIAS] if node.op_type == "MultiHeadAttention" else node.inputs[5]
        assert bias is not None and bias.const_value is None  # computed: relative terms + mask
        assert bias.producer().op_type != "Expand"  # sdpa_via_mha's copy of a [B, h, S, T] bias is dropped
        assert node.attributes.get_float("scale", 0.0) == pytest.approx(1 / np.sqrt(3 * 8))  # sqrt(d * 3)
    # the relative terms are still computed: the bias is not the mask alone
    assert sum(n.op_type == "GatherElements" for n in result.model.graph) == 2 * LAYERS
    reference = session(str(corpus.committed_path("deberta_v3", exporter)))
    candidate = session(result.model)
    for batch, seq in SHAPES:
        feed = corpus.feeds("deberta_v3", "tiny", batch, seq, seed=seq, pad=True)
        for want, got in zip(reference.run(None, feed), candidate.run(None, feed), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"deberta_v3 {exporter} {batch}x{seq}")


@pytest.mark.parametrize("exporter", ["ts_eager", "dynamo"])
def test_detect_family_reads_a_word_embedding_normalized_at_once_as_bert_like_when_deberta_v3(exporter):
    """No absolute positions and no token types: one embedding table, its lookup normalized at once."""
    model = _load(exporter)
    common_passes.ShapeInferencePass()(model)
    family, evidence = detect_family(model)
    assert family == "distilbert" and "one embedding table" in evidence


# The folded scores plus a relative term, unfolded with a shape computed from the sum (TorchScript's form).
REL = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[B, 4, S, 8] q, float[B, 4, S, 8] k, float[%s] rel) => (float[B, 4, S, S] out%s)
  <int64[1] minus_one = {-1}, int64[1] eight = {8}, float scale = {4.898979}, int64[1] one = {1},
   int64[1] two = {2}, int64[1] three = {3}, int64[1] heads = {4}> {
    seq = Shape <start = 2, end = 3> (q)
    fold = Concat <axis = 0> (minus_one, seq, eight)
    qf = Reshape(q, fold)
    kf = Reshape(k, fold)
    kt = Transpose <perm = [0, 2, 1]> (kf)
    ks = Div(kt, scale)
    s3 = MatMul(qf, ks)
    total = Add(s3, rel)
    sh = Shape(total)
    s1 = Slice(sh, one, two)
    s2 = Slice(sh, two, three)
    target = Concat <axis = 0> (minus_one, heads, s1, s2)
    y = Reshape(total, target)
    out = Identity(y)%s
}
"""


def _rel_model(rel_dims: str, also_read: bool = False) -> tuple[str, ir.Model]:
    """The graph, annotated as symbolic shape inference annotates it (run-time shapes resolved)."""
    text = REL % (rel_dims, ", float[B4, S, S] seen" if also_read else "", "\n    seen = Neg(total)" * also_read)
    model = ir.serde.deserialize_model(parse(text, check=False))
    common_passes.ShapeInferencePass()(model)
    values = {v.name: v for n in model.graph for v in n.outputs}
    for name, dims in {
        "qf": ["B4", "S", 8],
        "kf": ["B4", "S", 8],
        "kt": ["B4", 8, "S"],
        "ks": ["B4", 8, "S"],
        "s3": ["B4", "S", "S"],
        "total": ["B4", "S", "S"],
        "y": ["B", 4, "S", "S"],
    }.items():
        values[name].shape = ir.Shape(dims)
    return text, model


def _feeds(batch: int, seq: int, rel_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seq)
    feeds = {n: rng.standard_normal((batch, 4, seq, 8), dtype=np.float32) for n in ("q", "k")}
    feeds["rel"] = rng.standard_normal(rel_shape, dtype=np.float32)
    return feeds


def test_unfold_is_distributed_over_a_relative_term_of_the_folded_shape_and_the_product_made_4d():
    text, model = _rel_model("B4, S, S")
    assert unfold_batched_heads(model) == 1
    ops = [n.op_type for n in model.graph]
    [matmul] = [n for n in model.graph if n.op_type == "MatMul"]
    assert matmul.inputs[0].name == "q" and len(matmul.outputs[0].shape) == 4  # no fold left on the product
    [add] = [n for n in model.graph if n.op_type == "Add"]
    assert matmul.outputs[0] in add.inputs  # the 4-D scores plus the unfolded relative term
    assert ops.count("Reshape") == 1  # the relative term's unfold; q's, k's folds and the sum's are gone
    reference, candidate = session(ir.serde.deserialize_model(parse(text, check=False))), session(model)
    for batch, seq in ((1, 3), (3, 11), (2, 40)):
        feeds = _feeds(batch, seq, (batch * 4, seq, seq))
        np.testing.assert_array_equal(candidate.run(None, feeds)[0], reference.run(None, feeds)[0])


def test_unfold_is_not_distributed_when_the_relative_term_broadcasts():
    """``[1, S, S]`` has fewer elements than the folded scores: it cannot be unfolded to ``[B, h, S, S]``."""
    _, model = _rel_model("1, S, S")
    assert distribute_unfolds(model) == 0
    assert unfold_batched_heads(model) == 0


def test_unfold_is_not_distributed_when_the_sum_has_another_reader():
    _, model = _rel_model("B4, S, S", also_read=True)
    assert distribute_unfolds(model) == 0
    assert any(n.op_type == "Reshape" and n.outputs[0].name == "y" for n in model.graph)


EXPAND = """
<ir_version: 9, opset_import: ["" : 18, "com.microsoft" : 1]>
g (float[B, S, 32] q, float[B, S, 32] k, float[B, S, 32] v, float[B, 4, S, 8] q4, float[%s] bias) => (float[B, S, 32] y)
  <int64[1] one = {1}> {
    s = Shape <start = 2, end = 3> (q4)
    shape = Concat <axis = 0> (one, one, s, one)
    full = Expand(bias, shape)
    y = com.microsoft.MultiHeadAttention <num_heads = 4> (q, k, v, , , full)
}
"""


@pytest.mark.parametrize(("bias_dims", "dropped"), [("B, 4, S, S", True), ("B, 1, S, S", True), ("B, 1, 1, S", False)])
def test_drop_noop_bias_expands_only_where_the_bias_already_has_the_query_length(bias_dims, dropped):
    """``Expand(bias, [1, 1, S, 1])`` is the identity where the bias's dim 2 is S; a ``[B, 1, 1, T]`` padding
    mask is broadcast over the queries by it and keeps it."""
    text = EXPAND % bias_dims
    model = ir.serde.deserialize_model(parse(text, check=False))
    common_passes.ShapeInferencePass()(model)
    assert drop_noop_bias_expands(model) == int(dropped)
    assert any(n.op_type == "Expand" for n in model.graph) != dropped
    reference, candidate = session(ir.serde.deserialize_model(parse(text, check=False))), session(model)
    for batch, seq in ((1, 3), (2, 9)):
        rng = np.random.default_rng(seq)
        feeds = {n: rng.standard_normal((batch, seq, 32), dtype=np.float32) for n in ("q", "k", "v")}
        feeds["q4"] = rng.standard_normal((batch, 4, seq, 8), dtype=np.float32)
        dims = [batch if d == "B" else seq if d == "S" else int(d) for d in bias_dims.split(", ")]
        feeds["bias"] = rng.standard_normal(dims, dtype=np.float32)
        np.testing.assert_array_equal(candidate.run(None, feeds)[0], reference.run(None, feeds)[0])
