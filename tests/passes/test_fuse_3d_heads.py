"""Attention on heads folded into the batch, sequence first, fuses to MultiHeadAttention (``_heads_3d``).

``F.multi_head_attention_forward`` with ``need_weights=True`` (``torch.nn.MultiheadAttention``'s default, WavLM)
multiplies ``[B*heads, S, d]`` heads folded from a ``[S, B, E]`` projection with ``bmm``; onnxscript's SDPA rule
reads 4-D heads only, so none fused (WavLM 0/2 under every exporter, bench/README.md). The exports are
``python -m tests.models.build_heldout_3d_heads`` (and ``nn.MultiheadAttention``'s ``need_weights=False`` path,
sequence first); each fused model is compared with the export under ORT with
optimizations off at shapes other than the export's (batch 2, 20 frames; batch 2, 5 tokens). fairseq's form (k and
v folded through a 4-D view, the padding mask a ``Where`` on the scores unfolded to 4-D) is FSMT's encoder,
``python -m tests.models.build_heldout_probe heldout_round11 fsmt`` (0/2 attention fused before, either exporter).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from passes._infra import PassContext, op_histogram
from passes.fusion._heads_3d import fuse_folded_heads
from passes.fusion.fuse_transformer import FuseTransformer
from tests.numerics import assert_equivalent
from tests.passes._util import MODELS, parse, session

HELDOUT = MODELS / "heldout"
HOP = 320  # samples per frame of WavLM's feature encoder


def _fused(path, options=None, samples=()) -> tuple[ir.Model, dict]:
    result = FuseTransformer(options or {})(ir.load(path), PassContext(samples=list(samples)))
    return result.model, result


@pytest.mark.parametrize("exporter", ["dynamo", "ts"])
def test_wavlm_gated_position_bias_attention_fuses_exactly(exporter):
    path = HELDOUT / f"wavlm_3d_{exporter}.onnx"
    model, result = _fused(path)
    ops = op_histogram(model)
    assert result.notes["family"] == "wav2vec2"
    # TorchScript's biased projections pack into Attention (test_fuse_packed_attention_ts); both take the bias 6th
    fused = ops["com.microsoft::MultiHeadAttention"] + ops["com.microsoft::Attention"]
    assert result.counts["fused_attention"] == 2 and fused == 2
    assert "Softmax" not in ops and "attention" not in (result.notes.get("missing") or {})
    for node in model.graph:  # the gated bias, computed from the hidden states, is the attention_bias
        if node.op_type in ("MultiHeadAttention", "Attention"):
            assert len(node.inputs) == 6 and node.inputs[5] is not None
            assert node.attributes.get_int("num_heads") == 2
    reference, fused = session(path), session(model)
    rng = np.random.default_rng(0)
    for batch, frames in ((1, 7), (3, 31)):
        feeds = {"input_values": rng.standard_normal((batch, frames * HOP + 80)).astype(np.float32)}
        want, got = reference.run(None, feeds)[0], fused.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{batch}x{frames}")


def _mask_feeds(batch_first: bool, batch: int, seq: int, rng) -> dict[str, np.ndarray]:
    x = rng.standard_normal((batch, seq, 32) if batch_first else (seq, batch, 32)).astype(np.float32)
    mask = np.zeros((batch, seq), bool)
    mask[0, seq // 2 :] = True  # right padding
    mask[batch - 1, :] = True  # a row with every key masked: the export makes it NaN, so must the fused model
    return {"x": x, "key_padding_mask": mask}


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_with_key_padding_mask_fuses_exactly(batch_first):
    path = HELDOUT / f"mha_kpm_bf{int(batch_first)}_dynamo.onnx"
    rng = np.random.default_rng(1)
    partial = [_mask_feeds(batch_first, 2, 5, rng) for _ in range(2)]
    for feeds in partial:  # the pass verifies on rows that keep a key; NaN rows are checked below
        feeds["key_padding_mask"][-1, 0] = False
    model, result = _fused(path, {"family": "vit"}, partial)  # no embedding: a bare layer names no family
    ops = op_histogram(model)
    assert result.counts["fused_attention"] == 1 and ops["com.microsoft::MultiHeadAttention"] == 1
    assert "Softmax" not in ops
    assert ops["MatMul"] == 1  # the packed in-projection, once: no 3-D product is left alive beside the fused op
    if batch_first:  # its projection is lifted above the input's transpose to [S, B, E]: no copy of x is made
        x = model.graph.inputs[0]
        assert not any(use.node.op_type == "Transpose" for use in x.uses())
    reference, fused = session(path), session(model)
    for batch, seq in ((3, 7), (4, 12)):
        feeds = _mask_feeds(batch_first, batch, seq, rng)
        want, got = reference.run(None, feeds)[0], fused.run(None, feeds)[0]
        rows = (slice(None), batch - 1) if not batch_first else (batch - 1,)
        assert np.isnan(want[rows]).all() and np.isnan(got[rows]).all()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True, err_msg=f"{batch}x{seq}")


def test_sequence_first_multihead_attention_without_weights_fuses_and_keeps_its_output_name():
    """``need_weights=False``: the SDPA path, out-projected by a 2-D Gemm whose unflattening Reshape is the graph
    output. Turning that Gemm into a 3-D MatMul replaced the output without its name, and the candidate was
    refused (SignatureChanged: ['y'] -> ['val_6']): no attention fused."""
    path = HELDOUT / "mha_seq_first_dynamo.onnx"
    model, result = _fused(path, {"family": "vit"})
    ops = op_histogram(model)
    assert result.counts["fused_attention"] == 1 and "Softmax" not in ops
    assert [v.name for v in model.graph.outputs] == ["y"]
    assert_equivalent(path, model, [{"x": (7, 3, 32)}, {"x": (12, 1, 32)}], rtol=1e-4, atol=1e-5, n_random=0)


def _folded_graph(keep_sequence: bool = True, scale_after_bias: bool = False) -> onnx.ModelProto:
    """The bmm attention as F.multi_head_attention_forward writes it, on a sequence-first input with a bias
    ``[B*2, S, S]`` from an input; ``keep_sequence=False`` folds with a Reshape that moves the sequence axis
    (``[S, B, 8] -> [B, S*2, 4]``: not heads), ``scale_after_bias`` scales the biased scores."""
    fold = (
        "fold = Constant <value = int64[3] {0, -1, 4}> ()"
        if keep_sequence
        else ("fold = Constant <value = int64[3] {2, -1, 4}> ()")
    )
    steps = ["scaled = Mul (scores, c)", "biased = Add (scaled, bias)", "probs = Softmax <axis = -1> (biased)"]
    if scale_after_bias:
        steps = ["biased = Add (scores, bias)", "scaled = Mul (biased, c)", "probs = Softmax <axis = -1> (scaled)"]
    scored = "\n          ".join(steps)
    return parse(
        f"""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[S, 2, 8] x, float[4, S, S] bias) => (float[S, 2, 8] y) {{
          wq = Constant <value = float[8, 8] {{{", ".join(str(0.1 * ((i * 7) % 11 - 5)) for i in range(64))}}}> ()
          wk = Constant <value = float[8, 8] {{{", ".join(str(0.1 * ((i * 5) % 13 - 6)) for i in range(64))}}}> ()
          wv = Constant <value = float[8, 8] {{{", ".join(str(0.1 * ((i * 3) % 7 - 3)) for i in range(64))}}}> ()
          c = Constant <value = float {{0.5}}> ()
          {fold}
          back = Constant <value = int64[3] {{0, 2, 8}}> ()
          q = MatMul (x, wq)
          k = MatMul (x, wk)
          v = MatMul (x, wv)
          q3 = Reshape (q, fold)
          k3 = Reshape (k, fold)
          v3 = Reshape (v, fold)
          qh = Transpose <perm = [1, 0, 2]> (q3)
          kt = Transpose <perm = [1, 2, 0]> (k3)
          vh = Transpose <perm = [1, 0, 2]> (v3)
          scores = MatMul (qh, kt)
          {scored}
          ctx = MatMul (probs, vh)
          merged = Transpose <perm = [1, 0, 2]> (ctx)
          y = Reshape (merged, back)
        }}
        """
    )


def _run(proto: onnx.ModelProto) -> tuple[ir.Model, int]:
    import onnx_ir.passes.common as common_passes

    model = ir.serde.deserialize_model(proto)
    common_passes.ShapeInferencePass()(model)
    return model, fuse_folded_heads(model)


def test_hand_built_folded_attention_fuses_with_its_bias_and_scale():
    proto = _folded_graph()
    model, fused = _run(proto)
    assert fused == 1
    mha = next(n for n in model.graph if n.op_type == "MultiHeadAttention")
    assert mha.attributes.get_float("scale") == pytest.approx(0.5) and mha.attributes.get_int("num_heads") == 2
    assert "Softmax" not in op_histogram(model)
    reference, fused_session = session(ir.serde.deserialize_model(proto)), session(model)
    rng = np.random.default_rng(2)
    for seq in (3, 10):
        feeds = {
            "x": rng.standard_normal((seq, 2, 8)).astype(np.float32),
            "bias": rng.standard_normal((4, seq, seq)).astype(np.float32),
        }
        want, got = reference.run(None, feeds)[0], fused_session.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"sequence {seq}")


@pytest.mark.parametrize(
    "variant",
    [{"keep_sequence": False}, {"scale_after_bias": True}],
    ids=["fold-moves-the-sequence-axis", "scale-after-bias"],
)
def test_what_is_not_folded_heads_attention_stays(variant):
    model, fused = _run(_folded_graph(**variant))
    assert fused == 0
    assert op_histogram(model)["Softmax"] == 1


def test_attention_option_none_leaves_folded_heads_attention_to_ort():
    model, result = _fused(HELDOUT / "wavlm_3d_dynamo.onnx", {"attention": "none", "engines": ["onnxscript"]})
    ops = op_histogram(model)
    assert ops["Softmax"] == 2 and "com.microsoft::MultiHeadAttention" not in ops
    assert result.notes["candidates"]["onnxscript"]["onnxscript_counts"].get("folded_heads_mha", 0) == 0


def _id_feeds(batch: int, seq: int, rng) -> dict[str, np.ndarray]:
    mask = np.ones((batch, seq), np.int64)
    mask[0, seq - 3 :] = 0  # a right-padded row
    if batch > 2:
        mask[1, :2] = 0  # a left-padded one
    return {"input_ids": rng.integers(2, 128, (batch, seq)).astype(np.int64), "attention_mask": mask}


@pytest.mark.parametrize("exporter", ["ts", "dynamo"])
def test_fairseq_attention_masked_on_a_4d_view_fuses_exactly(exporter):
    path = HELDOUT / f"fsmt_{exporter}.onnx"
    model, result = _fused(path)
    ops = op_histogram(model)
    assert result.counts["fused_attention"] == 2 and "Softmax" not in ops
    assert "attention" not in (result.notes.get("missing") or {})
    for node in model.graph:  # the padding mask is the attention_bias, built from the same condition
        if node.op_type in ("MultiHeadAttention", "Attention"):
            assert len(node.inputs) == 6 and node.inputs[5] is not None
            assert node.attributes.get_int("num_heads") == 2
    reference, fused = session(path), session(model)
    rng = np.random.default_rng(3)
    for batch, seq in ((1, 5), (3, 23)):
        feeds = _id_feeds(batch, seq, rng)
        want, got = reference.run(None, feeds)[0], fused.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{batch}x{seq}")


def _fairseq_graph(fill: str) -> onnx.ModelProto:
    """fairseq's attention by hand: q folded ``[S, B*2, 4]``, k and v through ``[S, B, 2, 4]`` views, the scores
    unfolded to ``[B, 2, S, S]`` and masked with ``Where(pad, fill, scores)``, folded back before the Softmax."""
    weights = {n: ", ".join(str(0.1 * ((i * m) % p - p // 2)) for i in range(64)) for n, m, p in
               (("wq", 7, 11), ("wk", 5, 13), ("wv", 3, 7))}  # fmt: skip
    return parse(
        f"""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[S, 2, 8] x, bool[2, S] pad) => (float[S, 2, 8] y)
          <float[4, S, 4] kh, float[4, S, 4] vh, float[4, S, S] scores, float[2, 2, S, S] s4, float[4, S, S] s3> {{
          wq = Constant <value = float[8, 8] {{{weights["wq"]}}}> ()
          wk = Constant <value = float[8, 8] {{{weights["wk"]}}}> ()
          wv = Constant <value = float[8, 8] {{{weights["wv"]}}}> ()
          c = Constant <value = float {{0.5}}> ()
          fill = Constant <value = float {{{fill}}}> ()
          fold = Constant <value = int64[3] {{0, 4, 4}}> ()
          view = Constant <value = int64[4] {{0, 2, 2, 4}}> ()
          heads = Constant <value = int64[3] {{4, -1, 4}}> ()
          unfold = Constant <value = int64[4] {{2, 2, 0, -1}}> ()
          refold = Constant <value = int64[3] {{4, -1, 0}}> ()
          axes = Constant <value = int64[2] {{1, 2}}> ()
          back = Constant <value = int64[3] {{0, 2, 8}}> ()
          q = MatMul (x, wq)
          k = MatMul (x, wk)
          v = MatMul (x, wv)
          qs = Mul (q, c)
          q3 = Reshape (qs, fold)
          qh = Transpose <perm = [1, 0, 2]> (q3)
          k4 = Reshape (k, view)
          kb = Transpose <perm = [1, 2, 0, 3]> (k4)
          kh = Reshape (kb, heads)
          kt = Transpose <perm = [0, 2, 1]> (kh)
          v4 = Reshape (v, view)
          vb = Transpose <perm = [1, 2, 0, 3]> (v4)
          vh = Reshape (vb, heads)
          scores = MatMul (qh, kt)
          s4 = Reshape (scores, unfold)
          m4 = Unsqueeze (pad, axes)
          masked = Where (m4, fill, s4)
          s3 = Reshape (masked, refold)
          probs = Softmax <axis = -1> (s3)
          ctx = MatMul (probs, vh)
          merged = Transpose <perm = [1, 0, 2]> (ctx)
          y = Reshape (merged, back)
        }}
        """
    )


def test_hand_built_fairseq_attention_fuses_and_a_where_that_is_no_mask_stays():
    proto = _fairseq_graph("-3.4028234663852886e38")
    model, fused = _run(proto)
    assert fused == 1 and "Softmax" not in op_histogram(model)
    mha = next(n for n in model.graph if n.op_type == "MultiHeadAttention")
    assert mha.attributes.get_float("scale") == pytest.approx(0.5) and mha.inputs[5] is not None
    reference, fused_session = session(ir.serde.deserialize_model(proto)), session(model)
    rng = np.random.default_rng(4)
    for seq in (3, 9):
        pad = np.zeros((2, seq), bool)
        pad[1, seq - 2 :] = True
        feeds = {"x": rng.standard_normal((seq, 2, 8)).astype(np.float32), "pad": pad}
        want, got = reference.run(None, feeds)[0], fused_session.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"sequence {seq}")
    # a Where that writes an ordinary value is not a mask: no additive bias equals it
    model, fused = _run(_fairseq_graph("-1.0"))
    assert fused == 0 and op_histogram(model)["Softmax"] == 1
