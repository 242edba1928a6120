"""Verification: does a candidate model compute what the original computes?

Three parts:

* **Inputs.** ``make_input_sets`` builds the feeds every check and benchmark uses: the user's samples.npz
  (validated against the graph inputs), else ``PipelineSettings.verify_shape_sets`` generated sets.
  Symbolic dims are bound per shape set (batch-like 1, 2, 4, ...; sequence-like 8, 16, 32, ...; the same
  dim name gets the same value in every input), ``JobConfig.shapes`` overrides them, and values follow the
  input's role: token ids within the embedding table, right-padded attention masks (optimum #978 and
  ORT #18945: random masks give false alarms), 0/1 token types, labels with some -100, normal floats.
* **Sessions.** ``make_session`` is the one place ORT sessions are built: options in code only
  (``session.load_model_format=ONNX``), models loaded from their path so external data beside them
  resolves, the target's execution provider or a clear error when it is not installed.
* **Comparison.** ``Verifier`` runs the original once per input set with every ORT graph optimization off
  (so ORT's own fusions cannot hide a bug), then ``check(candidate)`` compares each output: max abs/rel
  error, cosine similarity, ``numpy.isclose`` mismatches, NaN/Inf counts, shape and dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from core.adapters import run_options as run_options_with
from core.config import Tolerance
from core.errors import InvalidInputError, InvalidModelError, UnavailableError
from core.recipe import apply_recipe, sanitize_recipe

_PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}

_BATCH_DIM = re.compile(r"^(n|b|bs|batch.*|.*_batch|batch_size|num_batches)$", re.IGNORECASE)
_SEQ_DIM = re.compile(r"(seq|sequence|len|length|tokens?|time|steps?)", re.IGNORECASE)
_IDS_NAME = re.compile(r"(^|_)ids$|^input_ids", re.IGNORECASE)
_MASK_NAME = re.compile(r"mask", re.IGNORECASE)
_TOKEN_TYPE_NAME = re.compile(r"token_type|segment_ids", re.IGNORECASE)
_POSITION_NAME = re.compile(r"position_ids", re.IGNORECASE)
_LABELS_NAME = re.compile(r"^labels?$|_labels?$", re.IGNORECASE)
IGNORE_INDEX = -100


# --------------------------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """A graph input: name, numpy dtype and dims (int, a symbolic name, or None when unnamed)."""

    name: str
    elem_type: int
    dtype: np.dtype[Any]
    dims: tuple[int | str | None, ...]

    @property
    def rank(self) -> int:
        return len(self.dims)


@dataclasses.dataclass
class InputSet:
    """One set of feeds, named for the report (e.g. ``batch=2,seq=16`` or ``samples``)."""

    name: str
    feeds: dict[str, np.ndarray]

    def shapes(self) -> dict[str, list[int]]:
        return {k: list(v.shape) for k, v in self.feeds.items()}


def graph_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    """The inputs a caller must feed: graph inputs that are not initializers, tensors only."""
    initializers = {init.name for init in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        if not value.type.HasField("tensor_type"):
            raise InvalidModelError(
                f"input {value.name!r} is not a tensor; only tensor inputs are supported",
                code="UNSUPPORTED_INPUT",
            )
        ttype = value.type.tensor_type
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(ttype.elem_type))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidModelError(
                f"input {value.name!r} has an unsupported element type {ttype.elem_type}",
                code="UNSUPPORTED_INPUT",
            ) from exc
        dims: list[int | str | None] = []
        if ttype.HasField("shape"):
            for dim in ttype.shape.dim:
                if dim.HasField("dim_value"):
                    dims.append(int(dim.dim_value))
                elif dim.HasField("dim_param") and dim.dim_param:
                    dims.append(dim.dim_param)
                else:
                    dims.append(None)
        specs.append(InputSpec(value.name, ttype.elem_type, dtype, tuple(dims)))
    return specs


def _dim_role(dim: str | None, axis: int) -> str:
    if dim is None:
        return "batch" if axis == 0 else "seq"
    if _BATCH_DIM.match(dim):
        return "batch"
    if _SEQ_DIM.search(dim):
        return "seq"
    return "batch" if axis == 0 else "seq"


def _role_value(role: str, index: int) -> int:
    # Set 0 is the small common case (batch 1, seq 8); later sets double both.
    return (1 << index) if role == "batch" else 8 << index


def _bind_shapes(
    specs: Sequence[InputSpec], index: int, overrides: Mapping[str, Sequence[int]] | None
) -> dict[str, tuple[int, ...]]:
    """Concrete shapes of every input for shape set ``index``; overrides bind their symbolic dims first."""
    by_name = {s.name: s for s in specs}
    bound: dict[str, int] = {}
    overrides = dict(overrides or {})
    for name, shape in overrides.items():
        spec = by_name.get(name)
        if spec is None:
            raise InvalidInputError(
                f"shapes names {name!r}, which is not a graph input (inputs: {', '.join(by_name)})",
                code="SHAPES_INVALID",
            )
        if spec.dims and len(shape) != spec.rank:
            raise InvalidInputError(
                f"shapes gives {name!r} rank {len(shape)}, the graph expects rank {spec.rank}",
                code="SHAPES_INVALID",
            )
        for axis, (dim, size) in enumerate(zip(spec.dims, shape, strict=False)):
            if size < 0:
                raise InvalidInputError(f"shapes gives {name!r} a negative dim", code="SHAPES_INVALID")
            if isinstance(dim, int) and dim != size:
                raise InvalidInputError(
                    f"shapes gives {name!r} size {size} on axis {axis}, the graph fixes it to {dim}",
                    code="SHAPES_INVALID",
                )
            if isinstance(dim, str):
                bound.setdefault(dim, int(size))
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        if spec.name in overrides:
            shapes[spec.name] = tuple(int(s) for s in overrides[spec.name])
            continue
        shape = []
        for axis, dim in enumerate(spec.dims):
            if isinstance(dim, int):
                shape.append(dim)
            elif isinstance(dim, str):
                shape.append(bound.setdefault(dim, _role_value(_dim_role(dim, axis), index)))
            else:
                shape.append(_role_value(_dim_role(None, axis), index))
        shapes[spec.name] = tuple(shape)
    return shapes


def _constant_arrays(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    consts = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    consts[node.output[0]] = attr.t
    return consts


def index_ranges(model: onnx.ModelProto) -> dict[str, int]:
    """For inputs used (directly or through Cast) as Gather indices into a constant table: the table size.

    That is the vocabulary of an embedding; ids outside it make ORT fail or read garbage.
    """
    consts = _constant_arrays(model)
    aliases: dict[str, str] = {}  # tensor name -> graph input it is a cast of
    inputs = {v.name for v in model.graph.input}
    for name in inputs:
        aliases[name] = name
    ranges: dict[str, int] = {}
    for node in model.graph.node:  # topological order: casts are seen before their users
        if node.op_type in ("Cast", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze") and node.input:
            source = aliases.get(node.input[0])
            if source is not None:
                aliases[node.output[0]] = source
        if node.op_type == "Gather" and len(node.input) >= 2:
            source = aliases.get(node.input[1])
            table = consts.get(node.input[0])
            if source is None or table is None:
                continue
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            dims = list(table.dims)
            if not dims:
                continue
            size = int(dims[axis if axis >= 0 else axis + len(dims)])
            ranges[source] = min(ranges.get(source, size), size)
    return ranges


def _num_classes(model: onnx.ModelProto) -> int:
    """A guess for label ranges: the smallest static last dim > 1 among float outputs, else 10."""
    sizes = []
    for out in model.graph.output:
        ttype = out.type.tensor_type
        if ttype.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE):
            dims = ttype.shape.dim
            if dims and dims[-1].HasField("dim_value") and dims[-1].dim_value > 1:
                sizes.append(int(dims[-1].dim_value))
    return min(sizes) if sizes else 10


def _right_padded_mask(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """1 for valid tokens then 0 for padding, per row; each row has a valid token; row 0 is full."""
    if len(shape) < 1 or 0 in shape:
        return np.ones(shape, dtype=np.int64)
    seq = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    lengths = rng.integers(1, seq + 1, size=rows)
    lengths[0] = seq
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    return mask.reshape(shape)


def _generate(
    spec: InputSpec, shape: tuple[int, ...], rng: np.random.Generator, ranges: Mapping[str, int], classes: int
) -> np.ndarray:
    name, dtype = spec.name, spec.dtype
    if dtype.kind == "b":
        if _MASK_NAME.search(name):
            return _right_padded_mask(shape, rng).astype(bool)
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        if _MASK_NAME.search(name):
            return _right_padded_mask(shape, rng).astype(dtype)
        if _TOKEN_TYPE_NAME.search(name):
            return rng.integers(0, 2, size=shape).astype(dtype)
        if _POSITION_NAME.search(name) and shape:
            return np.broadcast_to(np.arange(shape[-1]), shape).astype(dtype)
        if _LABELS_NAME.search(name) and dtype.kind == "i":
            labels = rng.integers(0, classes, size=shape)
            labels[rng.random(size=shape) < 0.2] = IGNORE_INDEX
            return labels.astype(dtype)
        high = ranges.get(name, 100 if _IDS_NAME.search(name) else 10)
        return rng.integers(0, max(high, 1), size=shape).astype(dtype)
    if dtype.kind == "f":
        if _MASK_NAME.search(name):  # float masks (additive or multiplicative) stay 1/0, right-padded
            return _right_padded_mask(shape, rng).astype(dtype)
        return rng.standard_normal(size=shape).astype(dtype)
    raise InvalidModelError(
        f"input {name!r} has dtype {dtype}, for which no inputs can be generated; upload samples.npz",
        code="UNSUPPORTED_INPUT",
    )


def _set_name(shapes: Mapping[str, tuple[int, ...]]) -> str:
    return "; ".join(f"{k}={'x'.join(str(d) for d in v) or 'scalar'}" for k, v in shapes.items())


def generate_input_sets(
    model: onnx.ModelProto,
    count: int,
    *,
    seed: int = 0,
    shapes: Sequence[Mapping[str, Sequence[int]]] | None = None,
) -> list[InputSet]:
    """``count`` generated input sets (or one per entry of ``shapes`` when given)."""
    specs = graph_inputs(model)
    ranges = index_ranges(model)
    classes = _num_classes(model)
    overrides: list[Mapping[str, Sequence[int]] | None] = list(shapes) if shapes else [None] * count
    sets = []
    for index, override in enumerate(overrides):
        bound = _bind_shapes(specs, index, override)
        rng = np.random.default_rng([seed, index])
        feeds = {s.name: _generate(s, bound[s.name], rng, ranges, classes) for s in specs}
        sets.append(InputSet(_set_name(bound), feeds))
    return sets


def load_samples(path: Path, model: onnx.ModelProto) -> InputSet:
    """The user's samples.npz as one input set, checked against the graph inputs (SAMPLES_INVALID)."""
    specs = {s.name: s for s in graph_inputs(model)}

    def invalid(message: str) -> InvalidInputError:
        return InvalidInputError(f"samples.npz: {message}", code="SAMPLES_INVALID")

    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise invalid(f"not a readable .npz of plain arrays ({type(exc).__name__}: {exc})") from exc
    missing = sorted(set(specs) - set(arrays))
    extra = sorted(set(arrays) - set(specs))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing inputs {missing}")
        if extra:
            parts.append(f"unknown names {extra}")
        raise invalid(f"{'; '.join(parts)} (graph inputs: {sorted(specs)})")
    for name, array in arrays.items():
        spec = specs[name]
        if array.dtype != spec.dtype:
            raise invalid(f"{name!r} has dtype {array.dtype}, the graph expects {spec.dtype}")
        if spec.dims and array.ndim != spec.rank:
            raise invalid(f"{name!r} has rank {array.ndim}, the graph expects {spec.rank}")
        for axis, dim in enumerate(spec.dims):
            if isinstance(dim, int) and array.shape[axis] != dim:
                raise invalid(f"{name!r} has size {array.shape[axis]} on axis {axis}, the graph expects {dim}")
    return InputSet("samples", {name: arrays[name] for name in specs})


