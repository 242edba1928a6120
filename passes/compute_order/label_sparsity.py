"""label_sparsity: compute the loss only on rows whose label is not the ignore index.

Re-implements ONNX Runtime's training-only ``InsertGatherBeforeSceLoss``
(orttraining/core/optimizer/compute_optimizer/sceloss_compute_optimization.cc) over plain ONNX, for
graphs that compute a loss at inference time (evaluation with labels, a masked-LM with 15% valid labels).
ORT inserts its contrib ``ShrunkenGather``; this pass inserts a standard ``Gather`` whose indices come from
``Squeeze(NonZero(mask))``, the form ``upstream_slice`` recognises as a shrinking slice, so that running
``upstream_slice`` afterwards carries the row filter up through the LM head (the [N,H]x[H,V] MatMul and
the softmax over the vocabulary then run on valid rows only).

Before (either exporter form)::

    logits[N,C] ---------------------> SoftmaxCrossEntropyLoss(ignore_index=ii) --> loss
    labels[N] -----------------------^
    logits[N,C] --> LogSoftmax(axis=1) --> NegativeLogLikelihoodLoss(ignore_index=ii) --> loss
    labels[N] ---------------------------^

After::

    labels --> Equal(ii) --> Not --> Slice([1:]) --> Concat([True], .) --> NonZero --> Squeeze(0) --> idx
    logits --> Gather(idx, axis=0) --> [LogSoftmax -->] loss op (same attributes) --> loss
    labels --> Gather(idx, axis=0) ----^

Row 0 is always kept (the ``Concat([True], mask[1:])``): ORT's SoftmaxCrossEntropyLoss fails on an empty
batch while the original all-ignored batch yields NaN. The kept row 0 is either valid or carries the ignore
index, so it changes neither the sum nor the mean, and an all-ignored batch still yields NaN as before.

Class weights need no change: they are indexed by label, and the weighted mean divides by the sum of the
weights of the non-ignored labels, which the filter preserves.

Whether the rewrite pays depends on the data: the pass measures the label density (share of labels that
are not the ignore index) on the context's samples and applies only below ``density_threshold`` (ORT's
runtime inspector uses 90%). Fixes over ORT: the NLL(LogSoftmax) form that other exporters produce is
handled, the empty batch is guarded, and no flag op or label-name list is needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from pydantic import Field

from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult

_SHAPE_ONLY_OPS = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast"}


class LabelSparsityOptions(PassOptions):
    density_threshold: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Apply only when the share of labels that are not the ignore index, measured on the "
        "samples, is below this (ORT's runtime inspector uses 0.9).",
    )
    force: bool = Field(False, description="Apply without measuring the label density (no samples needed).")


class _Site:
    """One loss node that can take the filter: the tensors to gather and the node consuming them."""

    def __init__(self, loss: ir.Node, logits_consumer: ir.Node, logits: ir.Value, labels: ir.Value, ignore: int):
        self.loss = loss
        self.logits_consumer = logits_consumer  # the loss itself, or the LogSoftmax before an NLL loss
        self.logits = logits
        self.labels = labels
        self.ignore_index = ignore


class LabelSparsity(Pass[LabelSparsityOptions]):
    name = "label_sparsity"
    summary = "Compute the loss (and, with upstream_slice, the LM head) only on rows with a valid label."
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        options = self.options
        non_matches: list[NonMatch] = []
        sites = [s for node in list(model.graph) if (s := self._match(node, non_matches)) is not None]
        notes: dict[str, Any] = {"sites": len(sites), "threshold": options.density_threshold}
        if not sites:
            notes["decision"] = "skipped: no loss node matched"
            return PassResult(model, False, {"losses_filtered": 0}, non_matches, notes)

        chosen: list[_Site] = []
        densities: dict[str, float | None] = {}
        for site in sites:
            density = None if options.force else _label_density(model, site, ctx.samples)
            densities[site.loss.name or site.loss.op_type] = density
            if options.force:
                chosen.append(site)
            elif density is None:
                non_matches.append(_nm(site.loss, "no samples to measure the label density of (give samples or force)"))
            elif density >= options.density_threshold:
                non_matches.append(
                    _nm(
                        site.loss,
                        f"label density {density:.1%} >= threshold {options.density_threshold:.0%}: "
                        "filtering would cost more than it saves",
                    )
                )
            else:
                chosen.append(site)
        notes["label_density"] = densities

        for site in chosen:
            _rewrite(model.graph, site)
        notes["decision"] = f"applied to {len(chosen)} of {len(sites)} loss node(s)" if chosen else "skipped"
        return PassResult(model, bool(chosen), {"losses_filtered": len(chosen)}, non_matches, notes)

    @staticmethod
    def _match(node: ir.Node, non_matches: list[NonMatch]) -> _Site | None:
        if node.domain not in ("", "ai.onnx") or node.op_type not in (
            "SoftmaxCrossEntropyLoss",
            "NegativeLogLikelihoodLoss",
        ):
            return None
        reduction = node.attributes.get_string("reduction", "mean")
        if reduction not in ("mean", "sum"):
            non_matches.append(_nm(node, f"reduction {reduction!r}: the output shape depends on every row"))
            return None
        if "ignore_index" not in node.attributes:
            non_matches.append(_nm(node, "no ignore_index: every row is valid"))
            return None
        if len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output()):
            non_matches.append(_nm(node, "log_prob output is used: its rows would be dropped"))
            return None
        logits, labels = node.inputs[0], node.inputs[1]
        if logits is None or labels is None:
            return None
        if _rank(logits) != 2 or _rank(labels) != 1:
            non_matches.append(
                _nm(
                    node,
                    f"needs logits of rank 2 and labels of rank 1, got {_rank(logits)} and {_rank(labels)}",
                )
            )
            return None
        consumer = node
        if node.op_type == "NegativeLogLikelihoodLoss":
            producer = logits.producer()
            if producer is None or producer.op_type != "LogSoftmax":
                non_matches.append(_nm(node, "NegativeLogLikelihoodLoss input is not a LogSoftmax"))
                return None
            if producer.attributes.get_int("axis", -1) not in (1, -1):
                non_matches.append(_nm(producer, "LogSoftmax is not over the class axis"))
                return None
            if len(logits.uses()) != 1 or logits.is_graph_output():
                non_matches.append(_nm(producer, "LogSoftmax output has other consumers"))
                return None
            consumer, logits = producer, producer.inputs[0]
            if logits is None or _rank(logits) != 2:
                return None
        return _Site(node, consumer, logits, labels, node.attributes.get_int("ignore_index"))


def _rewrite(graph: ir.Graph, site: _Site) -> None:
    prefix = f"{site.loss.name or 'loss'}/label_sparsity"
    dtype = site.labels.dtype or ir.DataType.INT64
    ignore = ir.tensor(np.array([site.ignore_index], dtype=dtype.numpy()), name=f"{prefix}/ignore_index")
    nodes = [
        ir.node("Constant", [], {"value": ignore}, name=f"{prefix}/ignore_index"),
    ]
    equal = ir.node("Equal", [site.labels, nodes[0].outputs[0]], name=f"{prefix}/equal")
    valid = ir.node("Not", [equal.outputs[0]], name=f"{prefix}/not")
    starts = ir.node("Constant", [], {"value": ir.tensor(np.array([1], np.int64))}, name=f"{prefix}/starts")
    ends = ir.node(
        "Constant",
        [],
        {"value": ir.tensor(np.array([np.iinfo(np.int64).max], np.int64))},
        name=f"{prefix}/ends",
    )
    tail = ir.node("Slice", [valid.outputs[0], starts.outputs[0], ends.outputs[0]], name=f"{prefix}/tail")
    first = ir.node("Constant", [], {"value": ir.tensor(np.array([True]))}, name=f"{prefix}/keep_first")
    keep = ir.node("Concat", [first.outputs[0], tail.outputs[0]], {"axis": 0}, name=f"{prefix}/keep")
    nonzero = ir.node("NonZero", [keep.outputs[0]], name=f"{prefix}/nonzero")
    axes = ir.node("Constant", [], {"value": ir.tensor(np.array([0], np.int64))}, name=f"{prefix}/axes")
    idx = ir.node("Squeeze", [nonzero.outputs[0], axes.outputs[0]], name=f"{prefix}/indices")
    gather_logits = ir.node("Gather", [site.logits, idx.outputs[0]], {"axis": 0}, name=f"{prefix}/gather_logits")
    gather_labels = ir.node("Gather", [site.labels, idx.outputs[0]], {"axis": 0}, name=f"{prefix}/gather_labels")
    for value, name in (
        (idx.outputs[0], "indices"),
        (gather_logits.outputs[0], "logits"),
        (gather_labels.outputs[0], "labels"),
    ):
        value.name = f"{prefix}/{name}"
    # The row count is now data-dependent: give the filtered values their own symbolic dim, or ORT's
    # allocation planner trusts the stale [N, C] shapes downstream and warns on every run.
    rows = ir.SymbolicDim(f"{prefix}/valid_rows")
    classes = site.logits.shape[1] if site.logits.shape is not None else None
    gather_logits.outputs[0].dtype = site.logits.dtype
    gather_logits.outputs[0].shape = ir.Shape([rows, classes])
    gather_labels.outputs[0].dtype = site.labels.dtype
    gather_labels.outputs[0].shape = ir.Shape([rows])
    idx.outputs[0].dtype = ir.DataType.INT64
    idx.outputs[0].shape = ir.Shape([rows])
    if site.logits_consumer is not site.loss:  # LogSoftmax before an NLL loss
        site.logits_consumer.outputs[0].shape = ir.Shape([rows, classes])
    nodes += [equal, valid, starts, ends, tail, first, keep, nonzero, axes, idx, gather_logits, gather_labels]
    graph.insert_before(site.logits_consumer, nodes)
    site.logits_consumer.replace_input_with(0, gather_logits.outputs[0])
    site.loss.replace_input_with(1, gather_labels.outputs[0])


def _label_density(model: ir.Model, site: _Site, samples: list[dict[str, np.ndarray]]) -> float | None:
    """Share of labels that are not the ignore index over all samples, or None if it cannot be measured."""
    source = site.labels
    while not source.is_graph_input():
        producer = source.producer()
        if producer is None or producer.op_type not in _SHAPE_ONLY_OPS or producer.inputs[0] is None:
            return None  # labels computed in the graph: the density of the input says nothing reliable
        source = producer.inputs[0]
    arrays = [sample[source.name] for sample in samples if source.name in sample]
    total = sum(a.size for a in arrays)
    if not total:
        return None
    valid = sum(int(np.count_nonzero(a != site.ignore_index)) for a in arrays)
    return valid / total


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def _nm(node: ir.Node, reason: str) -> NonMatch:
    return NonMatch(reason=reason, node=node.name, op_type=node.op_type)
