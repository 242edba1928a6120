"""Transformer families for ``fuse_transformer``: detection from the graph and the fusions each should get.

Detection reads only structure, never names of nodes (exporters rename them freely):

============  ==========================================================================================
family        signal (first that holds wins)
============  ==========================================================================================
t5            a graph input ``decoder_input_ids`` and no LayerNorm (encoder-decoder); or cross attention (keys
              computed from the encoder's states alone, ``_decoder_structure``) and no LayerNorm (an
              encoder-decoder's decoder, as Optimum splits them); or RMS norms, no LayerNorm and no causal
              mask (the T5 encoder: relative position bias added to the scores)
bart          a graph input ``decoder_input_ids`` and LayerNorms; or cross attention and LayerNorms (the
              decoders of BART, Whisper, Marian: ORT's bart type fuses all of them)
llama         RMS norms, no LayerNorm, and a causal mask (a decoder: Llama, Qwen2, Mistral, Phi-3; rotary
              embeddings, SiLU feed-forward)
vit           a ``Conv`` on a rank-4 float graph input (patch embedding) and LayerNorms
whisper       a ``Conv`` on a rank-3 float graph input (log-mel features ``[B, mels, frames]``: the
              convolutional stem of an audio encoder) and LayerNorms
wav2vec2      a ``Conv`` reading a rank-2 float graph input through ``Unsqueeze``/``Reshape`` (raw audio
              ``[B, samples]`` into the convolutional feature encoder) and LayerNorms
gpt2          a comparison (``LessOrEqual``, ``Greater``...) of two ``Range``-derived index tensors (the
              causal mask), or a ``Trilu``
bart          learned positions read at ``ids + 2`` (BART's offset): an embedding Gather indexed by an
              ``Add`` of the constant 2 (the BART encoder alone)
roberta       position ids computed from the input ids (``CumSum`` of the non-pad mask, padding offset)
bert          an embedding table with 2-16 rows (token types; RoBERTa's has 1 row)
distilbert    word and position embeddings only, LayerNorm right after their sum; or a word embedding alone,
              read from the input ids and normalized at once (DeBERTa-v3: relative positions only)
vit           a word embedding alone, read from the input ids and (after a scaling, mask product or cast)
              read by both a LayerNorm and a residual Add: a pre-norm text encoder with rotary or no absolute
              positions (ESM-2), whose layers are ViT's
encoder       no LayerNorm and no RMS norm, but a Softmax of the product of two activations that multiplies a third
              (self-attention; MobileBERT's NoNorm is an element-wise Mul + Add): only attention is expected
unknown       no Softmax or no normalization: not a transformer we know how to fuse
============  ==========================================================================================

``layers`` is the number of ``Softmax`` nodes (one per attention block in every family above), plus the
attention ops an earlier pass already fused (``fuse_gqa`` runs before ``fuse_transformer`` in the presets, so a
decoder reaches it with GroupQueryAttention or MultiHeadAttention and no Softmax). An encoder-decoder's
decoder has two per layer, a self and a cross attention: ``cross`` of them (``count_cross_attention``) are
no layer of their own, and each adds one attention and one residual norm to the family's count for the
``layers - cross`` self attentions (its feed-forward, and so its GELU, is per layer).

The family's count is then capped by the graph (``fusable_sites``): no more skip norms than residual Adds a
norm reads, no more GELUs than the graph computes. The families are layouts, and their members vary (Marian
without BART's embedding norm, a ReLU or SiLU feed-forward in a family of GELUs): what a graph does not hold
is not a fusion missed.
"""

from __future__ import annotations

import typing
from collections import Counter
from typing import Literal

import numpy as np
import onnx_ir as ir

from core.inputs import InputSynthesis
from passes._match import is_constant
from passes.fusion._decoder_structure import attention_counts, through_casts

Family = Literal[
    "bert", "roberta", "distilbert", "gpt2", "llama", "t5", "bart", "vit", "whisper", "wav2vec2", "encoder", "unknown"
]
FAMILIES: tuple[str, ...] = typing.get_args(Family)[:-1]

# Fusion group -> the com.microsoft ops that count as achieving it.
GROUPS: dict[str, frozenset[str]] = {
    "attention": frozenset({"Attention", "MultiHeadAttention", "GroupQueryAttention"}),
    "skip_layer_norm": frozenset({"SkipLayerNormalization", "SkipSimplifiedLayerNormalization"}),
    "gelu": frozenset({"BiasGelu", "FastGelu", "Gelu", "GemmFastGelu", "QuickGelu"}),
    "embed_layer_norm": frozenset({"EmbedLayerNormalization"}),
}