RAW_SAMPLE_SETS = 8  # raw samples beyond this many add run time, not coverage
_RAW_IMAGE_KEY = re.compile(r"^image(_[0-9]{1,3})?$")


def load_raw_samples(path: Path, raw_inputs: Mapping[str, str]) -> list[InputSet] | None:
    """samples.npz holding the raw inputs of a pass that replaces the model's inputs (prepost), one input set
    per image or sentence; None when its names are not raw inputs (then it holds the original's tensors).

    ``raw_inputs``: name -> "uint8" (``image``: the bytes of one PNG/JPEG as uint8[n]; more images as
    ``image_1``, ``image_2``, ...) or "string" (``text``: a 1-D array of sentences, each fed as string[1])."""

    def invalid(message: str) -> InvalidInputError:
        return InvalidInputError(f"samples.npz: {message}", code="SAMPLES_INVALID")

    try:
        with np.load(path, allow_pickle=False) as archive:
            names = list(archive.files)
            if "image" in raw_inputs and names and all(_RAW_IMAGE_KEY.fullmatch(n) for n in names):
                sets = []
                for name in sorted(names, key=lambda n: (len(n), n))[:RAW_SAMPLE_SETS]:
                    array = archive[name]
                    if array.dtype != np.uint8 or array.ndim != 1 or not array.size:
                        raise invalid(f"{name!r} must hold the bytes of one encoded image as uint8[n]")
                    sets.append(InputSet(f"raw {name}", {"image": array}))
                return sets
            if "text" in raw_inputs and names == ["text"]:
                array = archive["text"]
                if array.dtype.kind not in "US" or array.ndim > 1 or not array.size:
                    raise invalid("'text' must be a 1-D array of strings (numpy str or bytes, not objects)")
                sentences = [v.decode() if isinstance(v, bytes) else str(v) for v in array.ravel()]
                return [
                    InputSet(f"raw text {i}", {"text": np.array([s], dtype=object)})
                    for i, s in enumerate(sentences[:RAW_SAMPLE_SETS])
                ]
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, UnicodeDecodeError) as exc:
        raise invalid(f"not a readable .npz of plain arrays ({type(exc).__name__}: {exc})") from exc
    return None


