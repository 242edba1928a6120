"""Numerical equivalence of two ONNX models under onnxruntime (CPU), for pass tests.

Both models run with ``GraphOptimizationLevel.ORT_DISABLE_ALL``: the reference must be the graph as
written, and the optimized graph must stand on its own, so ORT's own fusions can hide neither a broken
original nor a broken rewrite (onnxscript ``ort_fusions/_test_utils.py`` does the same).

Inputs are random, drawn from each graph input's declared type. Symbolic and unknown dimensions are
resolved to several sizes (1, 3, 7, ...) so a pass that bakes the example batch size into the graph fails
here; dims sharing a name get the same size in every input.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

ModelLike = onnx.ModelProto | ir.Model | str | Path

# Sizes given to symbolic dimensions, one set of inputs per entry (cycled when n_random is larger).
_DIM_SIZES = (1, 3, 7, 2, 5)


def to_proto(model: ModelLike) -> onnx.ModelProto:
    """Any model form a test holds, as a ModelProto (``onnx_ir.serde.serialize_model`` for IR models)."""
    if isinstance(model, ir.Model):
        return ir.serde.serialize_model(model)
    if isinstance(model, onnx.ModelProto):
        return model
    return onnx.load(str(model))


def reference_session(model: ModelLike) -> ort.InferenceSession:
    """A CPU session of the graph as written (``ORT_DISABLE_ALL``), from a file, a proto or an IR model."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    if isinstance(model, str | Path):
        source: str | bytes = str(model)  # ORT resolves external data relative to the file
    else:
        source = to_proto(model).SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def run_named(session: ort.InferenceSession, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of ``session`` on ``feeds``, by name."""
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds)), strict=True))


def _input_dims(proto: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    dims: dict[str, list[int | str | None]] = {}
    initializers = {init.name for init in proto.graph.initializer}
    for value in proto.graph.input:
        if value.name in initializers:
            continue  # an overridable initializer: ORT uses the stored value
        shape = value.type.tensor_type.shape
        dims[value.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in shape.dim]
    return dims


def example_shapes(model: ModelLike, n: int = 3) -> list[dict[str, tuple[int, ...]]]:
    """``n`` concrete shape sets for the model's inputs: symbolic dims set to 1, 3, 7, ..."""
    dims = _input_dims(to_proto(model))
    shapes = []
    for size in itertools.islice(itertools.cycle(_DIM_SIZES), n):
        shapes.append({name: tuple(d if isinstance(d, int) else size for d in ds) for name, ds in dims.items()})
    return shapes


def random_inputs(
    session: ort.InferenceSession, shapes: Mapping[str, tuple[int, ...]], rng: np.random.Generator
) -> dict[str, np.ndarray]:
    feeds = {}
    for arg in session.get_inputs():
        shape = shapes[arg.name]
        kind = arg.type  # e.g. "tensor(float)"
        if kind in ("tensor(float)", "tensor(double)", "tensor(float16)"):
            dtype = {"tensor(float)": np.float32, "tensor(double)": np.float64}.get(kind, np.float16)
            feeds[arg.name] = np.asarray(rng.standard_normal(shape), dtype=dtype)
        elif kind == "tensor(bool)":
            feeds[arg.name] = np.asarray(rng.random(shape) < 0.5)
        elif kind.startswith(("tensor(int", "tensor(uint")):
            # Small non-negative values: valid as indices, repeats or axes in most graphs.
            feeds[arg.name] = np.asarray(rng.integers(0, 5, size=shape), dtype=kind[len("tensor(") : -1])
        else:
            raise NotImplementedError(f"random input for {arg.name}: {kind}")
    return feeds


def _describe_mismatch(
    name: str, ref: np.ndarray, got: np.ndarray, *, rtol: float, atol: float, feeds: Mapping[str, np.ndarray]
) -> str:
    close = np.isclose(got, ref, rtol=rtol, atol=atol, equal_nan=True)
    bad = np.argwhere(~close)
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    first = ", ".join(f"{tuple(i)}: ref={ref[tuple(i)]!r} got={got[tuple(i)]!r}" for i in bad[:5])
    shapes = {k: v.shape for k, v in feeds.items()}
    return (
        f"output {name!r} differs in {len(bad)}/{ref.size} elements (rtol={rtol}, atol={atol}); "
        f"max abs diff {np.nanmax(diff):.3g}; inputs {shapes}; first: {first}"
    )


def assert_equivalent(
    original: ModelLike,
    optimized: ModelLike,
    shapes: Sequence[Mapping[str, tuple[int, ...]]] | None = None,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    n_random: int = 3,
    seed: int = 0,
) -> None:
    """Assert both models give the same outputs (names, dtypes, shapes, values) on random inputs.

    ``shapes``: explicit input shape sets to try in addition to ``n_random`` derived ones.
    """
    ref_session, opt_session = reference_session(original), reference_session(optimized)
    ref_names = [o.name for o in ref_session.get_outputs()]
    opt_names = [o.name for o in opt_session.get_outputs()]
    assert ref_names == opt_names, f"output names differ: {ref_names} vs {opt_names}"
    ref_inputs = sorted(i.name for i in ref_session.get_inputs())
    opt_inputs = sorted(i.name for i in opt_session.get_inputs())
    assert ref_inputs == opt_inputs, f"input names differ: {ref_inputs} vs {opt_inputs}"

    rng = np.random.default_rng(seed)
    shape_sets = [*(shapes or []), *example_shapes(original, n_random)]
    for shape_set in shape_sets:
        feeds = random_inputs(ref_session, shape_set, rng)
        expected = ref_session.run(None, feeds)
        actual = opt_session.run(None, feeds)
        for name, ref_out, opt_out in zip(ref_names, expected, actual, strict=True):
            ref, got = np.asarray(ref_out), np.asarray(opt_out)
            assert ref.dtype == got.dtype, f"output {name!r}: dtype {got.dtype}, expected {ref.dtype}"
            assert ref.shape == got.shape, f"output {name!r}: shape {got.shape}, expected {ref.shape}"
            if not np.allclose(got, ref, rtol=rtol, atol=atol, equal_nan=True):
                raise AssertionError(_describe_mismatch(name, ref, got, rtol=rtol, atol=atol, feeds=feeds))
