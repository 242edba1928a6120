"""The prepost pass's graph: onnxruntime-extensions' ``PrePostProcessor`` joins the steps to the model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as ir_common

from core.model_files import save_model
from passes.prepost._prepost_options import PoolPost, TopKPost, fail

if TYPE_CHECKING:
    from passes.prepost._prepost_text import TextPlan


def graph_inputs(proto: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    inits = {i.name for i in proto.graph.initializer}
    return {i.name: i for i in proto.graph.input if i.name not in inits}


def dims_of(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    out: list[int | str | None] = []
    for d in vi.type.tensor_type.shape.dim:
        out.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
    return out


def post_steps(post: list[Any], steps: Any, text_plan: TextPlan | None) -> tuple[list[Any], list[str]]:
    """The library steps for the post chain, and the artifact's output names (empty: keep the model's)."""
    from onnxruntime_extensions.tools.pre_post_processing import IoMapEntry

    ort = steps.ort_steps()
    built: list[Any] = []
    names: list[str] = []
    for item in post:
        if item == "softmax":
            built.append(ort.Softmax())
            names = ["probabilities"]
        elif item == "argmax":
            built.append(ort.ArgMax(axis=-1, keepdims=0))
            names = ["label"]
        elif item == "l2norm":
            built.append(steps.L2Normalize())
            names = ["embedding"]
        elif isinstance(item, TopKPost):
            built.append(steps.TopK(item.topk))
            names = ["topk_values", "topk_indices"]
        elif isinstance(item, PoolPost):
            assert text_plan is not None
            mask_index = text_plan.outputs.index("attention_mask")
            built.append((steps.MaskedMeanPool(), [IoMapEntry(text_plan.step.name, mask_index, 1)]))
            names = ["embedding"]
    return built, names


def build(
    proto: onnx.ModelProto,
    raw_input: onnx.ValueInfoProto,
    pre_steps: list[Any],
    *,
    post_steps: list[Any],
    final_names: list[str],
    model_outputs: list[str],
) -> onnx.ModelProto:
    from onnxruntime_extensions.tools.pre_post_processing import PrePostProcessor

    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 18)
    functions = list(proto.functions)
    try:
        processor = PrePostProcessor([raw_input], onnx_opset=max(18, opset))
        processor.add_pre_processing(pre_steps)
        if post_steps:
            processor.add_post_processing(post_steps)
        built = processor.run(proto)
    except Exception as exc:
        raise fail("PREPOST_BUILD_FAILED", f"onnxruntime-extensions could not build the graph: {exc}") from exc
    graph = built.graph
    produced = [o.name for o in graph.output]
    if post_steps:
        # The chain's outputs are the ones that are not the model's own (which the processor keeps too).
        chain = [n for n in produced if n not in model_outputs and n != raw_input.name]
        if len(chain) != len(final_names):
            raise fail("PREPOST_BUILD_FAILED", f"unexpected outputs {produced} for the post chain {final_names}")
        renames = dict(zip(chain, final_names, strict=True))
        keep = [o for o in graph.output if o.name in renames]
        for node in graph.node:
            for i, name in enumerate(node.output):
                if name in renames:
                    node.output[i] = renames[name]
            for i, name in enumerate(node.input):
                if name in renames:
                    node.input[i] = renames[name]
        for o in keep:
            o.name = renames[o.name]
        del graph.output[:]
        graph.output.extend(keep)
    else:
        keep = [o for o in graph.output if o.name in model_outputs]
        del graph.output[:]
        graph.output.extend(keep)
    model = onnx.helper.make_model(graph, opset_imports=list(built.opset_import), ir_version=max(built.ir_version, 8))
    model.functions.extend(functions)
    for f in functions:  # the functions' own domains
        if all(o.domain != f.domain for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(f.domain, 1))
    for o in proto.opset_import:  # custom domains the original used
        if all(m.domain != o.domain for m in model.opset_import):
            model.opset_import.append(o)
    model.producer_name, model.producer_version = proto.producer_name, proto.producer_version
    model.doc_string = proto.doc_string
    ir_model = ir.serde.deserialize_model(model)
    ir_common.RemoveUnusedNodesPass()(ir_model)
    model = ir.serde.serialize_model(ir_model)
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise fail("PREPOST_BUILD_FAILED", f"the built graph does not check: {exc}") from exc
    return model


def save(model: ir.Model, path: Path) -> None:
    save_model(model, path)