# ORT transformers optimizer model_type per family.
ORT_MODEL_TYPE: dict[str, str] = {
    "bert": "bert",
    "roberta": "bert",
    "distilbert": "bert",
    "gpt2": "gpt2",
    "llama": "gpt2",  # ORT's optimizer has no llama type; its gpt2 fusions are the decoder ones
    "t5": "t5",
    "bart": "bart",
    "vit": "vit",
    # ORT has no type for the audio encoders alone; its vit type runs the generic BERT-style fusions (attention,
    # skip norm, GELU) with the heads and hidden size given, which is what their layers are.
    "whisper": "vit",
    "wav2vec2": "vit",
    "encoder": "vit",
}

_COMPARE = {"Less", "LessOrEqual", "Greater", "GreaterOrEqual"}


def expected_fusions(family: str, layers: int, cross: int = 0, sites: dict[str, int] | None = None) -> dict[str, int]:
    """Fused-op counts a fully fused model of this family has, for ``layers`` attention blocks of which
    ``cross`` are cross attentions (an encoder-decoder's decoder): the family's count for the self attentions,
    plus per cross attention the attention and the residual norm after it.

    With ``sites`` (``fusable_sites`` of the graph), each norm and GELU count is capped by what the graph
    holds: a family is a guess at the layout, and a member may lack what it describes (Marian has no
    embedding norm, Pegasus adds 2-D positions before its first norms, M2M100 and OPT feed forward through
    ReLU, StableLM through SiLU). A count the graph cannot reach would be reported missing for a fusion that
    has nothing to fuse. Attention keeps the family's count: its Softmax blocks are what ``layers`` counts."""
    expected = _per_layer_fusions(family, layers - cross)
    if cross and expected:
        expected["attention"] += cross
        expected["skip_layer_norm"] += cross
    if sites is not None:
        if "skip_layer_norm" in expected:
            expected["skip_layer_norm"] = min(expected["skip_layer_norm"], sites["residual_norms"])
        if "embed_layer_norm" in expected:  # the norm left once every residual one is a skip norm
            free = sites["norms"] - expected.get("skip_layer_norm", 0)
            expected["embed_layer_norm"] = min(expected["embed_layer_norm"], max(free, 0))
        if "gelu" in expected:
            expected["gelu"] = min(expected["gelu"], sites["gelus"])
    return expected


def _per_layer_fusions(family: str, n: int) -> dict[str, int]:
    if family in ("bert", "roberta", "distilbert"):
        # post-norm: LN(x + attn) and LN(x + ffn) per layer; the embedding LN becomes EmbedLayerNorm.
        return {"attention": n, "skip_layer_norm": 2 * n, "gelu": n, "embed_layer_norm": 1}
    if family in ("gpt2", "vit", "whisper"):
        # pre-norm: ln_2 of every layer, ln_1 of layers 2..n and the final LN each follow a residual Add.
        return {"attention": n, "skip_layer_norm": 2 * n, "gelu": n}
    if family == "bart":
        # post-norm like BERT, plus the embedding sum's LayerNorm as one more skip norm (no token types, and
        # its positions sit at an offset of 2, which ORT's EmbedLayerNormalization does not express). A
        # pre-norm decoder (Whisper's) has the same count: its first norm reads the embedding sum, its last
        # the final residual.
        return {"attention": n, "skip_layer_norm": 2 * n + 1, "gelu": n}
    if family == "wav2vec2":
        # post-norm like BERT (or pre-norm in its "stable" variant, the same count), plus the norm after the
        # positional convolution's residual Add; GELUs of the convolutional feature encoder come on top.
        return {"attention": n, "skip_layer_norm": 2 * n + 1, "gelu": n}
    if family == "encoder":
        # no normalization a fusion reads (MobileBERT's NoNorm is an element-wise Mul + Add): attention alone
        return {"attention": n}
    if family in ("t5", "llama"):
        # pre-RMS-norm: the norm of every block but the first follows a residual Add, and so does the final
        # norm (T5 adds no positions to its embedding); T5's feed-forward is ReLU, the decoders' SiLU gated:
        # no GELU to fuse.
        return {"attention": n, "skip_layer_norm": 2 * n}
    return {}


_NORM_OPS = frozenset({"LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization"})


