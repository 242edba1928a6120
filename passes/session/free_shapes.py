"""free_shapes: find the shape constants that pin a dynamic axis, and free them where 0 or 1 says the same.

Tracing exporters (torch.jit.trace, gluon ``.shape`` calls, seed 004) bake the example's batch and sequence
sizes into ``Reshape``/``Expand``/``ConstantOfShape`` constants, so the "dynamic" model runs at the export
shape only (onnxsim #21, #86: "outputs no longer dynamic"). ONNX shape inference shows
it: the constant makes every value downstream static. This pass re-implements the fix people apply by hand
(ORT's transformers ``fusion_reshape`` does the same for one BERT pattern), on the general rule:

* ``Reshape(x, c)``: where ``x``'s axis ``i`` is dynamic and ``c[i]`` is a positive size, ``c[i]`` pins
  it; ``0`` ("copy the input's size", ``allowzero=0``) computes the same at the export shape and follows
  the axis at every other one::

      x[batch, 16] --Reshape([2, 4, 4])--> [2, 4, 4]        (runs at batch 2 only)
      ==>  x[batch, 16] --Reshape([0, 4, 4])--> [batch, 4, 4]

* ``Expand(x, c)``: where ``x``'s axis is dynamic and ``c`` repeats it (``c[j] > 1``), ``1`` broadcasts the
  same;
* ``ConstantOfShape(c)``, and Reshape sizes on axes that do not line up, are **reported** only (freeing
  them needs ``Shape`` arithmetic): each names the node, the axis, the value and the dynamic dim it equals.

Shapes are re-inferred after each round, so a pin downstream of a freed one is found too. A candidate is
skipped when the samples bind the axis to another size than the constant (then the constant does not pin it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from pydantic import Field

from core.inputs.graph import const_array
from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes.cleanup.shape_inference import ShapeInference

_ROUNDS = 8


class FreeShapesOptions(PassOptions):
    rewrite: bool = Field(
        True, description="Rewrite the pins that 0 (Reshape) or 1 (Expand) frees; false: report only."
    )


def _sample_sizes(model: ir.Model, samples: list[dict[str, np.ndarray]]) -> dict[str, set[int]]:
    """dim_param -> the sizes the samples give it."""
    sizes: dict[str, set[int]] = {}
    for value in model.graph.inputs:
        for sample in samples:
            array = sample.get(value.name or "")
            if array is None or value.shape is None or np.ndim(array) != len(value.shape):
                continue
            for dim, size in zip(value.shape, np.shape(array), strict=True):
                if isinstance(dim, ir.SymbolicDim) and dim.value:
                    sizes.setdefault(dim.value, set()).add(int(size))
    return sizes


def _label(dim: Any) -> str:
    return dim.value if isinstance(dim, ir.SymbolicDim) and dim.value else "an unnamed dynamic dim"


def _clear_intermediate_shapes(model: ir.Model) -> None:
    io = {*model.graph.inputs, *model.graph.outputs}
    for node in model.graph:
        for out in node.outputs:
            if out not in io:
                out.shape = None


class FreeShapes(Pass[FreeShapesOptions]):
    name = "free_shapes"
    summary = "Report Reshape/Expand/ConstantOfShape constants that pin a dynamic axis; free them with 0/1."
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        opts = self.options
        # Inference may narrow a declared dynamic output to the pinned size: the declared I/O shapes stay.
        declared = {id(v): v.shape for v in (*model.graph.inputs, *model.graph.outputs)}
        ShapeInference()(model, ctx)
        sizes = _sample_sizes(model, ctx.samples)
        example = {size for values in sizes.values() for size in values if size > 1}
        pins: list[dict[str, Any]] = []
        reported: list[NonMatch] = []
        freed = 0
        seen: set[tuple[str, int]] = set()
        for _ in range(_ROUNDS):
            rewrites: list[tuple[ir.Node, np.ndarray]] = []
            for index, node in enumerate(model.graph):
                label = node.name or f"{node.op_type}#{index}"
                if node.domain not in ("", "ai.onnx"):
                    continue
                if node.op_type in ("Reshape", "Expand") and len(node.inputs) > 1:
                    shape, data = const_array(node.inputs[1]), node.inputs[0]
                    if shape is None or data is None or data.shape is None:
                        continue
                    new = shape.copy()
                    rank, n = len(data.shape), len(shape)
                    for j in range(n):
                        # Reshape lines axes up from the left; Expand broadcasts from the right.
                        i = j if node.op_type == "Reshape" else j - (n - rank)
                        dim = data.shape[i] if 0 <= i < rank else None
                        value = int(shape[j])
                        dynamic = dim is not None and not isinstance(dim, int)
                        name = dim.value if isinstance(dim, ir.SymbolicDim) else None
                        if not dynamic or value <= (0 if node.op_type == "Reshape" else 1):
                            if value in example and (label, j) not in seen and value > 1 and dim is None:
                                seen.add((label, j))
                                reported.append(
                                    NonMatch(
                                        f"shape constant {shape.tolist()} axis {j} = {value} equals an example size of "
                                        "a dynamic dim and cannot be freed by 0/1 (use Shape arithmetic)",
                                        label,
                                        node.op_type,
                                    )
                                )
                            continue
                        if name and name in sizes and value not in sizes[name]:
                            continue  # the samples give this axis another size: not a pin
                        if (label, j) in seen:
                            continue
                        seen.add((label, j))
                        free = node.op_type == "Expand" or node.attributes.get_int("allowzero", 0) == 0
                        pins.append(
                            {
                                "node": label,
                                "op_type": node.op_type,
                                "axis": j,
                                "value": value,
                                "dim": _label(dim),
                                "freed": bool(opts.rewrite and free),
                            }
                        )
                        if opts.rewrite and free:
                            new[j] = 0 if node.op_type == "Reshape" else 1
                    if not np.array_equal(new, shape):
                        rewrites.append((node, new))
                elif node.op_type == "ConstantOfShape":
                    shape = const_array(node.inputs[0])
                    if shape is None:
                        continue
                    for j, value in enumerate(shape.tolist()):
                        if int(value) in example and (label, j) not in seen:
                            seen.add((label, j))
                            pins.append(
                                {
                                    "node": label,
                                    "op_type": node.op_type,
                                    "axis": j,
                                    "value": int(value),
                                    "dim": "example size",
                                    "freed": False,
                                }
                            )
                            reported.append(
                                NonMatch(
                                    f"ConstantOfShape({shape.tolist()}) axis {j} = {int(value)} equals an example "
                                    "size of a dynamic dim: replace it with Shape arithmetic to follow the input",
                                    label,
                                    node.op_type,
                                )
                            )
            if not rewrites:
                break
            for node, new in rewrites:
                const = ir.Value(
                    name=f"{node.name or node.op_type}_free_shape",
                    type=ir.TensorType(ir.DataType.INT64),
                    shape=ir.Shape([len(new)]),
                )
                const.const_value = ir.tensor(new.astype(np.int64), name=const.name)
                model.graph.register_initializer(const)
                node.replace_input_with(1, const)
                freed += 1
            _clear_intermediate_shapes(model)
            ShapeInference()(model, ctx)
        for value in (*model.graph.inputs, *model.graph.outputs):
            value.shape = declared.get(id(value), value.shape)
        for value in list(model.graph.initializers.values()):
            if not value.uses() and value not in model.graph.inputs and value not in model.graph.outputs:
                model.graph.initializers.pop(value.name or "")
        counts = {"pins_found": len(pins), "pins_freed": sum(p["freed"] for p in pins), "constants_rewritten": freed}
        notes = {"pins": pins}
        non_matches = reported + [
            NonMatch(
                f"{p['op_type']} axis {p['axis']} = {p['value']} pins {p['dim']}"
                + ("" if p["freed"] else " (allowzero=1 or rewrite off: left)"),
                p["node"],
                p["op_type"],
            )
            for p in pins
            if not p["freed"]
        ]
        if not freed:
            if not pins and not reported:
                non_matches.append(NonMatch("no shape constant pins a dynamic axis"))
            return PassResult(model, False, counts, non_matches, notes)
        return PassResult(model, True, counts, non_matches, notes)
