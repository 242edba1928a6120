"""Artifact I/O: reading the upload, writing stages and the artifact with their side files, provenance.

Every model the engine writes goes through ``save_ir`` (weights move to ``<name>.data`` above the protobuf
limit) and every side file a pass produced (``ctx.side_files``: ``stage.onnx`` -> ``stage.onnx_adapter``)
through ``write_side_files``, so a stage on disk is always complete: verification, timing and rollback
(reloading the last accepted stage) read files, never objects in memory.

Provenance (``stamp``) is deterministic: passes, preset, onnxforge version and the upload's sha256, and no
timestamp, so two runs differ only in ``onnxforge.job_id``. ``place`` puts the returned model into the output
directory atomically (copy to a temporary name, then rename).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

import onnx
import onnx_ir as ir

from core.errors import InvalidModelError
from core.model_files import save_model
from core.recipe import RECIPE_KEY
from core.version import __version__
from passes._infra import Pass
from workers import output_adapters
from workers.model_check import check_model, sorted_copy, unsorted_nodes
from workers.output_adapters import DetachedOutputs

MODEL_FILE = "model.onnx"
META_PREFIX = "onnxforge."
# Written by passes and kept through stamp: tune_session's recipe, and prepost's note that the artifact needs
# onnxruntime-extensions and how to register it (a consumer cannot load the model without it).
KEPT_META = frozenset({RECIPE_KEY, META_PREFIX + "requires", META_PREFIX + "register"})


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_checked(path: Path) -> tuple[onnx.ModelProto, DetachedOutputs | None]:
    """The upload, weights inlined, after the model check (``onnx.checker``, I/O shapes optional), with its
    trailing ZipMaps taken off (``workers.output_adapters``; what was taken, or None).

    InvalidModelError when it does not load or check, or holds another map-typed value."""
    try:
        proto = onnx.load(str(path), load_external_data=True)
        check_model(path)
    except Exception as exc:
        raise InvalidModelError(
            f"the model does not load or check: {type(exc).__name__}: {exc}", code="INVALID_MODEL"
        ) from exc
    proto, taken = output_adapters.detach(proto)
    if mapped := _map_typed(proto):
        raise InvalidModelError(
            f"the model's {mapped} has a map type, which onnxforge cannot read (its graph library, onnx-ir, has "
            "no map type; ONNX Runtime runs it). A ZipMap that ends a classifier is taken off and put back; a map "
            "anywhere else is not (a DictVectorizer's input: send the features as a tensor)",
            code="UNSUPPORTED_MODEL",
        )
    return (sorted_copy(proto) if unsorted_nodes(proto) else proto), taken


def _map_typed(proto: onnx.ModelProto) -> str | None:
    """'output NAME' (or input, value) of the main graph whose type holds a map, if any."""

    def holds_map(tp: onnx.TypeProto) -> bool:
        kind = tp.WhichOneof("value")
        if kind == "map_type":
            return True
        if kind in ("sequence_type", "optional_type"):
            return holds_map(getattr(tp, kind).elem_type)
        return False

    graph = proto.graph
    for where, values in (("input", graph.input), ("output", graph.output), ("value", graph.value_info)):
        for value in values:
            if holds_map(value.type):
                return f"{where} {value.name!r}"
    return None


def load_ir(path: Path) -> ir.Model:
    """The model at ``path``, weights inlined, its nodes in topological order (an upload may have them out of
    order, which ORT accepts: ``workers.model_check``); passes read producers before their readers."""
    proto = onnx.load(str(path), load_external_data=True)
    model = ir.serde.deserialize_model(proto)
    if unsorted_nodes(proto):
        model.graph.sort()
    return model


def save_ir(model: ir.Model, path: Path) -> list[Path]:
    """Write ``model`` to ``path``; weights go to ``<name>.data`` beside it above the protobuf limit."""
    data = path.with_name(path.name + ".data")
    with contextlib.suppress(FileNotFoundError):
        data.unlink()
    return [data] if save_model(model, path) else []


def write_side_files(path: Path, side_files: dict[str, bytes], *, stale: Iterable[str] = ()) -> None:
    """Write a pass's side files next to the model at ``path`` (``stage.onnx`` -> ``stage.onnx_adapter``),
    first removing the ones named in ``stale`` (suffixes an earlier write at this path may have left)."""
    for suffix in stale:
        path.with_suffix(suffix).unlink(missing_ok=True)
    for suffix, data in side_files.items():
        path.with_suffix(suffix).write_bytes(data)


def read_side_files(path: Path, suffixes: Iterable[str]) -> dict[str, bytes]:
    """The side files of ``suffixes`` that lie next to the model at ``path``."""
    return {sfx: path.with_suffix(sfx).read_bytes() for sfx in suffixes if path.with_suffix(sfx).exists()}


def external_files(path: Path) -> list[str]:
    """Relative locations of the external-data files the (already loaded and checked) model refers to.

    Read from the graph alone: ``onnx.load(load_external_data=True)`` inlines the weights and forgets
    where they came from."""
    proto = onnx.load(str(path), load_external_data=False)
    locations: list[str] = []
    for tensor in _tensors(proto.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location" and entry.value not in locations:
                    locations.append(entry.value)
    return locations


def proto_dynamic_axes(proto: onnx.ModelProto) -> dict[str, set[int]]:
    """``input:<name>`` / ``output:<name>`` -> the axes declared dynamic (a dim_param or no value)."""
    initializers = {i.name for i in proto.graph.initializer}
    axes: dict[str, set[int]] = {}
    for kind, values in (("input", proto.graph.input), ("output", proto.graph.output)):
        for value in values:
            if value.name in initializers or not value.type.HasField("tensor_type"):
                continue
            shape = value.type.tensor_type.shape if value.type.tensor_type.HasField("shape") else None
            if shape is None:
                continue
            dynamic = {i for i, d in enumerate(shape.dim) if not d.HasField("dim_value")}
            if dynamic:
                axes[f"{kind}:{value.name}"] = dynamic
    return axes


def dynamic_axes(path: Path) -> dict[str, set[int]]:
    return proto_dynamic_axes(onnx.load(str(path), load_external_data=False))


def lost_axes(expected: dict[str, set[int]], path: Path) -> list[str]:
    """The axes dynamic in ``expected`` that the model at ``path`` declares static (or dropped)."""
    now = dynamic_axes(path)
    return [
        f"{key} axis {axis}" for key, axes in sorted(expected.items()) for axis in sorted(axes - now.get(key, set()))
    ]


@dataclasses.dataclass(frozen=True)
class Provenance:
    """What ``stamp`` writes into every artifact besides the passes."""

    source_sha256: str
    preset: str | None
    job_id: str | None


def stamp(model: ir.Model, passes: Sequence[Pass], provenance: Provenance) -> None:
    """Replace the model's ``onnxforge.*`` metadata (but the KEPT_META keys passes wrote) with provenance."""
    props = {k: v for k, v in model.metadata_props.items() if not k.startswith(META_PREFIX) or k in KEPT_META}
    props[META_PREFIX + "version"] = __version__
    props[META_PREFIX + "preset"] = provenance.preset or ""
    props[META_PREFIX + "passes"] = json.dumps(
        [{"name": p.name, "options": p.options.model_dump(mode="json")} for p in passes],
        sort_keys=True,
        separators=(",", ":"),
    )
    props[META_PREFIX + "source_sha256"] = provenance.source_sha256
    if provenance.job_id:
        props[META_PREFIX + "job_id"] = provenance.job_id
    model.metadata_props.clear()
    model.metadata_props.update(props)