def fusable_sites(model: ir.Model) -> dict[str, int]:
    """What the graph holds for the norm and GELU fusions to take in: ``norms`` (LayerNormalization and RMS
    norm ops, and their decompositions: a ``ReduceMean`` of ``Pow(x, 2)`` or ``Mul(x, x)``), ``residual_norms``
    (the residual Adds, ``is_residual``, that a norm reads, each once: a skip norm takes in its Add, so the two
    norms of a parallel block's sum (GPT-NeoX) fuse one; skip norms already fused count too),
    ``residual_norms_rank4`` (those of a rank above 3, which no skip norm takes: ORT's SkipLayerNormalization
    reads 2-D or 3-D input, and torchvision's Swin keeps its tokens as batch x height x width x channels),
    ``residual_norms_rank2`` (those counted in ``residual_norms`` that are 2-D: the CLS row once
    ``upstream_slice`` moved the slice above them, or tokens a graph flattens; ORT's kernel takes them,
    onnxscript's skip-norm rule, written for rank 3, does not) and
    ``gelus`` (``gelu_anchor``: ``Erf`` and the tanh GELU's ``Tanh``, QuickGELU's ``Sigmoid(x * c)``, and GELUs
    already fused)."""
    norms = skips = gelus = 0
    sums: set[ir.Node] = set()  # the residual Adds normalized: one skip norm takes in each
    high: set[ir.Node] = set()  # the ones of a rank above 3
    rows: set[ir.Node] = set()  # the 2-D ones
    for node in model.graph:
        if node.domain == "com.microsoft":
            if node.op_type in GROUPS["skip_layer_norm"]:
                norms, skips = norms + 1, skips + 1
            elif node.op_type in GROUPS["gelu"]:
                gelus += 1
            continue
        if node.domain not in ("", "ai.onnx"):
            continue
        if gelu_anchor(node):
            gelus += 1
        elif (normalized := _norm_input(node)) is not None:
            norms += 1
            if is_residual(normalized):
                shape, add = normalized.shape, through_casts(normalized).producer()
                (high if shape is not None and len(shape) > 3 else sums).add(add)
                if shape is not None and len(shape) == 2:
                    rows.add(add)
    return {
        "norms": norms,
        "residual_norms": skips + len(sums),
        "residual_norms_rank4": len(high),
        "residual_norms_rank2": len(rows),
        "gelus": gelus,
    }


def _norm_input(node: ir.Node) -> ir.Value | None:
    """The tensor ``node`` normalizes, when it is a norm op or the ``ReduceMean`` of a decomposed norm's squares
    (one per norm: the LayerNorm decomposition's first ReduceMean reads ``x`` itself, not a square)."""
    if node.op_type in _NORM_OPS:
        return node.inputs[0]
    if node.op_type != "ReduceMean" or node.inputs[0] is None or (square := node.inputs[0].producer()) is None:
        return None
    base = square.inputs[0]
    squared = _is_const(square.inputs[1], 2) if square.op_type == "Pow" else square.op_type == "Mul"
    if base is None or not squared or (square.op_type == "Mul" and square.inputs[1] is not base):
        return None
    centred = through_casts(base).producer()
    # LayerNorm written out: the squares are of x - mean(x), the norm's input is x
    return centred.inputs[0] if centred is not None and centred.op_type == "Sub" else base


def is_residual(value: ir.Value | None) -> bool:
    """An Add of two computed tensors of one shape: a residual sum, which a skip norm takes in. Looks through
    the Casts T5's TorchScript export writes before a norm's statistics (``x.to(float32)``). A constant operand
    is a bias or a learned position table (ViT's); an operand broadcast to the other's shape is a position
    table shared by the batch (Pegasus' and BlenderbotSmall's [S, H], BERT's [1, S, H]): the skip norm ops
    take neither as their skip input, and no rule fuses them."""
    if value is None:
        return False
    producer = through_casts(value).producer()
    if producer is None or producer.op_type != "Add" or producer.domain not in ("", "ai.onnx"):
        return False
    operands = producer.inputs
    computed = [v for v in operands if v is not None and v.producer() is not None and _constant(v) is None]
    if len(operands) != 2 or len(computed) != 2:
        return False
    shapes = [dims for v in computed if (dims := _dims(v)) is not None]
    return len(shapes) < 2 or not _broadcast(*shapes)  # unknown shapes count: too low a cap hides a real miss


def _broadcast(a: list, b: list) -> bool:
    """One of the shapes is broadcast to the other: a lower rank, or a static 1 against another extent."""
    if len(a) != len(b):
        return True
    return any((x == 1) != (y == 1) and (isinstance(x, int) or isinstance(y, int)) for x, y in zip(a, b, strict=True))


