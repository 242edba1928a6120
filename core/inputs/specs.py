"""Graph inputs, input sets and the user's samples.npz.

``graph_inputs`` lists what a caller must feed (tensors only, initializers excluded); an ``InputSet`` is one
named set of feeds with a record of where its values came from (``provenance``: the report shows it);
``load_samples`` checks samples.npz against the graph, ``load_raw_samples`` reads the raw images or sentences
of a model whose inputs a pass replaced (prepost).
"""

from __future__ import annotations

import dataclasses
import re
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from core.errors import InvalidInputError, InvalidModelError


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
    """One set of feeds, named for the report (e.g. ``input_ids=2x16`` or ``samples``).

    ``provenance``: which inputs were used and why, for the report: ``{"source": "generated" | "samples" |
    "shapes" | "raw", "guess": the guess that ran, "inputs": {name: {"role", "shape", "why"}}, "attempts":
    [{"guess", "error"}] of the guesses the original model refused}``. ``next_guess``: for generated sets,
    the next plausible guess (longer sequences, special tokens, no padding) to try when the original model
    refuses this one, or None when there is none left."""

    name: str
    feeds: dict[str, np.ndarray]
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)
    next_guess: Callable[[], InputSet | None] | None = dataclasses.field(default=None, repr=False, compare=False)

    def shapes(self) -> dict[str, list[int]]:
        return {k: list(v.shape) for k, v in self.feeds.items()}

    def adopt(self, other: InputSet, attempts: list[dict[str, Any]]) -> None:
        """Become ``other`` in place (every holder of this set sees the guess that ran), keeping the
        refused guesses in the provenance."""
        self.name, self.feeds, self.next_guess = other.name, other.feeds, other.next_guess
        self.provenance = {**other.provenance, "attempts": attempts}


def graph_inputs(model: onnx.ModelProto | ir.Model) -> list[InputSpec]:
    """The inputs a caller must feed: graph inputs that are not initializers, tensors only."""
    if isinstance(model, onnx.ModelProto):
        initializers = {init.name for init in model.graph.initializer}
        values = list(model.graph.input)
    else:  # only the inputs' types are serialized, never the weights
        initializers = set(model.graph.initializers)
        values = [ir.serde.serialize_value(v) for v in model.graph.inputs]
    specs = []
    for value in values:
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


def load_samples(path: Path, model: onnx.ModelProto | ir.Model) -> InputSet:
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
    return InputSet("samples", {name: arrays[name] for name in specs}, {"source": "samples", "guess": None})


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
                    sets.append(InputSet(f"raw {name}", {"image": array}, {"source": "raw"}))
                return sets
            if "text" in raw_inputs and names == ["text"]:
                array = archive["text"]
                if array.dtype.kind not in "US" or array.ndim > 1 or not array.size:
                    raise invalid("'text' must be a 1-D array of strings (numpy str or bytes, not objects)")
                sentences = [v.decode() if isinstance(v, bytes) else str(v) for v in array.ravel()]
                return [
                    InputSet(f"raw text {i}", {"text": np.array([s], dtype=object)}, {"source": "raw"})
                    for i, s in enumerate(sentences[:RAW_SAMPLE_SETS])
                ]
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, UnicodeDecodeError) as exc:
        raise invalid(f"not a readable .npz of plain arrays ({type(exc).__name__}: {exc})") from exc
    return None


def _present_for(past: str, outputs: list[str]) -> str | None:
    for old, new in (("past_key_values", "present"), ("past_key_values", "present_key_values"), ("past", "present")):
        name = past.replace(old, new, 1)
        if name != past and name in outputs:
            return name
    return None


def cache_pairs(pasts: list[str], outputs: list[str]) -> dict[str, str] | str:
    """Past input -> present output: by name (Optimum and torch.onnx.export's ``past_key_values.N.key`` ->
    ``present.N.key``), else in order among outputs named ``present*``; a sentence when neither fits."""
    by_name = {p: _present_for(p, outputs) for p in pasts}
    if all(by_name.values()):
        return {p: str(n) for p, n in by_name.items()}
    presents = [o for o in outputs if re.search(r"present", o, re.IGNORECASE)]
    if len(presents) == len(pasts):
        return dict(zip(pasts, presents, strict=True))
    return (
        f"cannot tell which output feeds each of the {len(pasts)} past inputs back "
        f"({len(presents)} outputs are named present*)"
    )