def make_input_sets(
    model: onnx.ModelProto,
    *,
    count: int,
    seed: int = 0,
    shapes: Sequence[Mapping[str, Sequence[int]]] | None = None,
    samples_path: Path | None = None,
) -> list[InputSet]:
    """The input sets of a job: explicit shapes win, then samples.npz, else ``count`` generated sets."""
    if shapes:
        return generate_input_sets(model, len(shapes), seed=seed, shapes=shapes)
    if samples_path is not None:
        return [load_samples(samples_path, model)]
    return generate_input_sets(model, count, seed=seed)


# ------------------------------------------------------------------------------------------- sessions


def providers_for(target: str) -> list[str]:
    """The EP list for a target; raises UnavailableError when the target's EP is not installed."""
    import onnxruntime as ort

    wanted = _PROVIDERS.get(target)
    if wanted is None:
        raise InvalidInputError(f"unknown target {target!r}", code="INVALID_TARGET")
    available = set(ort.get_available_providers())
    if wanted[0] not in available:
        raise UnavailableError(
            f"target {target!r} needs {wanted[0]}, which this worker's onnxruntime does not provide "
            f"(available: {', '.join(sorted(available))}); route the job to a {target} worker",
            code="TARGET_UNAVAILABLE",
        )
    return [p for p in wanted if p in available]


