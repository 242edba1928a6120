"""Static validation of an uploaded model before any onnx/ORT native parser sees it (security.md T1-T10).

``validate_model_dir(model_path, job_dir, limits)`` runs in the sandboxed child (workers/child.py) before
``run_pipeline``. It never calls the ONNX C++ checker, shape inference or ONNX Runtime, and it never reads
tensor bytes: it

1. opens ``model.onnx`` with ``O_NOFOLLOW`` and requires a regular file with one link, at most
   ``limits.max_proto_bytes`` (``MODEL_PROTO_TOO_LARGE``, T6);
2. sniffs the ORT flatbuffer format (bytes 4..8 ``ORTM``) and refuses it (``INVALID_MODEL_FORMAT``, T10);
3. parses the ``ModelProto`` with the protobuf runtime alone (``ParseFromString``); a message nested deeper
   than the protobuf parser allows is diagnosed by an iterative wire-format scan (``GRAPH_TOO_DEEP``), any
   other parse failure is ``INVALID_MODEL``;
4. walks every graph ITERATIVELY (main graph, node attributes ``g``/``graphs`` at any depth, training
   graphs, model-local functions and their default attributes) and every ``TensorProto`` in it
   (initializers, sparse initializers' values and indices, attributes ``t``/``tensors``/``sparse_tensor``/
   ``sparse_tensors``):

   * external data only in the main graph's initializers (``EXTERNAL_DATA_LOCATION_INVALID``, T3);
   * only the keys location/offset/length/checksum, each once; ``location`` matches ``SAFE_LOCATION``, is
     no reserved output name and resolves, after ``realpath``, to a file directly beside the model inside
     ``job_dir`` (``EXTERNAL_DATA_PATH_INVALID``, T1); the file is opened with ``O_NOFOLLOW`` and must be a
     regular file with ``st_nlink == 1`` (T2);
   * ``offset``/``length`` are plain decimal integers, ``length == prod(dims) * itemsize`` with checked
     int64 arithmetic and ``offset + length <= st_size`` (``EXTERNAL_DATA_RANGE_INVALID``, T4);
   * inline tensors: dims non-negative, their product fits int64, ``raw_data`` has exactly the declared
     size (``TENSOR_INVALID``);
   * the declared size of every tensor (sparse ones counted dense, as ORT densifies sparse initializers)
     is summed against ``limits.max_tensor_bytes`` (``MODEL_TOO_LARGE``, T7);
   * ``ConstantOfShape``/``Expand``/``Tile`` fed a constant shape whose output alone exceeds that quota
     (``RESOURCE_LIMIT_EXCEEDED``, T7; shapes computed at run time are left to the child's memory limit);
   * op domains: ``""``, ``ai.onnx``, ``ai.onnx.ml``, ``com.microsoft`` minus ``PyOp`` and ``EPContext``,
     or a call of a function the model defines (``UNSUPPORTED_OP_DOMAIN``, T9);
   * subgraph nesting at most ``limits.max_depth`` (``GRAPH_TOO_DEEP``), at most ``limits.max_nodes``
     nodes in all (``GRAPH_TOO_LARGE``), and no cycle among model-local function calls
     (``FUNCTION_CYCLE``, T6).

Every error is an ``InvalidModelError`` (or ``TooLargeError``) with a stable code and a message naming the
offending tensor, node or location (names truncated and ``repr``-quoted: never file contents).
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from core.errors import InvalidModelError, TooLargeError

SAFE_LOCATION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
EXTERNAL_KEYS = frozenset({"location", "offset", "length", "checksum"})
# Not ai.onnx.contrib / com.microsoft.extensions (onnxruntime-extensions): only the prepost pass may create
# nodes there, in an artifact the service built; an upload that uses them is refused here (T9), so no session
# ever registers that library for an upload's sake (workers/verify.py needs_extensions).
ALLOWED_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft"})
DENIED_OPS = frozenset({("com.microsoft", "PyOp"), ("com.microsoft", "EPContext")})
# Names the pipeline writes into the output directory; an external-data file must not collide with them.
RESERVED_NAMES = frozenset({"report.json", "report.html", "result.json", "error.json", "progress.json", "job.json"})
ORT_FORMAT_MAGIC = b"ORTM"
INT64_MAX = (1 << 63) - 1
_DECIMAL = re.compile(r"^[0-9]{1,19}$")

# TensorProto.DataType -> bits per element (STRING and UNDEFINED have none).
_BITS = {
    1: 32, 2: 8, 3: 8, 4: 16, 5: 16, 6: 32, 7: 64, 9: 8, 10: 16, 11: 64, 12: 32, 13: 64, 14: 64, 15: 128,
    16: 16, 17: 8, 18: 8, 19: 8, 20: 8, 21: 4, 22: 4, 23: 4, 24: 8, 25: 2, 26: 2, 27: 6, 28: 6,
}  # fmt: skip
_STRING = 8
_INLINE_FIELDS = ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL


@dataclasses.dataclass(frozen=True)
class ValidationLimits:
    max_proto_bytes: int = 1_900_000_000  # below protobuf's 2 GiB message limit
    max_depth: int = 16  # subgraph nesting below the main graph (ORT itself stops at 32)
    max_nodes: int = 5_000_000
    # Declared tensor bytes in all (external + inline; sparse counted dense). Default: the upload cap
    # (api.max_upload_bytes): a real model cannot declare more weights than it uploaded.
    max_tensor_bytes: int = 4 << 30
    # The wire-format depth scan run after a parse failure stops after this many fields.
    max_scan_fields: int = 2_000_000


@dataclasses.dataclass
class ValidationReport:
    nodes: int = 0
    graphs: int = 0
    max_depth: int = 0
    functions: int = 0
    tensors: int = 0
    external_tensors: int = 0
    external_files: list[str] = dataclasses.field(default_factory=list)
    declared_tensor_bytes: int = 0
    domains: list[str] = dataclasses.field(default_factory=list)


def _s(value: str | bytes) -> str:
    """A proto2 string field as text: upb hands back ``bytes`` when the field is not valid UTF-8."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _q(name: str | bytes, size: int = 100) -> str:
    name = _s(name)
    return repr(name[:size] + ("..." if len(name) > size else ""))