def _dims(value: ir.Value, depth: int = 4) -> list | None:
    """``value``'s dims, with the static ones ONNX inference loses through a Slice with a computed end (it
    leaves every axis unknown) read from the operands: a Gather keeps its indices' dims, a Slice the dims of
    the axes it does not cut. TorchScript's position ids are such a slice of a ``[1, max_positions]`` buffer,
    and their leading 1 is what tells a batch-broadcast position table from a residual."""
    dims = list(value.shape) if value.shape is not None else None
    node = value.producer()
    if not depth or node is None or any(v is None for v in node.inputs[:2]):
        return dims
    refined = None
    if node.op_type == "Gather":
        table, indices = _dims(node.inputs[0], depth - 1), _dims(node.inputs[1], depth - 1)
        axis = node.attributes.get_int("axis", 0)
        if table is not None and indices is not None:
            refined = table[:axis] + indices + table[axis + 1 :]
    elif node.op_type == "Slice" and len(node.inputs) > 3 and (axes := _constant(node.inputs[3])) is not None:
        data = _dims(node.inputs[0], depth - 1)
        if data:
            cut = {int(a) % len(data) for a in axes.reshape(-1)}
            refined = [None if i in cut else d for i, d in enumerate(data)]
    if refined is None or (dims is not None and len(dims) != len(refined)):
        return dims
    known = dims or refined
    return [r if isinstance(r, int) and not isinstance(d, int) else d for d, r in zip(known, refined, strict=True)]


_TANH_GELU_CUBIC = 0.044715
_TANH_GELU_DEPTH = 4


def gelu_anchor(node: ir.Node) -> bool:
    """Whether ``node`` is the op a GELU is anchored at: ``Erf``, ``Gelu``, QuickGELU's scaled ``Sigmoid``, or a
    ``Tanh`` of the tanh GELU's cubic (``x + 0.044715 * x^3``, up to four ops above it: a ``Pow(x, 3)`` or the
    0.044715 factor). A ``Tanh`` of anything else (a policy's action squashed to [-1, 1], an LSTM cell written
    out) is no GELU, and counting it reported a GELU missing."""
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type in ("Erf", "Gelu"):
        return True
    if node.op_type == "Sigmoid":
        return _scaled_sigmoid(node)
    if node.op_type != "Tanh":
        return False
    frontier = [node.inputs[0]]
    for _ in range(_TANH_GELU_DEPTH):
        following = []
        for value in frontier:
            producer = value.producer() if value is not None else None
            if producer is None:
                continue
            constants = [ir.convenience.get_const_tensor(v) for v in producer.inputs if v is not None]
            numbers = [float(c.numpy().reshape(-1)[0]) for c in constants if c is not None and c.size == 1]
            if producer.op_type == "Pow" and 3.0 in numbers:
                return True
            if producer.op_type == "Mul" and any(abs(n - _TANH_GELU_CUBIC) < 1e-4 for n in numbers):
                return True
            following.extend(producer.inputs)
        frontier = following
    return False


def _scaled_sigmoid(node: ir.Node) -> bool:
    """``Sigmoid(x * c)`` for a scalar constant ``c`` multiplied back by ``x``: QuickGELU (``c`` = 1.702, CLIP);
    SiLU's ``Sigmoid(x)`` has no scale."""
    scaled = node.inputs[0].producer() if node.inputs[0] is not None else None
    if scaled is None or scaled.op_type != "Mul":
        return False
    factor = [(v, _constant(v)) for v in scaled.inputs]
    x = next((v for v, c in factor if c is None), None)
    if x is None or not any(c is not None and c.size == 1 for _, c in factor):
        return False
    return any(u.node.op_type == "Mul" and x in u.node.inputs for u in node.outputs[0].uses())


def achieved_fusions(model: ir.Model) -> dict[str, int]:
    """Fused ops by group: ORT's contrib ops, and ONNX's own ``Attention`` (opset 23), which torch's exporter
    writes for scaled_dot_product_attention at that opset: attention fused before the upload."""
    ops = Counter(node.op_type for node in model.graph if node.domain == "com.microsoft")
    ops["Attention"] += sum(1 for node in model.graph if _onnx_attention(node))
    return {group: sum(ops[op] for op in members) for group, members in GROUPS.items()}


def residual_rms_ops(model: ir.Model) -> int:
    """ONNX ``RMSNormalization`` ops (opset 23) whose input is a residual sum: norms a skip norm would take in,
    written as the op onnxscript's skip-norm rule does not read."""
    return sum(
        1
        for node in model.graph
        if node.op_type == "RMSNormalization" and node.domain in ("", "ai.onnx") and is_residual(node.inputs[0])
    )


def _onnx_attention(node: ir.Node) -> bool:
    return node.op_type == "Attention" and node.domain in ("", "ai.onnx")


def count_layers(model: ir.Model) -> int:
    """Attention blocks: each ``Softmax`` left, plus each attention an earlier pass (``fuse_gqa``) fused. A
    Softmax over a product with a weight is no attention: a mixture of experts' router (Mixtral, Qwen2-MoE,
    OLMoE: ``softmax(x @ W_gate)`` per layer) counted as one doubled the attention (and residual norm) expected.
    Nor is one whose probabilities no product reads (``multiplied``): a spline flow's bin widths (VITS's
    duration predictor), a classifier's output."""
    return sum(
        1
        for node in model.graph
        if (node.op_type == "Softmax" and node.domain in ("", "ai.onnx") and not is_router(node) and multiplied(node))
        or (node.domain == "com.microsoft" and node.op_type in GROUPS["attention"])
        or _onnx_attention(node)
    )


