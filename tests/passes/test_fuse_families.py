"""fuse_transformer's family and size detection on exports of architectures it was not written for (issue 17).

Audio encoders (Whisper's, wav2vec2) were "family unknown" (no embedding table of a known family), so
their attention was never tried although onnxscript's rules match it. TorchScript exports split heads with
a run-time shape, so the head count read from q's shape was 0, and ORT's optimizer asserts on it for ViT.
The audio and DeBERTa exports are the committed corpus's (transformers configs, the exporter users run);
numerics are checked against the export at batch sizes other than its 2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import pytest

from passes._infra import PassContext, op_histogram
from passes.fusion._fusion_families import detect_family, detect_sizes
from passes.fusion.fuse_transformer import FuseTransformer
from tests.models import corpus
from tests.passes._util import session

LAYERS = 2
BATCHES = (1, 3)

pytestmark = pytest.mark.filterwarnings("ignore")


def _inferred(path: Path) -> ir.Model:
    model = ir.serde.deserialize_model(onnx.load(path))
    common_passes.ShapeInferencePass()(model)
    return model


@pytest.mark.parametrize("exporter", corpus.EXPORTERS)
def test_detect_sizes_reads_heads_from_the_head_split_when_torchscript_leaves_them_unknown(exporter):
    """TorchScript: ``Reshape(q[B,S,32], Concat(B, S, -1, 8))``, so heads = 32 / 8; dynamo: q's shape."""
    model = _inferred(corpus.committed_path("vit", exporter))
    assert detect_sizes(model) == (4, 32)


def test_ort_candidate_is_verified_when_vit_torchscript_export():
    """ORT's vit fusions assert that the heads are given; with 0 the candidate failed."""
    model = ir.serde.deserialize_model(onnx.load(corpus.committed_path("vit", "ts_eager")))
    result = FuseTransformer({"engines": ["ort"]})(model, PassContext(samples=[]))
    report = result.notes["candidates"]["ort"]
    assert report["verified"], report.get("error")
    assert result.notes["num_heads"] == 4 and result.modified


@pytest.fixture(scope="module")
def audio_exports() -> dict[tuple[str, str], Path]:
    """The committed corpus exports (tests/models/corpus: no torch needed)."""
    built = {}
    for arch in ("whisper_encoder", "wav2vec2"):
        for exporter in ("ts_eager", "ts_sdpa"):
            path = corpus.committed_path(arch, exporter)
            assert path.exists(), f"{path.name} is committed: python -m tests.models.corpus --size tiny"
            built[arch, exporter] = path
    return built


AUDIO = [("whisper_encoder", "whisper"), ("wav2vec2", "wav2vec2")]