def _err(code: str, message: str) -> InvalidModelError:
    return InvalidModelError(message, code=code)


# ------------------------------------------------------------------------------------------- file access


def _open_regular(path: Path, what: str) -> os.stat_result:
    """Open ``path`` with O_NOFOLLOW and fstat it: it must be a regular file with exactly one link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise _err("EXTERNAL_DATA_PATH_INVALID", f"{what} cannot be opened as a plain file ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _err("EXTERNAL_DATA_PATH_INVALID", f"{what} is not a regular file")
    if st.st_nlink != 1:
        raise _err("EXTERNAL_DATA_PATH_INVALID", f"{what} has {st.st_nlink} hard links; exactly one is allowed")
    return st


def _read_model(model_path: Path, limits: ValidationLimits) -> bytes:
    try:
        fd = os.open(model_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _err("INVALID_MODEL", f"the model file cannot be opened as a plain file ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise _err("INVALID_MODEL", "the model file is not a regular file with a single link")
        if st.st_size > limits.max_proto_bytes:
            raise TooLargeError(
                f"model.onnx is {st.st_size} bytes; the limit is {limits.max_proto_bytes} "
                "(put the weights in external data files)",
                code="MODEL_PROTO_TOO_LARGE",
            )
        head = f.read(8)
        if len(head) == 8 and head[4:8] == ORT_FORMAT_MAGIC:
            raise _err("INVALID_MODEL_FORMAT", "this is an ONNX Runtime (.ort) flatbuffer model; upload ONNX protobuf")
        # Read in pieces sized by the file, not by the limit: BufferedReader.read(n) allocates n bytes up front,
        # 1.9 GB of address space that a worker under an RLIMIT_AS cap does not have.
        pieces, remaining = [head], limits.max_proto_bytes + 1 - len(head)
        while remaining > 0:
            piece = f.read(min(remaining, max(st.st_size, 1 << 20)))
            if not piece:
                break
            pieces.append(piece)
            remaining -= len(piece)
        data = b"".join(pieces)
    if len(data) > limits.max_proto_bytes:  # the file grew after fstat
        raise TooLargeError(f"model.onnx exceeds {limits.max_proto_bytes} bytes", code="MODEL_PROTO_TOO_LARGE")
    return data


# ------------------------------------------------------------------------------------- protobuf parsing


def _wire_depth(data: bytes, descriptor: Any, limit: int, max_fields: int) -> int:
    """Deepest message nesting of ``data`` (a serialized ``descriptor`` message), found iteratively from
    the wire format; stops early beyond ``limit``. -1 when the bytes are not well-formed or the scan budget
    runs out (then the depth is unknown)."""
    message_type = 11  # FieldDescriptor.TYPE_MESSAGE
    stack: list[tuple[int, int, Any, int]] = [(0, len(data), descriptor, 1)]  # (pos, end, descriptor, depth)
    deepest, fields = 1, 0

    def varint(pos: int, end: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            if pos >= end or shift > 63:
                raise ValueError
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, pos
            shift += 7

    try:
        while stack:
            pos, end, desc, depth = stack.pop()
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            while pos < end:
                fields += 1
                if fields > max_fields:
                    return -1
                key, pos = varint(pos, end)
                number, wire = key >> 3, key & 7
                if wire == 0:
                    _, pos = varint(pos, end)
                elif wire == 1:
                    pos += 8
                elif wire == 5:
                    pos += 4
                elif wire == 2:
                    size, pos = varint(pos, end)
                    if pos + size > end:
                        return -1
                    field = desc.fields_by_number.get(number)
                    if field is not None and field.type == message_type:
                        stack.append((pos + size, end, desc, depth))  # resume the parent after the child
                        stack.append((pos, pos + size, field.message_type, depth + 1))
                        break
                    pos += size
                else:
                    return -1
    except (ValueError, IndexError):
        return -1
    return deepest


def _parse(data: bytes, limits: ValidationLimits) -> Any:
    from google.protobuf.message import DecodeError
    from onnx import ModelProto  # the generated protobuf class; nothing of the onnx C++ library runs here

    proto = ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        # A graph at nesting level k sits at message depth 2 + 3k (Model > Graph > Node > Attribute > Graph).
        allowed = 2 + 3 * limits.max_depth + 3
        depth = _wire_depth(data, ModelProto.DESCRIPTOR, allowed, limits.max_scan_fields)
        if depth > allowed:
            raise _err(
                "GRAPH_TOO_DEEP",
                f"the model nests messages more than {allowed} levels deep "
                f"(subgraphs are limited to {limits.max_depth} levels)",
            ) from None
        raise _err("INVALID_MODEL", f"the model is not a valid ONNX protobuf ({type(exc).__name__})") from None
    return proto


# ---------------------------------------------------------------------------------------------- tensors


def _checked_elements(dims: Iterable[int], what: str, code: str) -> int:
    count = 1
    for dim in dims:
        if dim < 0:
            raise _err(code, f"{what} has a negative dimension {dim}")
        count *= dim
        if count > INT64_MAX:
            raise _err(code, f"{what} has a dimension product that overflows int64")
    return count


def _byte_size(elements: int, data_type: int, what: str, code: str) -> int:
    bits = _BITS.get(data_type)
    if bits is None:
        raise _err(code, f"{what} has data type {data_type}, which has no fixed size")
    size = (elements * bits + 7) // 8
    if size > INT64_MAX:
        raise _err(code, f"{what} declares a byte size that overflows int64")
    return size


_SHAPE_OPS = frozenset({"ConstantOfShape", "Expand", "Tile"})
_INT64 = 7


def _small_int64(tensor: Any, limit: int = 64) -> list[int] | None:
    """The values of a small inline int64 tensor, else None (external or large tensors are not read)."""
    if tensor is None or tensor.data_type != _INT64 or tensor.data_location == _EXTERNAL:
        return None
    if tensor.raw_data:
        if len(tensor.raw_data) > 8 * limit or len(tensor.raw_data) % 8:
            return None
        return list(struct.unpack(f"<{len(tensor.raw_data) // 8}q", tensor.raw_data))
    if len(tensor.int64_data) > limit:
        return None
    return list(tensor.int64_data)


@dataclasses.dataclass
class _Root:
    graph: Any  # a GraphProto, or a FunctionProto (nodes only)
    depth: int
    where: str
    external_ok: bool  # only the main graph's initializers may use external data
    owner: tuple[str, str, str] | None  # the model function this graph belongs to


@dataclasses.dataclass
class _Tensor:
    proto: Any
    where: str  # "initializer 'W'", "attribute 'value' of node 'c1' (Constant)", ...
    external_ok: bool


class _Walker:
    def __init__(self, model_path: Path, job_dir: Path, limits: ValidationLimits) -> None:
        self.model_dir = model_path.parent
        self.model_name = model_path.name
        self.real_model_dir = Path(os.path.realpath(self.model_dir))
        self.real_job_dir = Path(os.path.realpath(job_dir))
        self.limits = limits
        self.report = ValidationReport()
        self.files: dict[str, int] = {}  # location -> st_size
        self.domains: set[str] = set()
        self.functions: dict[tuple[str, str, str], Any] = {}
        self.calls: dict[tuple[str, str, str], set[tuple[str, str, str]]] = {}

    # --- tensors

    def tensor(self, t: _Tensor) -> None:
        proto, where = t.proto, t.where
        self.report.tensors += 1
        external = proto.data_location == _EXTERNAL or len(proto.external_data) > 0
        if external:
            if not t.external_ok:
                raise _err(
                    "EXTERNAL_DATA_LOCATION_INVALID",
                    f"{where} uses external data; only the main graph's initializers may",
                )
            declared = self.external(proto, where)
        elif proto.data_type == _STRING:
            declared = sum(len(s) for s in proto.string_data)
        else:
            elements = _checked_elements(proto.dims, where, "TENSOR_INVALID")
            if proto.data_type == 0:
                raise _err("TENSOR_INVALID", f"{where} has no data type")
            declared = _byte_size(elements, proto.data_type, where, "TENSOR_INVALID")
            if proto.raw_data and len(proto.raw_data) != declared:
                raise _err(
                    "TENSOR_INVALID",
                    f"{where} holds {len(proto.raw_data)} bytes of raw_data but its shape and type need {declared}",
                )
        self.count_bytes(declared, where)

    def count_bytes(self, declared: int, where: str) -> None:
        self.report.declared_tensor_bytes += declared
        if self.report.declared_tensor_bytes > self.limits.max_tensor_bytes:
            raise TooLargeError(
                f"the model declares more than {self.limits.max_tensor_bytes} bytes of tensors (reached at {where})",
                code="MODEL_TOO_LARGE",
            )

    def external(self, tensor: Any, where: str) -> int:
        rng = "EXTERNAL_DATA_RANGE_INVALID"
        if tensor.data_location != _EXTERNAL:
            raise _err(rng, f"{where} has external_data entries but is not marked EXTERNAL")
        if any(len(getattr(tensor, f)) for f in _INLINE_FIELDS):
            raise _err(rng, f"{where} is EXTERNAL but also holds inline data")
        entries: dict[str, str] = {}
        for entry in tensor.external_data:
            key = _s(entry.key)
            if key not in EXTERNAL_KEYS:
                raise _err(rng, f"{where} has an external_data key {_q(key, 40)}; allowed: {sorted(EXTERNAL_KEYS)}")
            if key in entries:
                raise _err(rng, f"{where} gives external_data key {key!r} twice")
            entries[key] = _s(entry.value)
        location = entries.get("location")
        if location is None:
            raise _err("EXTERNAL_DATA_PATH_INVALID", f"{where} has external data without a location")
        size = self.file_size(location, where)
        offset = self._decimal(entries.get("offset", "0"), "offset", where)
        elements = _checked_elements(tensor.dims, where, rng)
        expected = _byte_size(elements, tensor.data_type, where, rng)
        length = self._decimal(entries["length"], "length", where) if "length" in entries else size - offset
        if length != expected:
            raise _err(rng, f"{where} declares length {length}, but its shape and type need {expected} bytes")
        if offset > size or length > size - offset:
            raise _err(
                rng,
                f"{where} reads bytes {offset}..{offset + length} of {_q(location)}, which holds {size} bytes",
            )
        self.report.external_tensors += 1
        if location not in self.report.external_files:
            self.report.external_files.append(location)
        return expected

    @staticmethod
    def _decimal(value: str, key: str, where: str) -> int:
        if not _DECIMAL.fullmatch(value) or int(value) > INT64_MAX:
            raise _err(
                "EXTERNAL_DATA_RANGE_INVALID", f"{where} has external_data {key} {_q(value, 40)}; need 0..2^63-1"
            )
        return int(value)

    def file_size(self, location: str, where: str) -> int:
        if location in self.files:
            return self.files[location]
        bad = "EXTERNAL_DATA_PATH_INVALID"
        if not SAFE_LOCATION.fullmatch(location):
            raise _err(
                bad,
                f"{where} has external data location {_q(location)}; a location is a plain file name "
                "(letters, digits, '.', '_', '-'; no folders, no leading dot)",
            )
        if location == self.model_name or location in RESERVED_NAMES:
            raise _err(bad, f"{where} has external data location {_q(location)}, a name the server uses itself")
        candidate = self.model_dir / location
        real = Path(os.path.realpath(candidate))
        if real.parent != self.real_model_dir or not real.is_relative_to(self.real_job_dir):
            raise _err(bad, f"{where}: external data location {_q(location)} resolves outside the job directory")
        st = _open_regular(candidate, f"external data file {_q(location)} of {where}")
        self.files[location] = st.st_size
        return st.st_size

    # --- graphs and nodes

    def graphs(self, roots: list[_Root]) -> Iterator[_Root]:
        """Every graph under ``roots`` with its nesting depth, iteratively (an explicit stack), depth-first."""
        stack = list(reversed(roots))
        while stack:
            root = stack.pop()
            if root.depth > self.limits.max_depth:
                raise _err(
                    "GRAPH_TOO_DEEP",
                    f"{root.where} is nested {root.depth} levels deep; the limit is {self.limits.max_depth}",
                )
            yield root
            for node in root.graph.node:
                for sub, label in self.subgraphs(node):
                    stack.append(_Root(sub, root.depth + 1, label, False, root.owner))

    @staticmethod
    def subgraphs(node: Any) -> Iterator[tuple[Any, str]]:
        for attr in node.attribute:
            if attr.HasField("g"):
                yield attr.g, f"subgraph {_q(attr.name, 40)} of node {_q(node.name)} ({node.op_type})"
            for i, g in enumerate(attr.graphs):
                yield g, f"subgraph {_q(attr.name, 40)}[{i}] of node {_q(node.name)} ({node.op_type})"

    def node(self, node: Any, owner: tuple[str, str, str] | None, where: str) -> None:
        self.report.nodes += 1
        if self.report.nodes > self.limits.max_nodes:
            raise TooLargeError(f"the model has more than {self.limits.max_nodes} nodes", code="GRAPH_TOO_LARGE")
        label = f"node {_q(node.name)} ({_q(node.op_type, 60)}, domain {_q(node.domain, 60)}) in the {where}"
        domain = _s(node.domain)
        key = (domain, _s(node.op_type), _s(node.overload))
        if key in self.functions:
            if owner is not None:
                self.calls.setdefault(owner, set()).add(key)
        elif domain not in ALLOWED_DOMAINS:
            raise _err("UNSUPPORTED_OP_DOMAIN", f"{label} uses a domain that is not allowed and no model function")
        elif key[:2] in DENIED_OPS:
            raise _err("UNSUPPORTED_OP_DOMAIN", f"{label} is an operator this service never runs")
        self.domains.add(domain)
        self.attributes(node.attribute, label)

    def attributes(self, attrs: Iterable[Any], label: str) -> None:
        for attr in attrs:
            where = f"attribute {_q(attr.name, 40)} of {label}"
            if attr.HasField("t"):
                self.tensor(_Tensor(attr.t, where, False))
            for i, t in enumerate(attr.tensors):
                self.tensor(_Tensor(t, f"{where}[{i}]", False))
            if attr.HasField("sparse_tensor"):
                self.sparse(attr.sparse_tensor, where)
            for i, s in enumerate(attr.sparse_tensors):
                self.sparse(s, f"{where}[{i}]")

    def sparse(self, sparse: Any, where: str) -> None:
        for part in ("values", "indices"):
            self.tensor(_Tensor(getattr(sparse, part), f"{part} of sparse tensor {where}", False))
        elements = _checked_elements(sparse.dims, f"sparse tensor {where}", "TENSOR_INVALID")
        bits = _BITS.get(sparse.values.data_type, 64)
        self.count_bytes((elements * bits + 7) // 8, f"sparse tensor {where} (dense size)")

    def graph(self, root: _Root) -> None:
        self.report.graphs += 1
        self.report.max_depth = max(self.report.max_depth, root.depth)
        for init in getattr(root.graph, "initializer", ()):  # a FunctionProto has none
            self.tensor(_Tensor(init, f"initializer {_q(init.name)} of the {root.where}", root.external_ok))
        for sparse in getattr(root.graph, "sparse_initializer", ()):
            self.sparse(sparse, f"sparse initializer {_q(sparse.values.name)} of the {root.where}")
        for node in root.graph.node:
            self.node(node, root.owner, root.where)
        self.shape_bombs(root)

    def shape_bombs(self, root: _Root) -> None:
        """T7: ConstantOfShape/Expand/Tile whose shape (or repeats) is a constant of this graph declaring an
        output above the tensor quota: what constant folding or the first run would try to allocate."""
        constants: dict[str, Any] = {_s(t.name): t for t in getattr(root.graph, "initializer", ())}
        for node in root.graph.node:
            if _s(node.op_type) == "Constant" and len(node.output) == 1:
                for attr in node.attribute:
                    if _s(attr.name) == "value" and attr.HasField("t"):
                        constants[_s(node.output[0])] = attr.t
        for node in root.graph.node:
            op = _s(node.op_type)
            if _s(node.domain) not in {"", "ai.onnx"} or op not in _SHAPE_OPS:
                continue
            index = 0 if op == "ConstantOfShape" else 1
            if len(node.input) <= index or (shape := _small_int64(constants.get(_s(node.input[index])))) is None:
                continue
            if any(d < 0 for d in shape):
                continue  # an invalid shape fails in the runtime, without allocating
            elements = 1
            for d in shape:
                elements = min(elements * d, INT64_MAX)
            itemsize = 4 if op == "ConstantOfShape" else 1  # ConstantOfShape defaults to float; else a floor
            for attr in node.attribute:
                if op == "ConstantOfShape" and _s(attr.name) == "value" and attr.HasField("t"):
                    itemsize = max(1, _BITS.get(attr.t.data_type, 8) // 8)
            if elements * itemsize > self.limits.max_tensor_bytes:
                raise TooLargeError(
                    f"node {_q(node.name)} ({op}) in the {root.where} would produce {elements} elements "
                    f"(at least {elements * itemsize} bytes); the limit is {self.limits.max_tensor_bytes}",
                    code="RESOURCE_LIMIT_EXCEEDED",
                )

    def run(self, model: Any) -> ValidationReport:
        for function in model.functions:
            key = (_s(function.domain), _s(function.name), _s(function.overload))
            if key in self.functions:
                raise _err("INVALID_MODEL", f"function {_q(function.domain)}::{_q(function.name)} is defined twice")
            self.functions[key] = function
        self.report.functions = len(self.functions)
        roots = [_Root(model.graph, 0, "main graph", True, None)]
        for info in model.training_info:
            for name in ("initialization", "algorithm"):
                if info.HasField(name):
                    roots.append(_Root(getattr(info, name), 1, f"training {name} graph", False, None))
        for key, function in self.functions.items():
            label = f"function {_q(key[0])}::{_q(key[1])}"
            roots.append(_Root(function, 0, label, False, key))
            holder = _AttrHolder(function.attribute_proto, label)
            roots.extend(_Root(sub, 1, where, False, key) for sub, where in self.subgraphs(holder))
        for root in self.graphs(roots):
            self.graph(root)
        for key, function in self.functions.items():
            self.attributes(function.attribute_proto, f"function {_q(key[0])}::{_q(key[1])}")
        self.cycles()
        self.report.domains = sorted(self.domains)
        return self.report

    def cycles(self) -> None:
        """Iterative DFS over the function call graph (white/grey/black)."""
        state: dict[tuple[str, str, str], int] = {}
        for start in self.functions:
            if state.get(start):
                continue
            stack = [(start, iter(sorted(self.calls.get(start, ()))))]
            state[start] = 1
            while stack:
                current, children = stack[-1]
                child = next(children, None)
                if child is None:
                    state[current] = 2
                    stack.pop()
                elif state.get(child) == 1:
                    path = [k for k, _ in stack]
                    cycle = [*path[path.index(child) :], child]
                    names = " -> ".join(f"{d}::{n}" if d else n for d, n, _ in cycle)
                    raise _err("FUNCTION_CYCLE", f"model functions call each other in a cycle: {names}"[:500])
                elif not state.get(child):
                    state[child] = 1
                    stack.append((child, iter(sorted(self.calls.get(child, ())))))


class _AttrHolder:
    """Adapter: a function's default attributes presented as a node, to find the subgraphs in them."""

    def __init__(self, attrs: Any, label: str) -> None:
        self.attribute = attrs
        self.name = label
        self.op_type = "default attribute"


def validate_model_dir(model_path: Path, job_dir: Path, limits: ValidationLimits | None = None) -> ValidationReport:
    """Validate ``model_path`` (and the external-data files beside it) before any native parser sees it.

    ``job_dir`` is the directory every file the model refers to must stay inside (the attempt directory).
    Raises ``InvalidModelError``/``TooLargeError`` with a stable code; returns what it counted.
    """
    limits = limits or ValidationLimits()
    model_path = Path(model_path)
    if not Path(os.path.realpath(model_path.parent)).is_relative_to(os.path.realpath(job_dir)):
        raise _err("EXTERNAL_DATA_PATH_INVALID", "the model is not inside the job directory")
    data = _read_model(model_path, limits)
    model = _parse(data, limits)
    del data
    return _Walker(model_path, job_dir, limits).run(model)
