"""The measured half of ``fuse_gqa``: run-time shapes of each matched layer, and what its mask computes.

Shapes: one ORT run of the model (graph optimizations off) at a small prompt after a small cache, with each
site's q, k, v and output added as graph outputs, gives heads, kv heads and head size without trusting
declared shapes (TorchScript leaves the heads dims symbolic).

Mask: GroupQueryAttention takes no mask; it is causal, optionally windowed (``local_window_size``), and reads
the valid length of each row from ``seqlens_k``. So the additive mask a layer adds to its scores is run on
its own (the subgraph that computes it, nothing else) and must equal, at every probed shape::

    0           where  key j <= query position p  and  p - j < W (a window, when there is one)  and  mask[b, j] = 1
    <= -1e4     elsewhere (exp underflows to 0 in the softmax)

with p = past + i. Probed: prompts after caches of 0, 4 and 6 positions, a row with padding holes, then
decode rows after ever longer caches and long prompts (the window shows once a row reaches past it), up to
``max_length`` positions. A window wider than the longest length probed is not seen: the notes say the
length up to which the mask was proven causal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxruntime as ort

from core.inputs import InputRole, analyze
from core.model_files import PROTOBUF_SAFE_BYTES

MASKED = -1e4
_SMALL = ((2, 5, 0), (2, 1, 6), (1, 3, 4))  # (batch, new tokens, past)


class ProbeError(Exception):
    """The model could not be run to measure what the pass needs; the message says why."""


@dataclasses.dataclass(frozen=True)
class MaskKind:
    window: int | None  # keys a query may see counting itself; None: no window up to ``proven``
    proven: int  # the longest key length at which the mask was checked


def _session(proto: onnx.ModelProto, weights_dir: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # Fatal only: a probe past what the model takes (its position table) is expected to fail, and its error comes
    # back as the exception's text (ProbeError); at the error level ORT printed it to the worker's stderr as well.
    options.log_severity_level = 4
    if weights_dir is not None:
        # A model over the protobuf limit keeps its weights in a file beside the upload: loaded from bytes,
        # ORT resolves their relative locations only against this folder (and refuses paths that escape it).
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", weights_dir)
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


@contextlib.contextmanager
def _weights_apart(model: ir.Model) -> Iterator[tuple[ir.Model, str | None]]:
    """``model`` and the folder of its external weights; a model holding more than protobuf's limit in memory
    (the pipeline loads an upload's weights so) is written out once to a scratch folder and read back lazily,
    so the probes copy and serialize a graph that only refers to its weights."""
    folder = _weights_dir(model)
    in_memory = sum(
        int(v.const_value.nbytes)
        for v in model.graph.initializers.values()
        if v.const_value is not None and not isinstance(v.const_value, ir.ExternalTensor)
    )
    if in_memory < PROTOBUF_SAFE_BYTES:  # the probes' copies and sessions go through one protobuf message
        yield model, folder
        return
    with tempfile.TemporaryDirectory(prefix="fuse_gqa-probe-") as scratch:
        path = Path(scratch) / "probe.onnx"
        ir.save(model, path, external_data="probe.onnx.data", size_threshold_bytes=1024)
        yield ir.load(path), scratch


def _weights_dir(model: ir.Model) -> str | None:
    """The folder of ``model``'s external weights (None when every initializer is in memory)."""
    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            return str(value.const_value.base_dir)
    return None


_FED = frozenset({"attention_mask", "position_ids", "token_ids", "int", "past_key_values"})


class Feeder:
    """Decoder feeds for the roles ``core.inputs`` reads off the graph: ids, an attention mask spanning the
    past and the new tokens, positions after the past, and a cache of ``past`` positions."""

    def __init__(self, model: ir.Model) -> None:
        self.inputs = [v for v in model.graph.inputs if v.name not in model.graph.initializers]
        self.roles: dict[str, InputRole] = analyze(model).roles
        masks = [r.name for r in self.roles.values() if r.role == "attention_mask"]
        self.mask_name = masks[0] if len(masks) == 1 else None
        self.has_past = any(r.role == "past_key_values" for r in self.roles.values())
        self.sequence_inputs = [r.name for r in self.roles.values() if r.role in ("token_ids", "position_ids")]
        self.fixed = self._fixed_dims()

    def _fixed_dims(self) -> dict[str, int]:
        """The call dims the export fixed (no dynamic axis): ``batch``, ``seq`` (new tokens) and ``past``, each
        read by value off the inputs' static dims wherever it shows (ids, positions, mask, cache)."""
        fixed: dict[str, int] = {}
        mask_total = None
        for value in self.inputs:
            role, dims = self.roles[value.name or ""], list(value.shape or ())
            batch_axis, seq_axis = _call_axes(role, dims)
            if len(dims) > batch_axis and isinstance(dims[batch_axis], int) and role.role in _FED:
                fixed["batch"] = dims[batch_axis]
            if role.role in ("token_ids", "position_ids") and len(dims) > seq_axis and isinstance(dims[seq_axis], int):
                fixed["seq"] = dims[seq_axis]
            elif role.role == "attention_mask" and len(dims) > 1 and isinstance(dims[1], int):
                mask_total = dims[1]
            elif role.role == "past_key_values" and (past := _static(dims, role.past_axis)) is not None:
                fixed["past"] = past
        if mask_total is not None and self.has_past and "seq" in fixed and "past" not in fixed:
            fixed["past"] = mask_total - fixed["seq"]
        if mask_total is not None and not self.has_past:
            fixed["seq"] = mask_total
        return fixed

    def fit(self, batch: int, seq: int, past: int) -> tuple[int, int, int]:
        """(batch, seq, past) with each dim the export fixed at its own value: a static graph runs at no other."""
        past = past if self.has_past else 0
        return self.fixed.get("batch", batch), self.fixed.get("seq", seq), self.fixed.get("past", past)

    @property
    def probe_shape(self) -> tuple[int, int, int]:
        """(batch, new tokens, past) at which ``measure_shapes`` runs the model."""
        return self.fit(1, 3, 2)

    def unfeedable(self) -> str | None:
        """Why the probe cannot feed this graph (an input a decoder LLM does not take), checked before any
        run: building a session of a large encoder only to find its token types cost seconds per job."""
        for value in self.inputs:
            role = self.roles[value.name or ""]
            if role.role not in _FED:
                return f"input {value.name!r} has role {role.role}, which a decoder probe cannot feed"
        return None

    def feeds(self, batch: int, seq: int, past: int, mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        past = past if self.has_past else 0
        out = {}
        for value in self.inputs:
            role = self.roles[value.name or ""]
            dtype = np.dtype(value.dtype.numpy()) if value.dtype is not None else np.dtype(np.float32)
            if role.role == "attention_mask":
                array = np.ones((batch, past + seq)) if mask is None else mask
            elif role.role == "position_ids":
                dims = list(value.shape or ())
                sections = (dims[0] if isinstance(dims[0], int) else 3,) if len(dims) == 3 else ()
                array = np.broadcast_to(np.arange(past, past + seq), (*sections, batch, seq))
            elif role.role in ("token_ids", "int"):
                array = rng.integers(0, role.high or 2, size=(batch, seq))
            elif role.role == "past_key_values":
                array = rng.standard_normal(self._cache_shape(value, role, batch, past))
            else:
                raise ProbeError(f"input {value.name!r} has role {role.role}, which a decoder probe cannot feed")
            out[value.name or ""] = np.ascontiguousarray(array).astype(dtype)
        return out

    @staticmethod
    def _cache_shape(value: ir.Value, role: InputRole, batch: int, past: int) -> tuple[int, ...]:
        shape = []
        for axis, dim in enumerate(value.shape or ()):
            if axis == 0:
                shape.append(batch)
            elif axis == role.past_axis:
                shape.append(past)
            elif isinstance(dim, int):
                shape.append(dim)
            else:
                raise ProbeError(f"cache input {value.name!r} has a symbolic dim {dim} on axis {axis}")
        return tuple(shape)


def _call_axes(role: InputRole, dims: list) -> tuple[int, int]:
    """(batch axis, new-token axis) of a decoder input: [B, S, ...], or multimodal rope's positions, one row per
    section first (Qwen2-VL's M-RoPE: ``position_ids [3, B, S]``)."""
    return (1, 2) if role.role == "position_ids" and len(dims) == 3 else (0, 1)


def _static(dims: list, axis: int | None) -> int | None:
    dim = dims[axis] if axis is not None and axis < len(dims) else None
    return dim if isinstance(dim, int) else None


def _with_outputs(model: ir.Model, values: list[ir.Value], prune: bool) -> onnx.ModelProto:
    """A serialized copy of ``model`` whose outputs are ``values`` (plus the originals unless ``prune``), with
    the nodes and inputs the outputs do not need removed when ``prune``."""
    # A clone shares the weights: a serialized copy copied every one of them, then serialized them again, where
    # a pruned mask subgraph needs a few (that copy cost half a second per probe on a 100 MB encoder-decoder).
    copy = model.clone()
    by_name = {v.name: v for n in copy.graph for v in n.outputs}
    chosen = [by_name[v.name] for v in values]
    for value in chosen:
        if value.type is None:
            value.type = ir.TensorType(ir.DataType.FLOAT)
    if prune:
        copy.graph.outputs.clear()
    known = {id(v) for v in copy.graph.outputs}
    copy.graph.outputs.extend(v for v in dict.fromkeys(chosen) if id(v) not in known)
    if prune:
        common_passes.RemoveUnusedNodesPass()(copy)
        used = [v for v in copy.graph.inputs if v.uses() or v.is_graph_output()]
        copy.graph.inputs.clear()
        copy.graph.inputs.extend(used)
    return ir.serde.serialize_model(copy)


def measure_shapes(model: ir.Model, feeder: Feeder, values: list[ir.Value]) -> dict[str, tuple[int, ...]]:
    """Run-time shapes of ``values`` at ``feeder.probe_shape``: 1 sequence of 3 new tokens after a cache of 2,
    or the dims the export fixed."""
    for index, value in enumerate(values):
        if not value.name:
            value.name = f"fuse_gqa/probe_{index}"
    try:
        with _weights_apart(model) as (light, folder):
            session = _session(_with_outputs(light, values, prune=False), folder)
        names = list(dict.fromkeys(v.name for v in values))
        feeds = feeder.feeds(*feeder.probe_shape)
        got = session.run(names, {i.name: feeds[i.name] for i in session.get_inputs()})
    except ProbeError:
        raise
    except Exception as exc:  # the model itself fails at these shapes: nothing to fuse safely
        batch, seq, past = feeder.probe_shape
        raise ProbeError(
            f"the model did not run at batch {batch}, {seq} new tokens after {past}: {str(exc)[:200]}"
        ) from exc
    return {name: tuple(array.shape) for name, array in zip(names, got, strict=True)}


def probe_mask(model: ir.Model, feeder: Feeder, mask: ir.Value, max_length: int) -> MaskKind:
    """What ``mask`` computes: causal with key padding, and its window; ProbeError naming the first probe
    where it is something else."""
    if feeder.mask_name is None:
        raise ProbeError("the graph has no single attention_mask input to derive seqlens_k from")
    with _weights_apart(model) as (light, folder):
        session = _session(_with_outputs(light, [mask], prune=True), folder)
    wanted = [i.name for i in session.get_inputs()]
    # A dim the export fixed is probed at its own value only (duplicates dropped): the graph runs at no other.
    small = dict.fromkeys(feeder.fit(*shape) for shape in _SMALL if feeder.has_past or shape[2] == 0)
    checks = [(b, s, p, _holes(b, p + s)) for b, s, p in small]
    longest = 0
    rows: list[tuple[np.ndarray, np.ndarray, int, int]] = []
    for batch, seq, past, padding in checks:  # a failure here is a finding: the mask is not the pattern
        got = _run(session, wanted, feeder, batch, seq, past, padding)
        rows.append((got, padding, seq, past))
        longest = max(longest, past + seq)
    ladders = [[(1, n, 0) for n in (64, 128, 256, 1024) if n <= max_length]]
    if feeder.has_past:
        ladders.append([(1, 1, n) for n in (64, 256, 1024, 4096, 16384) if n < max_length])
    if feeder.fixed.keys() & {"seq", "past"}:
        ladders = []  # no longer row fits the graph: the mask is proven at the lengths it takes
    for ladder in ladders:
        for batch, seq, past in (feeder.fit(*shape) for shape in ladder):
            try:
                got = _run(session, wanted, feeder, batch, seq, past, None)
            except ProbeError:
                break  # the model itself stops here (a cache truncated to a window, a position table)
            rows.append((got, np.ones((batch, past + seq)), seq, past))
            longest = max(longest, past + seq)
    window = _window(rows)
    for got, padding, seq, past in rows:
        _check(got, padding, seq, past, window)
    return MaskKind(window, longest)


def _holes(batch: int, total: int) -> np.ndarray:
    """All ones in the first row; the others miss key 1 and the last key (padding wherever it lies)."""
    mask = np.ones((batch, total))
    if batch > 1 and total > 2:
        mask[1:, [1, total - 1]] = 0
    return mask


def _run(session, wanted, feeder: Feeder, batch: int, seq: int, past: int, mask) -> np.ndarray:  # noqa: PLR0917
    feeds = feeder.feeds(batch, seq, past, mask)
    try:
        (got,) = session.run(None, {k: feeds[k] for k in wanted})
    except Exception as exc:
        raise ProbeError(f"the mask did not compute at batch {batch}, {seq} new after {past}: {exc}") from exc
    if got.ndim != 4:
        raise ProbeError(f"the mask has rank {got.ndim}, not 4 ([batch, heads, query, key])")
    try:
        return np.broadcast_to(got, (batch, got.shape[1], seq, past + seq))
    except ValueError as exc:
        raise ProbeError(f"the mask {got.shape} is not [batch, 1, {seq}, {past + seq}]") from exc


def _window(rows) -> int | None:
    """The most keys any query may see, where that is less than causal allows; None when never less."""
    clipped = 0
    for got, _padding, seq, past in rows:
        open_ = (got[:1, :1] > MASKED / 2)[0, 0]  # the unpadded first row
        seen = open_.sum(-1)
        causal = past + np.arange(seq) + 1
        if (seen < causal).any():
            clipped = max(clipped, int(seen.max()))
    return clipped or None


def _check(got: np.ndarray, padding: np.ndarray, seq: int, past: int, window: int | None) -> None:
    position = past + np.arange(seq)[:, None]
    key = np.arange(past + seq)[None, :]
    allowed = (key <= position) & ((position - key < window) if window else True)
    allowed = np.broadcast_to(allowed[None, None] & (padding[:, None, None, :] > 0), got.shape)
    open_ = np.abs(got) <= 1e-6
    closed = got <= MASKED
    if not (np.all(open_[allowed]) and np.all(closed[~allowed])):
        where = np.argwhere(~np.where(allowed, open_, closed))[0].tolist()
        kind = "causal" + (f" with a window of {window}" if window else "") + " plus key padding"
        raise ProbeError(
            f"the mask is not {kind} at {seq} new tokens after {past} (first difference at [b, h, i, j] = "
            f"{where}: {got[tuple(where)]:g})"
        )


@functools.cache
def gqa_window_offset() -> int:
    """How many more keys than ``local_window_size`` this ORT's GroupQueryAttention lets a query see (the
    query itself counted or not has changed between releases): measured on a 1-head GQA whose values are
    the key positions, so each output is the mean of the positions a query sees."""
    length, size, width = 10, 8, 3
    ir_inputs = [
        ir.Value(name=n, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, length, size])) for n in "qkv"
    ]
    seqlens = ir.Value(name="seqlens_k", type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([1]))
    total = ir.Value(name="total", type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([]))
    attributes = {"num_heads": 1, "kv_num_heads": 1, "local_window_size": width}
    node = ir.node(
        "GroupQueryAttention",
        [*ir_inputs, None, None, seqlens, total],
        attributes,
        domain="com.microsoft",
        num_outputs=3,
    )
    node.outputs[0].name, node.outputs[0].type = "out", ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([*ir_inputs, seqlens, total], [node.outputs[0]], nodes=[node], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    model.opset_imports["com.microsoft"] = 1
    positions = np.broadcast_to(np.arange(length, dtype=np.float32)[None, :, None], (1, length, size))
    zeros = np.zeros((1, length, size), np.float32)
    feeds = {
        "q": zeros,
        "k": zeros,
        "v": np.ascontiguousarray(positions),
        "seqlens_k": np.array([length - 1], np.int32),
    }
    (out,) = _session(ir.serde.serialize_model(model)).run(None, {**feeds, "total": np.array(length, np.int32)})
    # The last query sees positions last-n+1..last, whose mean is last - (n-1)/2.
    seen = round(2 * (length - 1 - float(out[0, -1, 0])) + 1)
    return seen - width
