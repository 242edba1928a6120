"""Cross attention in a graph that holds both encoder and decoder (issue 17, held-out probe).

A user who exports ``MarianMTModel``, ``MT5ForConditionalGeneration`` or a whole ``WhisperModel`` in one call
uploads one graph with ``input_ids`` (or pixels, or mel features) and ``decoder_input_ids``: no input has the
encoder-states or cross-cache role, so every attention used to count as a self attention. ``fuse_transformer``
then expected the fusions of six self-attention layers (BART: 13 skip norms and 6 GELUs for a model with 4
feed-forwards, 11 norms that fuse; T5: 12 skip norms where 10 can fuse) and reported the difference as missing
on every full encoder-decoder (corpus BART and T5, Marian, mBART, Pegasus, M2M100, BlenderbotSmall, mT5,
VisionEncoderDecoder). A cross attention is now also told by its operands: its queries read a graph input its
keys do not.

Models: ``tests/models/corpus/bart_*.onnx`` (``python -m tests.models.corpus``) and
``tests/models/heldout_mt5_dynamo.onnx`` (``python -m bench.heldout_s2s_multi --only mt5 --exporters dynamo``:
T5 v1.1's gated GELU, exported by dynamo with eager attention, which is what it allows).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

from core.inputs import InputSynthesis
from passes._infra import PassContext
from passes.fusion._decoder_structure import attention_counts, attention_kinds
from passes.fusion.fuse_transformer import FuseTransformer
from tests.numerics import assert_equivalent

MODELS = Path(__file__).resolve().parent.parent / "models"
FULL = {
    "bart_ts_eager": MODELS / "corpus" / "bart_ts_eager.onnx",
    "bart_ts_sdpa": MODELS / "corpus" / "bart_ts_sdpa.onnx",
    "bart_dynamo": MODELS / "corpus" / "bart_dynamo.onnx",
    "mt5_dynamo": MODELS / "heldout_mt5_dynamo.onnx",
}
# 2 encoder layers, 2 decoder layers: 4 self attentions, 2 cross attentions
LAYERS, CROSS = 4, 2


@pytest.mark.parametrize("name", sorted(FULL))
def test_full_encoder_decoder_tells_cross_from_self_attention_when_no_input_is_the_encoders_states(name):
    # setup
    model = ir.load(FULL[name])
    # execute
    counts = attention_counts(model)
    kinds = attention_kinds(model)
    # assert: one cross attention per decoder layer, named so; the encoder's and decoder's own are self
    assert counts == {"self": LAYERS, "cross": CROSS}
    assert sorted(kinds.values()).count("cross") == CROSS


@pytest.mark.parametrize(
    "path, want",
    [
        # an encoder alone, a decoder-only model with its cache (the keys read the past besides the queries'
        # inputs: still self), and Optimum's split decoder whose encoder states are an input
        (MODELS / "corpus" / "bert_ts_eager.onnx", {"self": 2, "cross": 0}),
        (MODELS / "decoders" / "gpt2_past_ts.onnx", {"self": 2, "cross": 0}),
        (MODELS / "decoders" / "llama_past_dynamo.onnx", {"self": 2, "cross": 0}),
        (MODELS / "seq2seq" / "t5" / "decoder_with_past_model.onnx", {"self": 2, "cross": 2}),
        (MODELS / "seq2seq" / "whisper" / "decoder_model.onnx", {"self": 2, "cross": 2}),
    ],
    ids=lambda v: v.name if isinstance(v, Path) else "",
)
def test_other_graphs_keep_their_attention_kinds_when_counted(path, want):
    assert attention_counts(ir.load(path)) == want


@pytest.mark.parametrize(
    "name, expected, fully_fused",
    [
        # BART: 4 self-attention layers post-norm (2 norms each) + the embedding sum's norm, + 1 norm per cross
        # attention; GELU per feed-forward
        ("bart_dynamo", {"attention": 6, "skip_layer_norm": 11, "gelu": 4}, ("attention", "gelu")),
        # T5: pre-RMS-norm, 2 norms per self-attention layer, + 1 per cross attention; its GELUs are not counted
        # (its attention fuses after the passes the preset runs before, not on the upload as it is)
        ("mt5_dynamo", {"attention": 6, "skip_layer_norm": 10}, ()),
    ],
)
def test_full_encoder_decoder_expects_the_fusions_its_layers_have_when_fused(name, expected, fully_fused):
    # (dynamo exports: the fast preset runs fuse_transformer on them as uploaded, after shape inference)
    # setup
    path = FULL[name]
    samples = [s.feeds for s in InputSynthesis(onnx.load(str(path))).generate(2)]
    # execute
    result = FuseTransformer()(ir.load(path), PassContext(samples=samples))
    # assert: the cross attentions are counted apart, the expectation is the model's, and what fully fuses
    # is no longer reported as missing
    assert result.notes["cross_attention"] == CROSS
    assert result.notes["expected"] == expected
    assert not set(fully_fused) & set(result.notes["missing"]), result.notes["missing"]
    if "attention" in fully_fused:
        assert result.counts["fused_attention"] == expected["attention"]
    # the fused model against the upload, ORT optimizations off, encoder and decoder lengths apart and unlike
    # the export's
    shapes = [
        {"input_ids": (1, 7), "attention_mask": (1, 7), "decoder_input_ids": (1, 5)},
        {"input_ids": (3, 19), "attention_mask": (3, 19), "decoder_input_ids": (3, 11)},
    ]
    assert_equivalent(path, result.model, shapes, rtol=1e-4, atol=1e-5, n_random=0)