_PRODUCTS = frozenset({"MatMul", "Einsum", "Gemm", "FusedMatMul"})


def multiplied(softmax: ir.Node, depth: int = 3) -> bool:
    """Whether a product (MatMul, Einsum, Gemm) reads the Softmax's probabilities, directly or through
    ``_PROBS_STEPS`` and re-layouts (a one-row query's probabilities are unsqueezed before their product):
    attention's ``probs @ V`` does, whatever V is."""
    frontier = [softmax.outputs[0]]
    for _ in range(depth + 1):
        following = []
        for value in frontier:
            for use in value.uses():
                if use.node.op_type in _PRODUCTS:
                    return True
                if use.node.op_type in (*_PROBS_STEPS, "Transpose", "Unsqueeze", "Squeeze", "Expand"):
                    following.extend(use.node.outputs)
        frontier = following
    return False


def is_router(softmax: ir.Node) -> bool:
    """Logits of weight products only: each MatMul/Gemm/Conv the scores come from (through score steps)
    multiplies by a constant: a router, or a token learner's pooling weights (MGP-STR's A3 module: a 1x1 Conv
    per output token, no keys). DeBERTa's scores add a product with a folded position table to q @ k^T:
    attention still."""
    products = _score_products(softmax.inputs[0], 4)
    return bool(products) and all(any(v is not None and is_constant(v) for v in node.inputs[:2]) for node in products)


def _score_products(value: ir.Value | None, depth: int) -> list[ir.Node]:
    """The MatMul/Gemm/Einsum/Conv nodes ``value`` is computed from through at most ``depth`` score steps."""
    node = value.producer() if value is not None else None
    if node is None or depth < 0:
        return []
    if node.op_type in ("MatMul", "Gemm", "Einsum", "Conv"):
        return [node]
    if node.op_type not in _SCORE_STEPS:
        return []
    return [found for v in node.inputs for found in _score_products(v, depth - 1)]


def count_cross_attention(model: ir.Model) -> int:
    """Cross attentions: those whose keys are computed from the encoder's side alone (its states or the
    cross-attention cache), as ``_decoder_structure`` tells them; 0 in encoders and decoder-only models."""
    return attention_counts(model)["cross"]


def _derives_from(value: ir.Value | None, op_type: str, depth: int = 6) -> bool:
    """True when ``value`` is computed from an ``op_type`` node within ``depth`` producers."""
    if value is None or depth < 0:
        return False
    node = value.producer()
    if node is None:
        return False
    if node.op_type == op_type:
        return True
    return any(_derives_from(v, op_type, depth - 1) for v in node.inputs)


def _embedding_gathers(model: ir.Model) -> list[tuple[ir.Node, ir.Value]]:
    """Gathers from a rank-2 initializer table on axis 0: (node, table)."""
    found = []
    for node in model.graph:
        if node.op_type != "Gather" or node.attributes.get_int("axis", 0) != 0 or node.inputs[0] is None:
            continue
        table = node.inputs[0]
        if table.const_value is not None and table.shape is not None and len(table.shape) == 2:
            found.append((node, table))
    return found


