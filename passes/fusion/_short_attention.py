"""Window attention with a bias is left to ORT's own kernels: its fused form is slower on the CPU EP.

Swin (and every windowed attention: SwinV2, Donut's encoder) attends within fixed windows of w x w tokens
(16 or 49) with a relative-position bias, plus the shifted-window mask on every other block, added to the
scores::

    s = MatMul(q, kT) [* scale]      q, k, v: [batch * windows, heads, w*w, d]
    Softmax(Add(s, bias))            bias: [1, heads, w*w, w*w] (+ mask): static, broadcast over the batch

(a shifted block adds its mask on a ``[batch, windows, heads, w*w, w*w]`` view in between: ``Softmax(Reshape(
Add(Reshape(Add(s, bias)), mask)))``, as timm's and torchvision's Swin write it)

onnxscript's SDPA -> MultiHeadAttention rules take ``bias`` as ``attention_bias``, already broadcastable (no
``Expand`` to the batch is left: ``drop_noop_bias_expands``). The cost is the kernel's: ORT's CPU
``MultiHeadAttention`` runs its flash kernel (``MlasFlashAttention``) only without an ``attention_bias``;
with one it takes the generic path, a loop over (batch * windows, heads) of a bias copy, a GEMM accumulating
onto it, a softmax and a second GEMM, whose per-window overhead outweighs the work of a 16 x 16 tile. ORT's
own batched MatMul/Softmax/Add on the unfused graph run the same attention faster. Measured (onnxruntime
1.32, 1 thread, interleaved; bench/README.md "One coverage cell re-measured"): the bias costs the fused kernel
the same whatever its shape ([1, h, S, S] broadcast or materialized [N, h, S, S]), and with a bias
``MultiHeadAttention`` ran 1.04-1.33x ORT's unfused kernels at S = T = 16..64 (head sizes 8 and 32, the gap
widest at 16), 1.02-1.07x at 100 and 144, and 0.88x at 256. Text models keep their fusion: their lengths
are dynamic, so no static length is read here.

When every attention of the model is such a block (static query and key lengths of at most ``SHORT``, an
additive bias with one table per head on the scores), ``fuse_transformer`` leaves attention unfused, as
``attention="none"``, and names the reason in its report. A model that also has other attention keeps every
fusion, and so does a mask broadcast over the heads: ViT's dynamo export adds an all-true ``[B, 1, 17, 17]``
mask, and its fused ``Attention`` (Q/K/V packed) ran 0.74x (batch 1) and 0.86x (batch 8) the unfused graph,
whose mask Where/Expand and separate projections cost more than the kernel's loop over 4 heads per image.
"""

from __future__ import annotations

import onnx_ir as ir

from passes.fusion._attention_bias import _is_scores

_ONNX_DOMAINS = ("", "ai.onnx")
SHORT = 64  # the longest static window measured slower fused (above: within a few percent, then faster)


def _window_scores(softmax: ir.Node) -> ir.Value | None:
    """The biased scores ``softmax`` normalizes: its input, or in a shifted-window block the scores under the
    shift mask, which Swin adds on a ``[B, windows, heads, S, S]`` view: ``Reshape(Add(Reshape(s), mask))``."""
    value = softmax.inputs[0]
    reshape = value.producer() if value is not None else None
    if reshape is None or reshape.op_type != "Reshape" or reshape.inputs[0] is None:
        return value
    masked = reshape.inputs[0].producer()
    if masked is None or masked.op_type != "Add" or masked.domain not in _ONNX_DOMAINS:
        return value
    for term in masked.inputs:
        view = term.producer() if term is not None else None
        if view is not None and view.op_type == "Reshape" and view.inputs[0] is not None:
            return view.inputs[0]
    return value


def _short_biased(scores: ir.Value | None) -> tuple[int, int] | None:
    """(S, T) when ``scores`` (what a Softmax normalizes) are scores with a per-head bias over static lengths of
    at most ``SHORT``."""
    add = scores.producer() if scores is not None else None
    if add is None or add.op_type != "Add" or add.domain not in _ONNX_DOMAINS:
        return None
    terms = [v for v in add.inputs if v is not None]
    if len(terms) != 2 or sum(_is_scores(v) for v in terms) != 1:
        return None
    bias = next(v for v in terms if not _is_scores(v))
    dims = list(scores.shape) if scores.shape is not None else []
    if len(dims) != 4 or not all(isinstance(d, int) for d in dims[1:]):
        return None
    # A bias per head: a position table, not a mask broadcast over the heads (ViT's dynamo export adds an
    # all-true [B, 1, S, S] mask, and there the fused Attention measured faster: bench/README.md).
    bias_dims = list(bias.shape) if bias.shape is not None else []
    if len(bias_dims) != 4 or dims[1] < 2 or bias_dims[1] != dims[1]:
        return None
    s, t = dims[2], dims[3]
    return (s, t) if s <= SHORT and t <= SHORT else None


def short_biased_attention(model: ir.Model) -> str | None:
    """Why attention should stay unfused, when every attention Softmax of ``model`` (scores from
    ``MatMul(q, kT)``) is a short biased window; None otherwise or when the model has no attention."""
    blocks = []
    for node in model.graph:
        if node.op_type != "Softmax" or node.domain not in _ONNX_DOMAINS:
            continue
        scores = _window_scores(node)
        source = scores.producer() if scores is not None else None
        feeds_scores = source is not None and any(_is_scores(v) for v in source.inputs if v is not None)
        if not (_is_scores(scores) or feeds_scores):
            continue  # a Softmax that normalizes something other than attention scores
        blocks.append(_short_biased(scores))
    windows = [b for b in blocks if b is not None]
    if not blocks or len(windows) < len(blocks):
        return None
    lengths = sorted({f"{s}x{t}" for s, t in windows})
    return (
        f"left to ORT's kernels: all {len(blocks)} attention blocks are windows of static length "
        f"({', '.join(lengths)} <= {SHORT}) with a bias per head on the scores, where ORT's CPU MultiHeadAttention "
        "leaves its flash kernel for a per-window loop measured slower than the unfused MatMul/Softmax"
    )
