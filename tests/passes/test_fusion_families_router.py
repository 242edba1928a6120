"""_fusion_families.count_layers counts attention Softmaxes, not a mixture of experts' router (held-out probe
round 2: Mixtral, Qwen2-MoE and OLMoE with ``experts_implementation="batched_mm"`` were reported 2 of 4
attentions fused, their one router ``softmax(x @ W_gate)`` per layer read as a second attention), nor a token
learner's pooling (round 5); ``fusable_sites`` counts a ``Tanh`` as a GELU only when it is one's."""

from __future__ import annotations

import onnx_ir as ir

from passes.fusion import _fusion_families as fam
from tests.passes._util import parse

# One layer: attention whose scores are q @ k^T plus a product with a constant position table (DeBERTa's
# relative positions, folded), then a router's Softmax over x @ W_gate (through a Cast, as transformers
# computes it in float32).
LAYER = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[B,4,S,8] q, float[B,4,8,S] kt, float[B,4,S,8] v, float[B,S,32] x) => (float[B,4,S,8] ctx, float[B,S,4] gate) {
    table = Constant <value = float[8,1] {1,2,3,4,5,6,7,8}> ()
    scores = MatMul (q, kt)
    rel = MatMul (q, table)
    biased = Add (scores, rel)
    probs = Softmax <axis = -1> (biased)
    ctx = MatMul (probs, v)
    w_gate = Constant <value = float[32,4] {
        1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1, 1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1,
        1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1, 1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1,
        1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1, 1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1,
        1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1, 1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1} > ()
    logits = MatMul (x, w_gate)
    logits32 = Cast <to = 1> (logits)
    gate = Softmax <axis = -1> (logits32)
}
"""


def test_a_router_softmax_is_no_attention_layer() -> None:
    model = ir.serde.deserialize_model(parse(LAYER))
    assert fam.count_layers(model) == 1


def test_every_attention_softmax_still_counts() -> None:
    text = LAYER.replace("logits = MatMul (x, w_gate)", "logits = MatMul (x, x_t)").replace(
        "(float[B,4,S,8] q,", "(float[B,S,32] x_t_in, float[B,4,S,8] q,"
    )
    text = text.replace(
        "logits = MatMul (x, x_t)", "x_t = Transpose <perm = [0, 2, 1]> (x_t_in)\n    logits = MatMul (x, x_t)"
    )
    # a Softmax over a product of two activations whose probabilities nothing multiplies is no attention block
    # either (a spline flow's bin widths: VITS's duration predictor)
    assert fam.count_layers(ir.serde.deserialize_model(parse(text, check=False))) == 1
    softmax = "gate = Softmax <axis = -1> (logits32)"
    text = text.replace(softmax, f"{softmax}\n    mixed = MatMul (gate, x)")
    model = ir.serde.deserialize_model(parse(text, check=False))
    assert fam.count_layers(model) == 2  # a Softmax over a product of two activations, times V, is attention


def test_a_token_learners_softmax_over_conv_logits_is_no_attention_layer() -> None:
    """MGP-STR's A3 module (held-out probe round 5): pooling weights from a 1x1 Conv per output token, a Softmax
    over the patches and an Einsum with the features: no keys, nothing to fuse; it was counted as a third
    attention and reported missing."""
    model = ir.serde.deserialize_model(
        parse("""
        <ir_version: 10, opset_import: ["" : 18]>
        g (float[B,8,1,S] feats, float[B,S,8] tokens) => (float[B,4,8] pooled) {
            w = Constant <value = float[4,8,1,1] {
                1,0,0,0,0,0,0,0, 0,1,0,0,0,0,0,0, 0,0,1,0,0,0,0,0, 0,0,0,1,0,0,0,0}> ()
            logits = Conv (feats, w)
            shape = Constant <value = int64[3] {0, 4, -1}> ()
            flat = Reshape (logits, shape)
            weights = Softmax <axis = -1> (flat)
            pooled = Einsum <equation = "bts,bsd->btd"> (weights, tokens)
        }
        """)
    )
    assert fam.count_layers(model) == 0


TANH = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[B,S,8] x) => (float[B,S,8] y) {
    %s
}
"""


def _tanh_model(body: str) -> ir.Model:
    return ir.serde.deserialize_model(parse(TANH % body))


def test_only_the_tanh_of_a_gelu_cubic_anchors_a_gelu() -> None:
    """A Tanh squashing a policy's actions (the Decision Transformer's head, held-out probe round 5) is no GELU:
    counting it reported a GELU missing."""
    squash = _tanh_model("y = Tanh (x)")
    assert fam.fusable_sites(squash)["gelus"] == 0
    pow_form = _tanh_model("""
    three = Constant <value = float {3.0}> ()
    cube = Pow (x, three)
    c = Constant <value = float {0.044715}> ()
    small = Mul (cube, c)
    inner = Add (x, small)
    k = Constant <value = float {0.7978846}> ()
    arg = Mul (inner, k)
    y = Tanh (arg)""")
    mul_form = _tanh_model("""
    sq = Mul (x, x)
    cube = Mul (sq, x)
    c = Constant <value = float {0.044715}> ()
    small = Mul (c, cube)
    inner = Add (x, small)
    k = Constant <value = float {0.7978846}> ()
    arg = Mul (k, inner)
    y = Tanh (arg)""")
    assert fam.fusable_sites(pow_form)["gelus"] == 1 and fam.fusable_sites(mul_form)["gelus"] == 1