def detect_family(model: ir.Model) -> tuple[str, str]:
    """The family and the structural evidence for it, as a sentence for the report."""
    graph = model.graph
    ops = Counter(node.op_type for node in graph)
    input_names = {v.name for v in graph.inputs}
    if not ops["Softmax"] and not any(ops[op] for op in GROUPS["attention"]):
        return "unknown", "no Softmax: no attention block"
    if "decoder_input_ids" in input_names:
        if ops["LayerNormalization"]:
            return "bart", "encoder-decoder (graph input decoder_input_ids) with LayerNorms"
        return "t5", "encoder-decoder (graph input decoder_input_ids) with RMS norms"
    if cross := count_cross_attention(model):
        seen = f"an encoder-decoder's decoder: {cross} cross attentions (keys from the encoder's side alone)"
        if ops["LayerNormalization"]:
            return "bart", f"{seen}, LayerNorms"
        return "t5", f"{seen}, no LayerNorm"
    causal = _causal_mask(model)
    if not causal and ops["GroupQueryAttention"]:
        causal = "GroupQueryAttention (causal by construction; fused by an earlier pass)"
    if not causal and any(_onnx_attention(n) and n.attributes.get_int("is_causal", 0) for n in graph):
        causal = "ONNX Attention with is_causal (opset 23)"
    if not ops["LayerNormalization"]:
        rms_ops = ops["RMSNormalization"] + ops["SimplifiedLayerNormalization"]  # opset 23's op, or ORT's
        if rms_ops or (ops["Sqrt"] and ops["ReduceMean"] and ops["Pow"]):
            if causal:
                return "llama", f"a decoder: RMS normalization, no LayerNormalization, {causal}"
            return "t5", "RMS normalization (Pow, ReduceMean, Sqrt), no LayerNormalization, no causal mask"
        if (softmax := _scaled_dot_product(model)) is not None:
            return "encoder", (
                f"no LayerNormalization or RMS norm, but {softmax.name!r} is a Softmax of a product of two "
                "activations read by another (attention, as MobileBERT's with its NoNorm): attention alone"
            )
        return "unknown", "no LayerNormalization: not a LayerNorm transformer"
    if stem := _conv_stem(model):
        return stem
    if causal:
        return "gpt2", causal
    gathers = _embedding_gathers(model)
    for node, _table in gathers:
        offset = node.inputs[1].producer() if node.inputs[1] is not None else None
        if offset is not None and offset.op_type == "Add" and any(_is_const(v, 2) for v in offset.inputs):
            return "bart", f"positions read at an offset of 2 by {node.name!r} (BART's learned positions)"
    for node, _table in gathers:
        if _derives_from(node.inputs[1], "CumSum"):
            return "roberta", f"position ids from CumSum of the non-pad mask feed {node.name!r} (padding offset)"
    for node, table in gathers:  # vocabularies and position tables have hundreds of rows, token types 2
        rows = table.shape[0] if table.shape is not None else None
        if isinstance(rows, int) and 2 <= rows <= 16:
            return "bert", f"token-type embedding {table.name!r} ({rows} rows) read by {node.name!r}"
    if len(gathers) >= 2:
        return "distilbert", f"{len(gathers)} embedding tables, no token types, no causal mask"
    if len(gathers) == 1 and _reads_graph_input(gathers[0][0]):
        node = gathers[0][0]
        if any(u.node.op_type == "LayerNormalization" for u in node.outputs[0].uses()):
            return "distilbert", (
                f"one embedding table read by {node.name!r} from the input ids and normalized at once: no absolute "
                "positions (relative ones in attention, as DeBERTa-v3), no token types, no causal mask"
            )
        if (path := _pre_norm_residual(node.outputs[0])) is not None:
            return "vit", (
                f"one embedding table read by {node.name!r} from the input ids, its rows ({path}) read by both a "
                "LayerNorm and the residual Add around the block it feeds: a pre-norm text encoder (ESM-2), "
                "fused as ViT's pre-norm layers"
            )
    if (softmax := _scaled_dot_product(model)) is not None:
        # A model of the team's own (no transformers embedding layout: no positions, or positions elsewhere) is
        # still a LayerNorm transformer: its norms say where the residual stream is normalized.
        seen = f"{softmax.name!r} is a Softmax of a product of two activations (attention), LayerNorms"
        if _norm_beside_residual(graph):
            return "vit", f"{seen} read beside a residual Add (pre-norm); no embedding layout of a known family"
        return "distilbert", f"{seen} after residual Adds (post-norm); no embedding layout of a known family"
    return "unknown", (
        "no Softmax normalizes a product of two activations read by a third (Q @ K^T, then V): each is a gate or a "
        "classifier's (PatchTSMixer's gated attention: a Softmax over one Linear's output), no attention block"
    )


def _norm_beside_residual(graph: ir.Graph) -> bool:
    """Whether a value is read by both a LayerNormalization and an Add: ``x + block(LN(x))``, pre-norm. Post-norm
    normalizes the residual sum itself (``LN(x + block(x))``), which nothing else reads."""
    for node in graph:
        if node.op_type != "LayerNormalization" or node.inputs[0] is None:
            continue
        if any(u.node.op_type == "Add" for u in node.inputs[0].uses()):
            return True
    return False


# What an embedding passes through before the first block: scaling, the padding mask's product, a cast.
_EMBEDDING_STEPS = ("Mul", "Div", "Cast", "Where", "Identity", "Dropout")


def _pre_norm_residual(value: ir.Value, hops: int = 3) -> str | None:
    """The ops from the embedding lookup to a value that a LayerNormalization and an Add both read (the first
    pre-norm block: ``x + attn(LN(x))``), as words; None when no such value is within ``hops`` of them."""
    frontier, path = [value], ["Gather"]
    for _ in range(hops + 1):
        following = []
        for v in frontier:
            readers = {u.node.op_type for u in v.uses()}
            if "LayerNormalization" in readers and "Add" in readers:
                return " -> ".join(path)
            following += [u.node.outputs[0] for u in v.uses() if u.node.op_type in _EMBEDDING_STEPS]
        if len(following) != 1:  # one chain from the table to the first block, nothing else
            return None
        frontier = following
        path.append(following[0].producer().op_type)
    return None


