"""Per-layer reasons for ``fuse_transformer``: every attention, residual norm and GELU left unfused, by layer.

A count ("attention: expected 12, achieved 11") does not say which layer stayed, nor why. After the pass, each
unfused site is found by its anchor op, the one op that survives only where the fusion did not happen:

=================  ====================================================================================
group              anchor (left in the graph)                rule sets traced at the site
=================  ====================================================================================
attention          ``Softmax``                               onnxscript ``sdpa``
skip_layer_norm    ``LayerNormalization`` of a residual Add,  onnxscript ``skip_layer_normalization``;
                   or an RMS norm's ``Pow(x, 2)`` of one      ``rms_normalization`` and ours (opset 17)
gelu               ``Erf`` or ``Tanh``                        onnxscript ``gelu``, ``bias_gelu``; ours (tanh)
=================  ====================================================================================

Each reason names the layer (the anchor's rank among the original graph's anchors of that op; in a seq2seq
decoder, self and cross attention are ranked apart, as ``_decoder_structure`` tells them), the family,
the node, what the rule expects, the subgraph found (its ops, constants by value, a few producers deep) and
where the closest rule stopped, with onnxscript's own ``MatchResult.fail`` reason, traced per root node
(``_onnxscript_adapter.trace_roots``; attention after the steps the pipeline runs before SDPA). A shortfall
is then never just a number.

Where no candidate was applied, the reasons are read on the onnxscript candidate, and the errors that kept
the candidates out come with them (``rejected``): a site that candidate did fuse says it was fused and why
that was not applied (a cycle, a failed check), instead of a rule's complaint about another graph.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes._infra import NonMatch
from passes.fusion import _attention_bias as attention_bias
from passes.fusion import _fusion_families as fam
from passes.fusion import _kernel_fit as kernel_fit
from passes.fusion import _merge_heads as merge_heads
from passes.fusion import _onnxscript_adapter as adapter
from passes.fusion import _rms_norm_opset17 as rms_norm_opset17
from passes.fusion import _shared_scale as shared_scale
from passes.fusion import _sink_column as sink_column
from passes.fusion import _tanh_gelu as tanh_gelu
from passes.fusion._decoder_structure import attention_kinds

_ONNX = ("", "ai.onnx")
_FOUND_CHARS = 400  # the found subgraph, cut: the report is read by people
# How far below its anchor a rule's root node sits: an RMS norm's is the weight Mul six ops below its
# Pow(x, 2) (ReduceMean, Add, Sqrt, Div/Reciprocal, Mul(x, .), Mul(weight)), past the default four.
_ROOT_DEPTH = {"Pow": 6}
EXPECTED = {
    "attention": "MatMul(q, Transpose(k)) scaled by a constant (Mul/Div on q, k or the scores), at most one "
    "additive mask (or a Where filling -inf/min), Softmax, MatMul(., v); q, k, v of shape [B, heads, S, head_dim] "
    "(or folded to [B*heads, S, head_dim] and unfolded around the Softmax, with terms of the folded scores' shape, "
    "such as DeBERTa's relative-position c2p and p2c, added before the unfold)",
    "skip_layer_norm": "a norm of a residual Add(x, skip) (LayerNormalization, or x * rsqrt(mean(x^2) + eps) * weight)",
    "gelu": "0.5 * x * (1 + Erf(x / sqrt(2))) or 0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))",
}


def layer_reasons(
    model: ir.Model, original: ir.Model, family: str, groups: set[str], rejected: str = ""
) -> list[NonMatch]:
    """A NonMatch per unfused site of ``groups`` in ``model`` (the fused candidate), layers numbered on
    ``original``. ``rejected``: why ``model`` was not applied (the refused candidates' errors), or "" when it
    was; then every site of ``original`` that ``model`` fused is reported too, with that error."""
    rejected = " ".join(rejected.split())  # one line: ONNX's checker writes the failing node over several
    reasons = _rejected_sites(model, original, family, groups, rejected) if rejected else []
    sites = [(group, node) for node in model.graph for group in _groups_of(node) if group in groups]
    if not sites:
        return reasons
    # Traced only for the groups left with a site: each trace applies its rule sets to a copy of the model,
    # a second on a seq2seq export, for a group whose every site fused.
    tracers = {
        "attention": lambda: adapter.trace_roots(_before_sdpa(model), ["sdpa"]),
        "skip_layer_norm": lambda: adapter.trace_roots(
            model, ["skip_layer_normalization", "rms_normalization", rms_norm_opset17.rules]
        ),
        "gelu": lambda: adapter.trace_roots(model, ["gelu", "bias_gelu", tanh_gelu.rules]),
    }
    traced = {group: tracers[group]() for group in dict.fromkeys(group for group, _ in sites)}
    order = _ranks(original)
    for group, anchor in sites:
        label, layer = order.get((anchor.op_type, anchor.name), (None, "?"))
        kind = label or {"attention": "attention", "skip_layer_norm": "residual norm", "gelu": "GELU"}[group]
        head = f"{kind} layer {layer} ({family}, node {anchor.name})"
        known = _attention_left_by_design(anchor, family) if group == "attention" else None
        if known is not None:
            reason = f"attention: {head}: {known}"
        else:
            attempt = _closest(anchor, traced[group], _ROOT_DEPTH.get(anchor.op_type, 4))
            if group == "gelu":
                found = describe(_gelu_root(anchor).outputs[0])
            else:
                found = f"{anchor.op_type}({describe(anchor.inputs[0])})"
            blocked = attempt.describe() if attempt else "no rule got past its first node here"
            reason = f"{group}: {head}: expected {EXPECTED[group]}; found {found[:_FOUND_CHARS]}; {blocked}"
        if rejected:
            reason += f"; and no candidate was applied: {rejected}"
        reasons.append(NonMatch(reason, node=anchor.name, op_type=anchor.op_type))
    return reasons


def _rejected_sites(model: ir.Model, original: ir.Model, family: str, groups: set[str], why: str) -> list[NonMatch]:
    """The sites of ``original`` that the refused candidate ``model`` fused (their anchors are gone from it):
    each fused there, and not applied for ``why``."""
    left = {(node.op_type, node.name) for node in model.graph if _groups_of(node)}
    order = _ranks(original)
    reasons = []
    for node in original.graph:
        for group in _groups_of(node):
            if group not in groups or (node.op_type, node.name) in left:
                continue
            label, layer = order.get((node.op_type, node.name), (None, "?"))
            kind = label or {"attention": "attention", "skip_layer_norm": "residual norm", "gelu": "GELU"}[group]
            head = f"{kind} layer {layer} ({family}, node {node.name})"
            reason = f"{group}: {head}: fused by the onnxscript candidate, which was not applied: {why}"
            reasons.append(NonMatch(reason, node=node.name, op_type=node.op_type))
    return reasons


def attention_by_design(model: ir.Model, family: str | None = None) -> dict[str, str]:
    """Softmax node name -> why that attention stays unfused by design, for each one the graph explains."""
    found = {}
    for node in model.graph:
        if node.op_type == "Softmax" and node.domain in _ONNX and (why := _attention_left_by_design(node, family)):
            found[node.name or ""] = why
    return found


def _attention_left_by_design(softmax: ir.Node, family: str | None = None) -> str | None:
    """Why an attention cannot or should not fuse whatever the rules match, when the graph says so; else None.
    ``family``: fuse_transformer's; in a decoder, values narrower than the keys are multi-head latent attention."""
    if (shown := _probabilities_shown(softmax)) is not None:
        return (
            f"its probabilities are the model's output {shown!r} (output_attentions): a fused attention kernel "
            "does not return them, so this layer stays unfused"
        )
    if (second := _probabilities_reread(softmax)) is not None:
        return (
            f"its probabilities are also read by {second} besides their product with V (relative position values "
            "added to the output: VITS's windowed attention), which a fused attention kernel does not expose, so "
            "this layer stays unfused"
        )
    if (values := _tensor_scale(softmax)) is not None:
        return (
            f"its scores are scaled by a tensor of {values} distinct values (a learned temperature per head: "
            "cross-covariance attention, EdgeNeXt's and XCiT's), and the fused attention kernels take one scalar "
            "scale"
        )
    if sink_column.is_sink_column(softmax):
        gqa = (
            " computed per token (a projection of the states, not one learned logit per head): GroupQueryAttention's "
            "head_sink is one constant per head"
            if sink_column.sink_computed(softmax)
            else ": GroupQueryAttention takes sinks only causal (fuse_gqa's reason for this layer says why not here)"
        )
        return (
            f"its scores take an attention sink as a softmax column{gqa} and MultiHeadAttention has no sink input; "
            "written as one more key with a zero value and the sink in the bias it fuses exactly but measured slower "
            "than unfused (1.45x at 128 tokens, 1.55x at 512: bench/sink_attention_ab.py), so this layer stays unfused"
        )
    if (why := kernel_fit.marked(softmax)) is not None:
        return why
    if (found := kernel_fit.operands(softmax)) is not None:
        query, value = found
        if (why := kernel_fit.heads_along_input(query)) is not None:
            return why
        if family in kernel_fit.DECODER_FAMILIES and kernel_fit.latent(query, value):
            return f"multi-head latent attention (values narrower than the keys): {kernel_fit.LATENT_SLOWER}"
    if _one_query_row(softmax):
        return (
            "its queries are one row (a slice of the output, the CLS token's, moved up into the block by "
            "upstream_slice): the scores of that row alone, unfused, are less work than a fused kernel over "
            "every query"
        )
    return None


def _probabilities_shown(softmax: ir.Node) -> str | None:
    """The graph output the Softmax's probabilities are (directly or through Cast/Identity/Dropout), if any."""
    value = softmax.outputs[0]
    for _ in range(3):
        if value.is_graph_output():
            return value.name
        readers = [u.node for u in value.uses() if u.node.op_type in ("Cast", "Identity", "Dropout")]
        if len(readers) != 1:
            return None
        value = readers[0].outputs[0]
    return None


def _probabilities_reread(softmax: ir.Node) -> str | None:
    """The other reader (``op 'name'``) of the Softmax's probabilities (through Cast/Identity/Dropout), when
    something besides one product reads them; shapes do not count."""
    value = softmax.outputs[0]
    for _ in range(3):
        readers = [u.node for u in value.uses() if u.node.op_type != "Shape"]
        if len(readers) == 1 and readers[0].op_type in ("Cast", "Identity", "Dropout"):
            value = readers[0].outputs[0]
            continue
        products = [n for n in readers if n.op_type in ("MatMul", "Einsum")]
        others = [n for n in readers if n not in products]
        if products and (others or len(products) > 1):
            other = others[0] if others else products[1]
            return f"{other.op_type} {other.name!r}"
        return None
    return None


def _tensor_scale(softmax: ir.Node) -> int | None:
    """How many distinct values the constant scaling the Softmax's scores holds (through a mask's Add or
    Where), when more than one: a scale per head, which no attention kernel's scalar ``scale`` can carry."""
    value = softmax.inputs[0]
    for _ in range(3):
        node = value.producer() if value is not None else None
        if node is None or node.domain not in _ONNX or node.op_type not in ("Mul", "Div", "Add", "Where"):
            return None
        if node.op_type in ("Mul", "Div"):
            for operand in node.inputs[1:] if node.op_type == "Div" else node.inputs:
                array = operand.const_value.numpy() if operand is not None and operand.const_value else None
                if array is not None and array.size > 1 and (distinct := len(np.unique(array))) > 1:
                    return distinct
            return None
        value = node.inputs[1] if node.op_type == "Where" else node.inputs[0]
    return None


def _one_query_row(softmax: ir.Node) -> bool:
    """Scores of a single query: the Softmax reads (through a scale or mask) the ``Squeeze`` of a product whose
    query axis is 1 long, which ``upstream_slice`` leaves where it moved a scalar slice across the product, or
    a Gather of one query row of the scores, where the slice stopped before the product."""
    value = softmax.inputs[0]
    for _ in range(4):
        node = value.producer() if value is not None else None
        if node is None or node.domain not in _ONNX:
            return False
        if node.op_type == "Gather" and _query_row_gather(node):  # the slice stopped at the scores themselves
            return True
        if node.op_type == "Squeeze":
            product = node.inputs[0].producer() if node.inputs[0] is not None else None
            if product is None or product.op_type not in ("MatMul", "FusedMatMul") or product.inputs[0] is None:
                return False  # FusedMatMul: ORT's optimizer took k's Transpose in (the fused candidate)
            query = product.inputs[0].shape
            return query is not None and len(query) >= 2 and query[-2] == 1
        if node.op_type not in ("Mul", "Div", "Add", "Cast", "Where"):
            return False
        value = node.inputs[0]
    return False


def _query_row_gather(node: ir.Node) -> bool:
    """A Gather of one index on the query axis (-2) of rank-4 scores: one query row of every head."""
    scores, index = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    if scores is None or index is None or scores.shape is None or len(scores.shape) != 4:
        return False
    axis = node.attributes.get_int("axis", 0)
    return axis in (2, -2) and index.shape is not None and len(index.shape) == 0


def _groups_of(node: ir.Node) -> list[str]:
    if node.domain not in _ONNX:
        return []
    if node.op_type == "Softmax":
        return ["attention"]
    if node.op_type in ("Erf", "Tanh") and fam.gelu_anchor(node):
        return ["gelu"]
    if node.op_type == "LayerNormalization" and _is_residual(node.inputs[0]):
        return ["skip_layer_norm"]
    if node.op_type == "Pow" and _is_residual(node.inputs[0]) and _reads_mean(node):
        return ["skip_layer_norm"]
    return []


def _is_residual(value: ir.Value | None) -> bool:
    """A residual sum a skip norm would take in, as ``fuse_transformer`` counts the sites it expects to fuse
    (``_fusion_families.is_residual``): a site reported here is one the expected count includes."""
    return fam.is_residual(value)


def _reads_mean(pow_node: ir.Node) -> bool:
    return any(use.node.op_type == "ReduceMean" for use in pow_node.outputs[0].uses())


def _ranks(model: ir.Model) -> dict[tuple[str, str], tuple[str | None, int]]:
    """(op_type, node name) -> (label, rank): the node's rank among the anchors of its op in graph order,
    counted from 0. In a seq2seq decoder, self and cross attention are numbered apart and named so ("cross-
    attention layer 0" is layer 0's, not a layer 1 of its own); the label is None elsewhere."""
    kinds = attention_kinds(model) if any(n.op_type == "Softmax" for n in model.graph) else {}
    seq2seq = "cross" in kinds.values()
    seen: dict[str, int] = {}
    ranks: dict[tuple[str, str], tuple[str | None, int]] = {}
    for node in model.graph:
        if _groups_of(node):
            label = f"{kinds.get(node.name or '', 'self')}-attention" if seq2seq and node.op_type == "Softmax" else None
            key = label or node.op_type
            ranks[(node.op_type, node.name)] = (label, seen.get(key, 0))
            seen[key] = seen.get(key, 0) + 1
    return ranks


def _before_sdpa(model: ir.Model) -> ir.Model:
    """A copy with the steps fuse_for_ort runs before the SDPA rules (the head-merge guard, T5's bias and mask
    grouped into one, the scores' own copy of a shared query scaling): traced without them, a T5 attention
    would be reported as stopped by its second additive term, a form the pipeline does fuse."""
    copy = model.clone()  # shares the weights: the rules rewrite nodes, never a tensor
    merge_heads.rules.apply_to_model(copy)
    attention_bias.rules.apply_to_model(copy)
    shared_scale.give_scores_their_own_scale(copy)
    return copy


def _neighbourhood(anchor: ir.Node, down: int = 4) -> list[ir.Node]:
    """The anchor and the nodes up to ``down`` consumers below it: where the rule's root node sits."""
    found, frontier = [anchor], [anchor]
    for _ in range(down):
        frontier = [use.node for node in frontier for out in node.outputs for use in out.uses()]
        found += frontier
    return found


def _closest(anchor: ir.Node, attempts: dict[str, adapter.Attempt], down: int = 4) -> adapter.Attempt | None:
    candidates = [attempts[n.name] for n in _neighbourhood(anchor, down) if n.name in attempts]
    order = {"SUCCESS": 3, "REPLACEMENT_FAILED": 2, "CONDITION_FAILED": 1, "NO_MATCH": 0}
    return max(candidates, key=lambda a: (order.get(a.status, 0), a.matched), default=None)


def _gelu_root(anchor: ir.Node) -> ir.Node:
    """The last Mul below an Erf/Tanh within three consumers: the GELU's output node."""
    root = anchor
    for node in _neighbourhood(anchor, 3)[1:]:
        if node.op_type == "Mul":
            root = node
    return root


def describe(value: ir.Value | None, depth: int = 4) -> str:
    """The ops computing ``value``, ``depth`` producers deep, constants by value: ``Div(MatMul(..), Sqrt(..))``."""
    if value is None:
        return "none"
    tensor = value.const_value
    producer = value.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant":
        attr = producer.attributes.get("value")
        tensor = attr.value if attr is not None else None
    if tensor is not None:
        return f"{float(tensor.numpy().reshape(-1)[0]):g}" if tensor.size == 1 else f"const{list(tensor.shape)}"
    if producer is None:
        return value.name or "input"
    if depth == 0:
        return f"{producer.op_type}(..)"
    args = ", ".join(describe(v, depth - 1) for v in producer.inputs)
    return f"{producer.op_type}({args})"
