"""quantize_static: int8 weights and activations in QDQ format, calibrated on the context's samples.

Wraps ``onnxruntime.quantization.quantize_static`` (``QuantFormat.QDQ``): every quantized node's inputs go
through ``QuantizeLinear -> DequantizeLinear`` pairs with scales fixed by calibration, and its weight is
stored as int8 behind a ``DequantizeLinear``::

    x --> QuantizeLinear(s_x, z_x) --> DequantizeLinear --> MatMul --> y
                          W_q (int8) --> DequantizeLinear --^

ORT fuses the pattern into integer kernels (``QLinearMatMul``, ``MatMulIntegerToFloat``, ``QGemm``) at session
level 2; under ``ORT_DISABLE_ALL`` (verification) it runs as fake quantization with the same numerics.
Calibration data are the context's samples (a job's ``samples.npz``, else the verification inputs), at most
``max_calibration_samples`` of them; with no samples the pass refuses. Calibration methods: MinMax, Entropy,
Percentile. Accuracy loop and reports as in ``quantize_dynamic`` (``passes/precision/_quantization.py``).

Bounded memory (ORT #10503: Percentile on BERT took more than 256 GB). What ORT does:
its calibrator adds every tensor to calibrate as a graph output of an augmented model, runs the reader to
exhaustion keeping *every* output of *every* sample in a Python list, and only then reduces them (MinMax:
``ReduceMin``/``ReduceMax`` outputs, small; Entropy/Percentile: the full activations, then histograms). So
peak memory is samples x all activations. What this pass limits:

* ``calibration_chunk`` samples at a time: ORT's ``CalibStridedMinMax`` stride makes ``quantize_static``
  call ``collect_data`` once per chunk, and both calibrators reduce and clear after each call (MinMax merges
  ranges, the histogram calibrators merge histograms), so peak memory is ``chunk x activations``, whatever
  the sample count. ``CalibMaxIntermediateOutputs`` is NOT used: in ORT 1.32 ``MinMaxCalibrater.collect_data``
  clears the collected outputs when that count is reached without reducing them first, so those samples are
  silently dropped from the ranges (and with a count equal to the chunk, calibration fails "No data is
  collected").
* ``max_calibration_samples`` caps the samples used; the reader hands ORT the context's arrays without copies.
* Models whose weights exceed ~1.5 GB are written, calibrated (``augmented_model``) and quantized with
  external data (``use_external_data_format``).
* The calibrated ranges are cached in a file (``calibration_cache_path``): each trial of the exclusion loop
  re-quantizes from the cache instead of calibrating again.

Defaults: S8 activations x S8 weights (ORT's defaults and its documented first choice for QDQ on x86-64:
MLAS shifts s8 activations to u8 for the VNNI u8s8 kernels), per-tensor weights, op types MatMul/Gemm/Conv
(QDQ around LayerNorm, Add or Softmax costs conversions and gains nothing on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
import onnx_ir as ir
from pydantic import Field

from passes._infra import NonMatch, Pass, PassContext, PassResult
from passes.precision import _quantization as q
from passes.precision._accuracy import round_sig

StaticOpType = Literal["MatMul", "Gemm", "Conv", "ConvTranspose", "Gather", "Add", "Mul", "LayerNormalization"]
_WEIGHTED = {"MatMul", "Gemm", "Conv", "ConvTranspose"}


class QuantizeStaticOptions(q.QuantizationOptions):
    calibrate_method: Literal["MinMax", "Entropy", "Percentile"] = Field(
        "MinMax",
        description="How activation ranges are chosen from the samples: MinMax (observed range), Entropy "
        "(KL-divergence-optimal clip), Percentile (clip at `percentile` of |x|).",
    )
    percentile: float = Field(99.999, gt=50, le=100, description="Percentile of |x| kept by Percentile calibration.")
    op_types: list[StaticOpType] = Field(
        default_factory=lambda: ["MatMul", "Gemm", "Conv"],
        min_length=1,
        description="Op types to quantize (QDQ around their inputs).",
    )
    activation_type: Literal["QInt8", "QUInt8"] = Field(
        "QInt8", description="Activation element type (ORT's default QInt8: S8S8 QDQ, its first choice on x86-64)."
    )
    weight_type: Literal["QInt8", "QUInt8"] = Field("QInt8", description="Weight element type.")
    symmetric_activations: bool = Field(
        False,
        description="Make calibrated activation ranges symmetric around 0 (CalibTensorRangeSymmetric); "
        "Percentile is always symmetric in ORT.",
    )
    calibration_chunk: int = Field(
        4,
        ge=1,
        description="Samples run through the calibrator at a time; peak calibration memory is this many "
        "samples' activations (ORT otherwise keeps all of them).",
    )
    max_calibration_samples: int = Field(64, ge=1, description="Most context samples used for calibration.")


class _Reader:
    """ORT ``CalibrationDataReader`` over the samples, with the ``set_range`` that strided calibration uses."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = feeds
        self.start, self.end = 0, len(feeds)
        self.position = 0

    def __len__(self) -> int:
        return len(self.feeds)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.start, self.end = start_index, min(end_index, len(self.feeds))
        self.position = self.start

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.position >= self.end:
            return None
        self.position += 1
        return self.feeds[self.position - 1]

    def __iter__(self):  # ORT's base class is iterable; keep the same protocol
        while (item := self.get_next()) is not None:
            yield item


