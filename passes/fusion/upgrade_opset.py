"""upgrade_opset: a graph below opset 17 converted to opset 17, its decomposed LayerNorms fused back.

Exporters still default to opsets below 17 (Optimum's ``onnx`` export wrote 14 for years; ``torch.onnx.export``
users pin 11-16 for old runtimes). ONNX has no ``LayerNormalization`` there, so each norm is written out in
nine nodes (``_layer_norm_forms``), and the fusions downstream, written against the opset-17 exports, find no
norm to anchor on: the held-out probe (``bench/heldout_export_variants.py``) measured BERT and ViT at opset 14
with 0/4 residual norms fused and BERT's fused candidate slower than its upload (the decomposed norm read as an
RMS norm, family "t5"); a Llama export failed in ``fuse_transformer`` on a ``Shape(start=...)`` the rotary
fusion writes, an attribute ONNX gained at 15.

The pass converts the default domain to opset 17 with ``onnx.version_converter`` (ONNX's own adapters, each
exact: what changes is how an op spells its operands) and fuses the written-out norms with ``_layer_norm_forms``;
later passes then see what an opset-17 export gives. Below opset 13 the converter writes each Softmax whose rank
it cannot read as Flatten -> Softmax -> Reshape (the old flattening semantics); over the last axis, which is
every attention's, that is one Softmax(axis=-1), and so it is written (``_last_axis_softmaxes``): at opset 11
no attention fused in BERT, ViT, Llama or Whisper's encoder before, all of them after. A graph at 17 or
above, one with functions or another
domain's ops the converter cannot carry, or one the converter refuses is left as it is, with the reason.
"""

from __future__ import annotations

import onnx
import onnx.version_converter
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.optimizer import basic_constant_propagation

from passes import _io_signature as io_signature
from passes._infra import NonMatch, Pass, PassContext, PassOptions, PassResult
from passes.fusion import _layer_norm_forms

TARGET = 17
_ONNX = ("", "ai.onnx")


class UpgradeOpsetOptions(PassOptions):
    """The pass has no options; the model exists so unknown keys are refused like for every pass."""


def _declined(model: ir.Model, reason: str) -> PassResult:
    return PassResult(model, False, {}, [NonMatch(reason)], {"decision": reason})


class UpgradeOpset(Pass[UpgradeOpsetOptions]):
    name = "upgrade_opset"
    summary = (
        "Below opset 17: convert the graph to opset 17, fuse the LayerNorms the exporter wrote out and write "
        "last-axis Softmax unflattened."
    )
    exact = True  # the converter's adapters are exact; LayerNormalization sums in another order
    in_place = True  # the converted graph takes the place of the model's own (metadata and functions stay)

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
        if opset is None or opset >= TARGET:
            return _declined(model, f"opset {opset}: nothing to upgrade (LayerNormalization exists from {TARGET})")
        if len(model.functions):
            return _declined(model, "the model has functions, which onnx.version_converter does not convert")
        foreign = sorted({n.domain for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.domain not in _ONNX})
        if foreign:
            return _declined(model, f"ops of other domains ({', '.join(foreign)}): their opset-{opset} meaning is kept")
        proto = ir.serde.serialize_model(model)
        try:
            converted = onnx.version_converter.convert_version(proto, TARGET)
        except Exception as exc:  # the converter names the op it has no adapter for
            return _declined(model, f"onnx.version_converter refused opset {opset} -> {TARGET}: {exc}"[:400])
        upgraded = ir.serde.deserialize_model(converted)
        declared = io_signature.capture(model)
        common_passes.ShapeInferencePass()(upgraded)
        basic_constant_propagation(upgraded.graph)  # Constant nodes' values, for the patterns' scalar checks
        norms = _layer_norm_forms.rules.apply_to_model(upgraded)
        softmaxes = _last_axis_softmaxes(upgraded.graph)
        io_signature.restore(upgraded, declared)  # inference may have resolved a declared symbol to a number
        model.graph = upgraded.graph
        model.ir_version = max(model.ir_version, upgraded.ir_version)
        counts = {"opset_from": opset, "opset_to": TARGET, "layer_norms_fused": norms, "softmax_unflattened": softmaxes}
        return PassResult(model, True, counts, [], {"decision": f"opset {opset} -> {TARGET}"})


_NORMALIZERS = frozenset({"Softmax", "LogSoftmax", "Hardmax"})


def _last_axis_softmaxes(graph: ir.Graph) -> int:
    """Undo the converter's opset-13 adapter where it is not needed: before 13, Softmax (LogSoftmax, Hardmax)
    normalizes over the input flattened from ``axis`` on, so the adapter writes ``Reshape(Softmax(Flatten(x,
    axis=a), axis=-1), Shape(x))``. Where ``a`` is the last axis, that is ``Softmax(x, axis=-1)`` at 13 (the
    exporters' attention at opset 11 and 12), the form the attention fusions read; other axes stay flattened."""
    done = 0
    for node in list(graph):
        if node.op_type not in _NORMALIZERS or node.domain not in _ONNX or node.attributes.get_int("axis", -1) != -1:
            continue
        flatten = node.inputs[0].producer() if node.inputs[0] is not None else None
        readers = list(node.outputs[0].uses())
        if flatten is None or flatten.op_type != "Flatten" or len(readers) != 1 or node.outputs[0].is_graph_output():
            continue
        x, reshape = flatten.inputs[0], readers[0].node
        if x is None or x.shape is None or flatten.attributes.get_int("axis", 1) not in (len(x.shape) - 1, -1):
            continue
        shape = reshape.inputs[1].producer() if reshape.op_type == "Reshape" and len(reshape.inputs) > 1 else None
        if shape is None or shape.op_type != "Shape" or shape.inputs[0] is not x or len(shape.attributes):
            continue
        direct = ir.node(node.op_type, [x], attributes={"axis": -1}, name=node.name)
        graph.insert_before(node, direct)
        out = reshape.outputs[0]
        direct.outputs[0].shape, direct.outputs[0].type = out.shape or x.shape, out.type or x.type
        if out.is_graph_output():
            name, out.name = out.name, None
            direct.outputs[0].name = name
            graph.outputs[graph.outputs.index(out)] = direct.outputs[0]
        out.replace_all_uses_with(direct.outputs[0])
        for dead in (reshape, node, shape, flatten):  # readers first; the Shape and Flatten may have others
            if not any(o.uses() or o.is_graph_output() for o in dead.outputs):
                graph.remove(dead, safe=True)
        done += 1
    return done