ORT_CONSTANT_FOLD_MAX_BYTES = 256 << 20
# Op domains of onnxruntime-extensions (the prepost pass's tokenizer and image decoder ops).
EXTENSIONS_DOMAINS = (b"ai.onnx.contrib", b"com.microsoft.extensions")


def needs_extensions(model_path: Path) -> bool:
    """Whether the model file names an onnxruntime-extensions op domain (a prepost artifact).

    A byte scan, not a parse: the file is parsed once more by ORT anyway, and a false positive (the name in
    a doc string) only registers the one allow-listed library. Uploads using these domains never get here
    in the service: workers/validate.py refuses them before any parser runs."""
    try:
        st = os.stat(model_path)
    except OSError:  # ORT reports it
        return False
    return _scan_for_extensions(str(model_path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _scan_for_extensions(path: str, _mtime_ns: int, _size: int) -> bool:
    """Cached per file version: a job opens the same stage many times (verification, ledger, gate)."""
    import mmap

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return any(data.find(domain) >= 0 for domain in EXTENSIONS_DOMAINS)
    except (OSError, ValueError):  # unreadable or empty: ORT reports it
        return False


def register_extensions(options: Any) -> None:
    """Register onnxruntime-extensions' custom-op library from the installed package's own path: the only
    library a session may load (security.md bans custom-op libraries from uploads and requests)."""
    try:
        import onnxruntime_extensions
    except ImportError:
        return  # ORT then names the unregistered domain; the prepost pass itself needs the package
    options.register_custom_ops_library(onnxruntime_extensions.get_library_path())


def make_session(
    model_path: Path,
    *,
    target: str = "cpu",
    intra_op_threads: int = 0,
    optimize: bool = False,
    recipe: Mapping[str, Any] | None = None,
) -> Any:
    """An ORT session on ``model_path``. ``optimize=False``: ORT_DISABLE_ALL (verification);
    ``optimize=True``: ORT's default ORT_ENABLE_ALL, what a user deploying the model gets (benchmarks).
    ``recipe``: a ``tune_session`` recipe (metadata ``onnxforge.session``) applied on top, with its EP options,
    so that a benchmark measures the session users are told to create."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.add_session_config_entry("session.load_model_format", "ONNX")
    # ORT's own constant folding can be forced to allocate huge tensors at session creation
    # (microsoft/onnxruntime#28730, security.md T7): cap what it may fold.
    options.add_session_config_entry(
        "optimization.constant_folding_max_output_size_in_bytes", str(ORT_CONSTANT_FOLD_MAX_BYTES)
    )
    if needs_extensions(Path(model_path)):
        register_extensions(options)
    providers: list[Any] = list(providers_for(target))
    if recipe:
        # Apply what core.runtime.load would: its whitelist drops what users would not get.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            recipe = {k: v for k, v in sanitize_recipe(dict(recipe)).items() if k != "warmup"}
        options, providers = apply_recipe(dict(recipe), options, target=target)
    from workers.gpu import session_providers  # the job's GPU memory limit and device, in every session

    providers = session_providers(providers, target)
    return ort.InferenceSession(str(model_path), sess_options=options, providers=providers)


# ----------------------------------------------------------------------------------------- comparison


@dataclasses.dataclass
class OutputStats:
    """How one output of the candidate compares with the reference on one input set."""

    input_set: str
    name: str
    ok: bool
    reason: str | None
    shape_ref: list[int] | None
    shape_got: list[int] | None
    dtype_ref: str | None
    dtype_got: str | None
    elements: int = 0
    max_abs: float | None = None
    max_rel: float | None = None
    cosine: float | None = None
    mismatches: int = 0
    mismatch_ratio: float = 0.0
    nan_ref: int = 0
    nan_got: int = 0
    inf_ref: int = 0
    inf_got: int = 0
    # "all", or "valid" when a pass (padding_elimination) left pad positions undefined and only the
    # positions the mask marks valid were compared.
    positions: str = "all"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class VerificationResult:
    ok: bool
    outputs: list[OutputStats]
    reason: str | None = None

    def worst(self) -> dict[str, Any]:
        """A one-line summary for the ledger: worst errors over every output and input set."""
        finite = [o for o in self.outputs if o.max_abs is not None]
        cosines = [o.cosine for o in self.outputs if o.cosine is not None]
        return {
            "ok": self.ok,
            "reason": self.reason,
            "max_abs": max((o.max_abs for o in finite if o.max_abs is not None), default=None),
            "max_rel": max((o.max_rel for o in finite if o.max_rel is not None), default=None),
            "min_cosine": min(cosines, default=None),
            "mismatches": sum(o.mismatches for o in self.outputs),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "reason": self.reason, "outputs": [o.to_dict() for o in self.outputs]}


def _as_float(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def compare_output(input_set: str, name: str, ref: np.ndarray, got: np.ndarray, tolerance: Tolerance) -> OutputStats:
    """Compare one output. Floats: numpy.isclose(atol, rtol, equal_nan) plus cosine; other dtypes: exact."""
    ref, got = np.asarray(ref), np.asarray(got)
    stats = OutputStats(
        input_set,
        name,
        ok=True,
        reason=None,
        shape_ref=list(ref.shape),
        shape_got=list(got.shape),
        dtype_ref=str(ref.dtype),
        dtype_got=str(got.dtype),
        elements=int(ref.size),
    )
    if ref.dtype != got.dtype:
        stats.ok, stats.reason = False, f"dtype {got.dtype} instead of {ref.dtype}"
        return stats
    if ref.shape != got.shape:
        stats.ok, stats.reason = False, f"shape {list(got.shape)} instead of {list(ref.shape)}"
        return stats
    if ref.dtype.kind in "fc":
        r64, g64 = ref.astype(np.float64), got.astype(np.float64)
        stats.nan_ref, stats.nan_got = int(np.isnan(r64).sum()), int(np.isnan(g64).sum())
        stats.inf_ref, stats.inf_got = int(np.isinf(r64).sum()), int(np.isinf(g64).sum())
        close = np.isclose(g64, r64, atol=tolerance.atol, rtol=tolerance.rtol, equal_nan=True)
        both = np.isfinite(r64) & np.isfinite(g64)
        if both.any():
            diff = np.abs(g64[both] - r64[both])
            stats.max_abs = _as_float(diff.max())
            stats.max_rel = _as_float((diff / np.maximum(np.abs(r64[both]), np.finfo(np.float64).tiny)).max())
            a, b = r64[both].ravel(), g64[both].ravel()
            na, nb = np.linalg.norm(a), np.linalg.norm(b)
            if na == 0 and nb == 0:
                stats.cosine = 1.0
            elif na == 0 or nb == 0:
                stats.cosine = 0.0
            else:
                stats.cosine = float(np.clip(np.dot(a, b) / (na * nb), -1.0, 1.0))
        elif ref.size:
            stats.max_abs, stats.max_rel = 0.0, 0.0
    else:
        close = ref == got
        if ref.size:
            stats.max_abs = float(np.abs(got.astype(np.float64) - ref.astype(np.float64)).max())
    stats.mismatches = int(ref.size - int(np.count_nonzero(close)))
    stats.mismatch_ratio = stats.mismatches / ref.size if ref.size else 0.0
    problems = []
    if stats.mismatch_ratio > tolerance.max_mismatch_ratio:
        problems.append(
            f"{stats.mismatches}/{ref.size} elements outside atol={tolerance.atol:g} rtol={tolerance.rtol:g}"
            f" (max abs {stats.max_abs:.3g})"
            if stats.max_abs is not None
            else f"{stats.mismatches}/{ref.size} elements differ"
        )
    if stats.cosine is not None and stats.cosine < tolerance.min_cosine and ref.size > 1:
        problems.append(f"cosine {stats.cosine:.6f} < {tolerance.min_cosine}")
    if stats.nan_got != stats.nan_ref or stats.inf_got != stats.inf_ref:
        problems.append(f"NaN/Inf counts {stats.nan_got}/{stats.inf_got} instead of {stats.nan_ref}/{stats.inf_ref}")
    if problems:
        stats.ok, stats.reason = False, "; ".join(problems)
    return stats


def _valid_mask(spec: Mapping[str, Any], feeds: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """Boolean mask over an output's leading axes: True where the position is defined."""
    if "mask_input" in spec and spec["mask_input"] in feeds:
        return np.asarray(feeds[spec["mask_input"]]) != 0
    if "ids_input" in spec and spec["ids_input"] in feeds:
        return np.asarray(feeds[spec["ids_input"]]) != spec.get("pad_token_id")
    return None


class Verifier:
    """Reference outputs of the original, computed once; ``check`` compares any candidate with them."""

    def __init__(
        self,
        original_path: Path,
        input_sets: Sequence[InputSet],
        tolerance: Tolerance,
        *,
        target: str = "cpu",
        intra_op_threads: int = 0,
    ) -> None:
        self.input_sets = list(input_sets)
        self.tolerance = tolerance
        self.target = target
        self.intra_op_threads = intra_op_threads
        try:
            session = make_session(original_path, target=target, intra_op_threads=intra_op_threads)
        except UnavailableError:
            raise
        except Exception as exc:
            raise InvalidModelError(
                f"ONNX Runtime cannot load the original model: {type(exc).__name__}: {exc}",
                code="INVALID_MODEL",
            ) from exc
        self.output_names = [o.name for o in session.get_outputs()]
        self.reference: list[list[np.ndarray]] = []
        for input_set in self.input_sets:
            try:
                self.reference.append(session.run(None, input_set.feeds))
            except Exception as exc:
                raise InvalidInputError(
                    f"the original model fails on input set {input_set.name!r}: {type(exc).__name__}: {exc}; "
                    "give shapes in the config or upload samples.npz",
                    code="MODEL_RUN_FAILED",
                ) from exc

    def check(
        self,
        candidate_path: Path,
        valid_positions: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        adapter: Path | None = None,
    ) -> VerificationResult:
        """Compare a candidate with the reference. ``valid_positions`` maps an output name to the input that
        says which positions are defined (``{"mask_input": name, "axes": [0, 1]}`` or ``{"ids_input": name,
        "pad_token_id": id, "axes": [0, 1]}``): those outputs are compared at valid positions only.
        ``adapter``: an ``.onnx_adapter`` active on every run (extract_adapters moved the uploaded model's LoRA
        weights into it: only with it does the candidate compute what the original computes)."""
        valid_positions = valid_positions or {}
        try:
            session = make_session(candidate_path, target=self.target, intra_op_threads=self.intra_op_threads)
        except UnavailableError:
            raise
        except Exception as exc:
            return VerificationResult(False, [], f"ONNX Runtime cannot load the candidate: {type(exc).__name__}: {exc}")
        try:
            run_options, _active = run_options_with(adapter)  # _active: ORT does not keep the adapter alive
        except Exception as exc:
            return VerificationResult(False, [], f"ONNX Runtime cannot load the adapter: {type(exc).__name__}: {exc}")
        names = [o.name for o in session.get_outputs()]
        if names != self.output_names:
            return VerificationResult(False, [], f"outputs {names} instead of {self.output_names}")
        outputs: list[OutputStats] = []
        for input_set, reference in zip(self.input_sets, self.reference, strict=True):
            try:
                got = session.run(None, input_set.feeds, run_options)
            except Exception as exc:
                return VerificationResult(
                    False, outputs, f"the candidate fails on {input_set.name!r}: {type(exc).__name__}: {exc}"
                )
            for name, ref, value in zip(self.output_names, reference, got, strict=True):
                spec = valid_positions.get(name)
                if spec is None:
                    outputs.append(compare_output(input_set.name, name, ref, value, self.tolerance))
                    continue
                mask = _valid_mask(spec, input_set.feeds)
                if mask is None or ref.shape != value.shape or ref.shape[: mask.ndim] != mask.shape:
                    stats = compare_output(input_set.name, name, ref, value, self.tolerance)
                else:
                    stats = compare_output(input_set.name, name, ref[mask], value[mask], self.tolerance)
                    stats.shape_ref, stats.shape_got = list(ref.shape), list(value.shape)
                    stats.positions = "valid"
                outputs.append(stats)
        bad = [o for o in outputs if not o.ok]
        if bad:
            first = bad[0]
            more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
            return VerificationResult(
                False, outputs, f"output {first.name!r} on {first.input_set}: {first.reason}{more}"
            )
        return VerificationResult(True, outputs, None)