@pytest.mark.parametrize("exporter", ["ts_eager", "ts_sdpa"])
@pytest.mark.parametrize(("arch", "family"), AUDIO)
def test_fuse_transformer_fuses_attention_when_audio_encoder_export(audio_exports, arch, family, exporter):
    path = audio_exports[arch, exporter]
    detected, evidence = detect_family(_inferred(path))
    assert detected == family, evidence
    result = FuseTransformer()(ir.serde.deserialize_model(onnx.load(path)), PassContext(samples=[]))
    assert result.modified, [m.reason for m in result.non_matches]
    ops = op_histogram(result.model)
    assert result.counts["fused_attention"] == LAYERS
    assert "Softmax" not in ops
    assert "attention" not in result.notes["missing"]
    reference, candidate = session(str(path)), session(result.model)
    for batch in BATCHES:
        feed = corpus.feeds(arch, "tiny", batch, 23, seed=batch)  # 23: a raw-audio length not exported
        for want, got in zip(reference.run(None, feed), candidate.run(None, feed), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{arch} {exporter} batch {batch}")


def test_residual_norms_fuse_when_upstream_reshape_moved_gpt2_dynamo_flattens_above_them():
    """GPT-2's dynamo export flattens before each Conv1D's ``addmm``; upstream_reshape moves that flatten
    above ``ln_1``/``ln_2``/``ln_f`` and stops at the residual Add, so the norm read a Reshape and only 1 of
    4 residual norms fused. fuse_transformer now sinks the flatten below the norm again."""
    from passes.cleanup.shape_inference import ShapeInference
    from passes.compute_order.upstream_reshape import UpstreamReshape

    path = corpus.committed_path("gpt2", "dynamo")
    model = ir.serde.deserialize_model(onnx.load(path))
    ctx = PassContext(samples=[])
    ShapeInference()(model, ctx)
    assert UpstreamReshape()(model, ctx).counts["reshapes_moved"] > 0
    flattened = [
        n for n in model.graph if n.op_type == "LayerNormalization" and n.inputs[0].producer().op_type == "Reshape"
    ]
    assert len(flattened) >= 3  # the form this test is about
    result = FuseTransformer()(model, ctx)
    assert result.counts["fused_skip_layer_norm"] == 2 * LAYERS, result.notes.get("missing")
    assert result.counts["fused_attention"] == LAYERS
    assert result.notes["candidates"]["onnxscript"]["norm_flattens_sunk"] == len(flattened)
    reference, candidate = session(str(path)), session(result.model)
    for batch, seq in ((1, 5), (3, 37)):  # the export's is 2 x 16
        feed = corpus.feeds("gpt2", "tiny", batch, seq, seed=seq, pad=True)
        for want, got in zip(reference.run(None, feed), candidate.run(None, feed), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"gpt2 dynamo {batch}x{seq}")


@pytest.mark.parametrize("exporter", ["ts_eager", "dynamo"])  # transformers has no SDPA DeBERTa-v2
def test_fuse_transformer_fuses_attention_when_deberta_bmm_heads_and_where_mask(exporter):
    """DeBERTa-v2 folds heads into the batch (``torch.bmm`` on ``[B*h, S, d]``), scales k by a run-time
    ``sqrt(q.size(-1))`` and masks with ``masked_fill`` (``Where``): onnxscript matched none of it. The folds
    are dropped (``_batched_heads``), the scale folded, the mask made additive (``_where_mask``)."""
    path = corpus.committed_path("deberta_v2", exporter)
    result = FuseTransformer({"engines": ["onnxscript"]})(
        ir.serde.deserialize_model(onnx.load(path)), PassContext(samples=[])
    )
    report = result.notes["candidates"]["onnxscript"]
    assert report["bmm_unfolded"] == 2 * LAYERS and report["where_masks"] == LAYERS
    ops = op_histogram(result.model)
    assert result.counts["fused_attention"] == LAYERS and "Softmax" not in ops
    reference, candidate = session(str(path)), session(result.model)
    for batch, seq in ((1, 5), (3, 37)):  # the export's is 2 x 16
        feed = corpus.feeds("deberta_v2", "tiny", batch, seq, seed=seq, pad=True)
        for want, got in zip(reference.run(None, feed), candidate.run(None, feed), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"deberta {exporter} {batch}x{seq}")


def test_detect_family_says_no_attention_when_every_softmax_is_a_gate():
    # PatchTSMixer's "gated attention" (x * Softmax(Linear(x))) beside LayerNorms: the report said "attention
    # found, but no embedding structure of a known family", and a table counting Softmax expected 4 attentions.
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "gate_w"),
        numpy_helper.from_array(np.ones(8, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(8, np.float32), "beta"),
    ]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["normed"], axis=-1),
        helper.make_node("MatMul", ["normed", "gate_w"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["gate"], axis=-1),
        helper.make_node("Mul", ["normed", "gate"], ["y"]),
    ]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "gated", [value("x", TensorProto.FLOAT, ["b", 4, 8])], [value("y", TensorProto.FLOAT, None)], inits
    )
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    family, why = detect_family(model)
    assert family == "unknown" and "no attention block" in why and "gated attention" in why


def test_detect_family_reads_attention_written_with_einsums():
    # XLNet's attention (``einsum("ibnd,jbnd->bnij", q, k)``, then ``einsum("bnij,jbnd->ibnd", probs, v)``, as
    # Keras's MultiHeadAttention writes it too): the family was "unknown", so nothing fused, not even its GELU
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32) / 3, f"w_{name}") for name in "qkvo"
    ] + [
        numpy_helper.from_array(np.ones(8, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(8, np.float32), "beta"),
        numpy_helper.from_array(np.array([0, 0, 2, 4], np.int64), "heads"),  # [i, b, 2 heads, 4]
        numpy_helper.from_array(np.array([0, 0, 8], np.int64), "merged"),
    ]
    nodes = [helper.make_node("MatMul", ["x", f"w_{name}"], [f"{name}_flat"]) for name in "qkv"]
    nodes += [helper.make_node("Reshape", [f"{name}_flat", "heads"], [name]) for name in "qkv"]
    nodes += [
        helper.make_node("Einsum", ["q", "k"], ["scores"], equation="ibnd,jbnd->bnij"),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("Einsum", ["probs", "v"], ["context"], equation="bnij,jbnd->ibnd"),
        helper.make_node("Reshape", ["context", "merged"], ["context_flat"]),
        helper.make_node("MatMul", ["context_flat", "w_o"], ["attended"]),
        helper.make_node("Add", ["attended", "x"], ["residual"]),
        helper.make_node("LayerNormalization", ["residual", "gamma", "beta"], ["y"], axis=-1),
    ]
    value = helper.make_tensor_value_info
    inputs, outputs = [value("x", TensorProto.FLOAT, ["s", "b", 8])], [value("y", TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "einsum_attention", inputs, outputs, inits)
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    family, why = detect_family(model)
    assert family != "unknown" and "is a Softmax of a product of two activations (attention)" in why