# Between the scores' MatMul and the Softmax (scale, mask, bias); between the Softmax and the product with V.
# Reshape and Max: heads folded into the batch around the mask, and its clamp (transformers 4.x bmm attention, XGLM)
# TopK: GPT-OSS's router normalizes only its top-k logits, ``softmax(topk(x @ W + b).values)``
_SCORE_STEPS = ("Add", "Sub", "Mul", "Div", "Where", "Cast", "Reshape", "Max", "TopK")
# Slice: attention sinks' probabilities lose their sink column before the product with v (GPT-OSS)
_PROBS_STEPS = ("Where", "Cast", "Dropout", "Identity", "Reshape", "Slice")


def _activation_product(value: ir.Value | None, depth: int) -> bool:
    """``value`` is a MatMul of two computed values (no weight), through at most ``depth`` score steps."""
    node = value.producer() if value is not None else None
    if node is None or depth < 0:
        return False
    if node.op_type == "MatMul" or (node.op_type == "Einsum" and len(node.inputs) == 2):  # XLNet's, Keras's
        return all(v is not None and v.const_value is None and not v.is_initializer() for v in node.inputs)
    return node.op_type in _SCORE_STEPS and any(_activation_product(v, depth - 1) for v in node.inputs)


def _read_by_product(value: ir.Value, depth: int = 2) -> bool:
    for use in value.uses():
        node = use.node
        if node.op_type == "MatMul" or (node.op_type == "Einsum" and len(node.inputs) == 2):
            other = node.inputs[1 - use.idx] if use.idx < 2 else None
            if other is not None and other.const_value is None and not other.is_initializer():
                return True
        elif node.op_type in _PROBS_STEPS and depth > 0 and _read_by_product(node.outputs[0], depth - 1):
            return True
    return False


def _scaled_dot_product(model: ir.Model) -> ir.Node | None:
    """The first Softmax of ``Q @ K^T`` (scaled, masked) whose probabilities multiply another activation (V):
    self-attention, not a classifier's Softmax over a weight product."""
    for node in model.graph:
        if node.op_type == "Softmax" and _activation_product(node.inputs[0], 4) and _read_by_product(node.outputs[0]):
            return node
    return None


def _reads_graph_input(node: ir.Node) -> bool:
    index = node.inputs[1]
    return index is not None and index.is_graph_input()


# rank 5: a video [B, frames, C, H, W] (VideoMAE, ViViT, TimeSformer) read by a tubelet Conv3d: ViT layers
_STEM = {
    5: ("vit", "tubelet-embedding"),
    4: ("vit", "patch-embedding"),
    3: ("whisper", "spectrogram"),
    2: ("wav2vec2", "raw-audio"),
}


def _conv_stem(model: ir.Model) -> tuple[str, str] | None:
    """A Conv reading a float graph input (directly, or through the Unsqueeze/Reshape/Cast that give raw
    audio its channel axis, and the Transpose that puts a spectrogram's bins first, as AST's patch stem
    does): the family by the input's rank, with the evidence."""
    for node in model.graph:
        if node.op_type != "Conv":
            continue
        source, hops = node.inputs[0], 0
        while source is not None and not source.is_graph_input() and hops < 3:
            producer = source.producer()
            if producer is None or producer.op_type not in ("Unsqueeze", "Reshape", "Cast", "Identity", "Transpose"):
                break
            source, hops = producer.inputs[0], hops + 1
        if source is None or not source.is_graph_input() or source.shape is None:
            continue
        if source.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
            continue
        rank = len(source.shape)
        if rank in _STEM:
            family, kind = _STEM[rank]
            return family, f"{kind} Conv {node.name!r} on the {rank}-D input {source.name!r}"
    return None


def _causal_mask(model: ir.Model) -> str:
    """The causal mask's evidence as words, or "" when the graph has none."""
    for node in model.graph:
        if node.op_type == "Trilu":
            return "causal mask built with Trilu"
        if node.op_type in _COMPARE and all(
            v is not None and v.const_value is None and _derives_from(v, "Range") for v in node.inputs
        ):
            return f"causal mask: {node.op_type} {node.name!r} compares two Range-derived index tensors"
    return ""


def _is_const(value: ir.Value | None, number: float) -> bool:
    array = _constant(value)
    return array is not None and array.size == 1 and float(array.reshape(-1)[0]) == number