def write_stamped(
    model: ir.Model, passes: Sequence[Pass], provenance: Provenance, path: Path, side_files: dict[str, bytes]
) -> Path:
    """``model`` stamped and written to ``path`` with its side files: an artifact candidate."""
    stamp(model, passes, provenance)
    save_ir(model, path)
    write_side_files(path, side_files)
    return path


def _copy_atomically(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _copy_relocated(src: Path, dst: Path, old: str, new: str) -> None:
    """Copy the model at ``src`` (weights not read) to ``dst`` with every external-data location ``old``
    renamed ``new``: the artifact's ``artifact.onnx.data`` is handed back as ``model.onnx.data``."""
    proto = onnx.load(str(src), load_external_data=False)
    for tensor in _tensors(proto.graph):
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value == old:
                entry.value = new
    tmp = dst.with_name(f".{dst.name}.tmp")
    onnx.save(proto, str(tmp))
    os.replace(tmp, dst)


def _tensors(graph: onnx.GraphProto) -> Iterable[onnx.TensorProto]:
    """Every tensor of ``graph`` and its subgraphs: initializers and tensor attributes (Constant's value)."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def place(
    *,
    use_original: bool,
    artifact: Path,
    source: Path,
    source_external: list[str],
    output_dir: Path,
    side_suffixes: Iterable[str],
) -> tuple[Path, list[Path], list[Path]]:
    """Put the returned model in ``output_dir``: the optimized ``artifact`` with its ``.data`` and side files,
    or (``use_original``) the upload with its external data, byte for byte. (model, external data, side files).

    Files are copied to a temporary name and renamed into place, so a reader never sees half a model,
    and an output dir that is also the upload's dir never loses the upload before it is copied."""
    suffixes = sorted(side_suffixes)
    final_path = output_dir / MODEL_FILE
    relocate: tuple[str, str] | None = None  # the artifact's weights file is renamed: its model must say so
    if use_original:
        files = [(source, final_path)] + [(source.parent / loc, output_dir / loc) for loc in source_external]
    else:
        files = [(artifact, final_path)]
        data = artifact.with_name(artifact.name + ".data")
        if data.exists():
            files.append((data, output_dir / (MODEL_FILE + ".data")))
            relocate = (data.name, MODEL_FILE + ".data")
    side = [] if use_original else [(artifact.with_suffix(sfx), final_path.with_suffix(sfx)) for sfx in suffixes]
    if not side:
        for suffix in suffixes:  # left over from an earlier attempt that kept the side file
            final_path.with_suffix(suffix).unlink(missing_ok=True)
    stale = output_dir / (MODEL_FILE + ".data")
    if all(stale.resolve() != dst.resolve() for _, dst in files) and stale.resolve() not in {
        (source.parent / loc).resolve() for loc in source_external
    }:
        stale.unlink(missing_ok=True)  # left over from an earlier attempt in the same dir
    # Weights before the model that names them, so a reader that sees the model finds its data.
    for src, dst in reversed(files):
        if src.resolve() == dst.resolve():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if relocate is not None and dst == final_path:
            _copy_relocated(src, dst, *relocate)
        else:
            _copy_atomically(src, dst)
    for src, dst in side:
        _copy_atomically(src, dst)
    return final_path, [dst for _, dst in files[1:]], [dst for _, dst in side]
