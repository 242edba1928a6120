"""fix_shapes: freeze symbolic input dims to given sizes for static runtimes (ORT ``make_dynamic_shape_fixed``).

Re-implements ``python -m onnxruntime.tools.make_dynamic_shape_fixed`` (``--dim_param`` / ``--input_shape``)
on onnx-ir: ``dims`` replaces a named dim (``dim_param``) everywhere it appears (inputs, outputs and
intermediate values), ``inputs`` gives one input a full shape. Shapes are then re-inferred, so every value
the fixed dims determine becomes static: what TensorRT, NNAPI, CoreML and QNN want (seed 004: static length
export), and what lets ORT plan memory once. ORT then refuses any other shape at that input::

    input_ids[batch, sequence] --Gather--> [batch, sequence, 768]
    ==>  (dims={"batch": 1, "sequence": 128})
    input_ids[1, 128] --Gather--> [1, 128, 768]

Refuses (no change, with a reason) when a named dim is not in the graph, an input is unknown, a given
shape's rank differs, or a given size contradicts a static one. It declares ``may_freeze_axes``, the one
pass that does: the pipeline generates its verification inputs at the fixed shapes and rolls back any pass
without the declaration that removes a dynamic axis (``workers/ledger.py``).
"""

from __future__ import annotations

import onnx_ir as ir
from pydantic import Field, model_validator

from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes.cleanup.shape_inference import ShapeInference


class FixShapesOptions(PassOptions):
    dims: dict[str, int] = Field(
        default_factory=dict, description='Symbolic dim name -> size, e.g. {"batch": 1, "sequence": 128}.'
    )
    inputs: dict[str, list[int]] = Field(
        default_factory=dict, description='Input name -> full static shape, e.g. {"input_ids": [1, 128]}.'
    )

    @model_validator(mode="after")
    def _something(self) -> FixShapesOptions:
        if not self.dims and not self.inputs:
            raise ValueError("give dims or inputs (or both)")
        if any(v < 1 for v in self.dims.values()) or any(d < 1 for s in self.inputs.values() for d in s):
            raise ValueError("sizes must be positive")
        return self


def _dim_name(dim: object) -> str | None:
    return dim.value if isinstance(dim, ir.SymbolicDim) else None


def fixed_dims(model: ir.Model, options: FixShapesOptions) -> tuple[dict[str, int], list[NonMatch]]:
    """The dim_param -> size map implied by the options, or the reasons it cannot be applied."""
    problems: list[NonMatch] = []
    mapping = dict(options.dims)
    inputs = {v.name: v for v in model.graph.inputs}
    for name, shape in options.inputs.items():
        value = inputs.get(name)
        if value is None:
            problems.append(NonMatch(f"inputs names {name!r}, which is not a graph input ({', '.join(inputs)})"))
            continue
        if value.shape is None or len(value.shape) != len(shape):
            rank = "unknown" if value.shape is None else len(value.shape)
            problems.append(NonMatch(f"input {name!r} has rank {rank}, the shape given has {len(shape)}"))
            continue
        for axis, (dim, size) in enumerate(zip(value.shape, shape, strict=True)):
            if isinstance(dim, int) and dim != size:
                problems.append(NonMatch(f"input {name!r} axis {axis} is static {dim}, not {size}"))
            elif _dim_name(dim) is not None and mapping.setdefault(_dim_name(dim) or "", size) != size:
                problems.append(
                    NonMatch(f"dim {_dim_name(dim)!r} given two sizes: {mapping[_dim_name(dim) or '']}, {size}")
                )
    declared = {_dim_name(d) for v in model.graph.inputs if v.shape for d in v.shape} - {None}
    for name in options.dims:
        if name not in declared:
            problems.append(NonMatch(f"dims names {name!r}, which no graph input has (inputs use: {sorted(declared)})"))
    return mapping, problems


def _freeze(shape: ir.Shape | None, mapping: dict[str, int], unnamed: dict[int, int] | None = None) -> ir.Shape | None:
    if shape is None:
        return None
    dims = []
    for axis, dim in enumerate(shape):
        name = _dim_name(dim)
        if name is not None and name in mapping:
            dims.append(mapping[name])
        elif not isinstance(dim, int) and unnamed and axis in unnamed:
            dims.append(unnamed[axis])
        else:
            dims.append(dim)
    return ir.Shape(dims)


class FixShapes(Pass[FixShapesOptions]):
    name = "fix_shapes"
    summary = "Freeze symbolic input dims to given sizes (static shapes for TensorRT, NNAPI, CoreML)."
    exact = True
    in_place = True
    may_freeze_axes = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        opts = self.options
        mapping, problems = fixed_dims(model, opts)
        if problems:
            return PassResult(model, False, {"dims_fixed": 0}, problems, {"decision": "refused"})
        changed = 0
        for graph in model.graphs():
            for value in ir.convenience.create_value_mapping(graph, include_subgraphs=False).values():
                unnamed = None
                if graph is model.graph and value in graph.inputs and value.name in opts.inputs:
                    unnamed = dict(enumerate(opts.inputs[value.name or ""]))
                frozen = _freeze(value.shape, mapping, unnamed)
                if frozen is not None and value.shape is not None and list(frozen) != list(value.shape):
                    changed += sum(1 for a, b in zip(frozen, value.shape, strict=True) if a != b)
                    value.shape = frozen
        if not changed:
            return PassResult(model, False, {"dims_fixed": 0}, [NonMatch("every given dim is already static")])
        ShapeInference()(model, ctx)
        notes = {"dims": mapping, "inputs": {v.name: list(v.shape or []) for v in model.graph.inputs}}
        return PassResult(model, True, {"dims_fixed": changed}, [], notes)