class QuantizeStatic(Pass[QuantizeStaticOptions]):
    name = "quantize_static"
    summary = "int8 QDQ quantization calibrated on the samples (MinMax/Entropy/Percentile), accuracy-checked."
    exact = False
    in_place = False

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        options = q.with_job_tolerance(self.options, ctx.tolerance)
        unknown = q.unknown_node_names(model, options.nodes_to_exclude)
        if unknown:
            return q.refused(model, unknown)
        inputs = [v.name for v in model.graph.inputs if v.name not in model.graph.initializers]
        feeds = [{n: s[n] for n in inputs} for s in ctx.samples if all(n in s for n in inputs)]
        feeds = feeds[: options.max_calibration_samples]
        if not feeds:
            reason = (
                "no calibration samples: static quantization needs representative inputs (give samples.npz with "
                f"every input: {', '.join(inputs)}); quantize_dynamic needs none"
            )
            return q.refused(model, [NonMatch(reason)])
        excluded = set(options.nodes_to_exclude)
        candidates = [
            n.name
            for n in model.graph
            if n.op_type in options.op_types and n.domain in ("", "ai.onnx") and n.name and n.name not in excluded
        ]
        # ORT stacks a chunk's outputs with np.asarray: a chunk must hold samples of one shape. Sort by shape
        # and take the largest chunk size that divides the count (ORT requires that) into same-shape chunks.
        feeds.sort(key=_shape_key)
        stride = max(
            d
            for d in range(1, min(options.calibration_chunk, len(feeds)) + 1)
            if len(feeds) % d == 0
            and all(len({_shape_key(f) for f in feeds[i : i + d]}) == 1 for i in range(0, len(feeds), d))
        )
        notes: dict[str, Any] = {
            "format": "QDQ",
            "calibrate_method": options.calibrate_method,
            "calibration_samples": len(feeds),
            "calibration_chunk": stride,
            "activation_type": options.activation_type,
            "weight_type": options.weight_type,
            "per_channel": options.per_channel,
            "reduce_range": options.reduce_range,
            "op_types": list(options.op_types),
            "candidates": len(candidates),
        }
        if not candidates:
            notes["decision"] = "skipped: nothing to quantize"
            reason = f"no node of op types {', '.join(options.op_types)} to quantize"
            return PassResult(q.unchanged(model), False, {"nodes_quantized": 0}, [NonMatch(reason)], notes)
        cache: dict[str, Path] = {}

        def quantize(src: Path, dst: Path, exclude: list[str], large: bool) -> None:
            from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

            cache_path = cache.setdefault("path", dst.parent / "calibration.json")
            extra: dict[str, Any] = {
                "CalibStridedMinMax": stride,
                "CalibTensorRangeSymmetric": options.symmetric_activations,
            }
            if options.calibrate_method == "Percentile":
                extra["CalibPercentile"] = options.percentile
                extra.pop("CalibTensorRangeSymmetric")  # ORT's percentile calibrator is symmetric already
            quantize_static(
                src,
                dst,
                _Reader(feeds),
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=list(options.op_types),
                per_channel=options.per_channel,
                reduce_range=options.reduce_range,
                activation_type=QuantType[options.activation_type],
                weight_type=QuantType[options.weight_type],
                nodes_to_exclude=exclude,
                use_external_data_format=large,
                calibrate_method=CalibrationMethod[options.calibrate_method],
                extra_options=extra,
                calibration_cache_path=cache_path,
            )
            if "ranges" not in notes:
                notes["ranges"] = _ranges_summary(cache_path)

        out = q.drive(
            model,
            ctx.samples,
            options,
            candidates=candidates,
            quantize=quantize,
            quantized_nodes=qdq_nodes,
            notes=notes,
        )
        if out.model is None:
            return PassResult(q.unchanged(model), False, out.counts, out.non_matches, out.notes)
        return PassResult(out.model, True, out.counts, out.non_matches, out.notes)


def _shape_key(feed: dict[str, np.ndarray]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(sorted((k, tuple(v.shape)) for k, v in feed.items()))


def qdq_nodes(original: onnx.ModelProto, quantized: onnx.ModelProto, candidates: Sequence[str]) -> list[str]:
    """Candidates that read at least one input through a DequantizeLinear in the QDQ model."""
    producers = {out: n for n in quantized.graph.node for out in n.output}
    wanted = set(candidates)
    done = []
    for node in quantized.graph.node:
        if node.name in wanted and any(
            (p := producers.get(v)) is not None and p.op_type == "DequantizeLinear" for v in node.input
        ):
            done.append(node.name)
    return done


def _ranges_summary(cache_path: Path) -> dict[str, Any]:
    """How many tensors were calibrated and the widest ranges (outliers are what int8 loses)."""
    from onnxruntime.quantization.calibrate import load_tensors_data

    try:
        data = load_tensors_data(cache_path).data
    except Exception as exc:  # the cache format is ORT's; a change there must not fail the pass
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    spans = []
    for name, td in data.items():
        try:
            lo, hi = float(np.min(td.range_value[0])), float(np.max(td.range_value[1]))
        except Exception:
            continue
        spans.append((hi - lo, name, lo, hi))
    spans.sort(reverse=True)
    widths = np.array([s[0] for s in spans]) if spans else np.zeros(1)
    return {
        "tensors": len(spans),
        "median_width": round_sig(float(np.median(widths))),
        "widest": [{"tensor": n, "min": round_sig(lo), "max": round_sig(hi)} for _, n, lo, hi in spans[:5]],
    }