def detect_sizes(model: ir.Model) -> tuple[int, int]:
    """(num_heads, hidden_size) from shapes, 0 where unknown (ORT's optimizer then detects them, except for
    ViT, whose fusion asserts both are given)."""
    hidden = 0
    for node in model.graph:
        if node.op_type == "LayerNormalization" and node.inputs[1] is not None and node.inputs[1].shape:
            dim = node.inputs[1].shape[-1]
            hidden = dim if isinstance(dim, int) else 0
            break
    for node in model.graph:
        heads = _heads(node) if node.op_type == "Softmax" else 0
        fused = node.domain == "com.microsoft" and node.op_type in GROUPS["attention"]  # by fuse_gqa
        heads = heads or (node.attributes.get_int("num_heads", 0) if fused else 0)
        # A count the hidden size does not divide is another block's (PEGASUS-X's block-local scores come first),
        # and ORT's optimizer asserts on it: the next Softmax says.
        if heads and (not hidden or hidden % heads == 0):
            return heads, hidden
    return 0, hidden


_PASS_THROUGH = frozenset({"Mul", "Div", "Add", "Sub", "Where", "Cast", "Identity", "Transpose"})


def _heads(softmax: ir.Node) -> int:
    """The head count of the attention feeding ``softmax``: q's heads axis when inference knows it (dynamo),
    else read off q's head split. TorchScript splits heads with a run-time shape, ``Reshape(x[B,S,W],
    Concat(B, S, -1, d))``, whose output axis inference leaves unknown; ``d`` (or the head count itself,
    where the exporter wrote it instead of -1) is a constant there, and heads = W / d."""
    producer = softmax.inputs[0].producer() if softmax.inputs[0] is not None else None
    while producer is not None and producer.op_type != "MatMul":
        if producer.op_type not in _PASS_THROUGH and producer.op_type != "Reshape":  # Reshape: bmm's unfold
            return 0
        producer = _scores_producer(producer)
    q = producer.inputs[0] if producer is not None else None
    if q is None:
        return 0
    if q.shape is not None and len(q.shape) == 4 and isinstance(q.shape[1], int):
        return q.shape[1]
    split = q.producer()
    for _ in range(8):  # Transpose, SDPA's scaling (q * sqrt(scale)) and bmm's [B*h, S, d] fold sit between
        if split is None or (split.op_type == "Reshape" and len(_shape_values(split.inputs[1]) or ()) == 4):
            break
        split = _first_input_producer(split) if split.op_type in _PASS_THROUGH or split.op_type == "Reshape" else None
    if split is None or split.inputs[0] is None:
        return 0
    dims = _shape_values(split.inputs[1])
    assert dims is not None
    heads, size = dims[2], dims[3]
    if heads is not None and heads > 0:
        return heads
    width = split.inputs[0].shape[-1] if split.inputs[0].shape is not None else None
    if size and size > 0 and isinstance(width, int) and width % size == 0:
        return width // size
    return 0


def _scores_producer(node: ir.Node) -> ir.Node | None:
    """The producer of the scores ``node`` passes on: a mask's ``Where(cond, fill, scores)`` (or with the
    two swapped) carries them in its computed branch, every other op in its first input."""
    if node.op_type == "Where":
        branch = next((v for v in node.inputs[1:] if v is not None and _constant(v) is None), None)
        return branch.producer() if branch is not None else None
    return _first_input_producer(node)


def _first_input_producer(node: ir.Node) -> ir.Node | None:
    return node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None


def _shape_values(value: ir.Value | None) -> list[int | None] | None:
    """A shape operand's entries where constant (None where computed), or None when not readable."""
    tensor = _constant(value)
    if tensor is not None:
        return [int(x) for x in tensor.reshape(-1)]
    producer = value.producer() if value is not None else None
    if producer is None or producer.op_type != "Concat":
        return None
    entries: list[int | None] = []
    for part in producer.inputs:
        piece = _constant(part)
        if piece is not None:
            entries += [int(x) for x in piece.reshape(-1)]
        elif part is not None and part.shape is not None and len(part.shape) == 1 and isinstance(part.shape[0], int):
            entries += [None] * part.shape[0]
        else:
            return None
    return entries


def _constant(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    tensor = value.const_value
    producer = value.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant":
        attr = producer.attributes.get("value")
        tensor = attr.value if attr is not None else None
    return None if tensor is None else tensor.numpy()


_ID_SHAPES = ((1, 7), (3, 16), (2, 33))  # (batch, sequence): odd lengths, several rows


def verification_feeds(model: ir.Model, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Inputs when the context has no samples, made for each input's role by ``core.inputs`` (the one
    synthesis every caller uses): ids within the vocabulary, right-padded masks, past and special tokens as
    the graph needs them."""
    synthesis = InputSynthesis(model, seed=seed)
    rng = np.random.default_rng(seed)
    return [synthesis.feeds_at(batch, seq, rng) for batch, seq in _ID_SHAPES]
