"""Graph inputs that are initializers become plain initializers, so that ORT treats the weights as constants.

``torch.onnx.export(keep_initializers_as_inputs=True)``, exports from older toolchains and models converted
up from IR version 3 (which required it) list every weight among the graph inputs as well. Since IR version 4
such an input is a default a caller may override, so ONNX Runtime must not fold it: it keeps each
``BatchNormalization`` after its ``Conv``, each ``Relu`` apart and every shape computation on a weight at run
time, and warns that the initializer "will not be treated as constant value/weight" (ORT ships
``onnxruntime/tools/python/remove_initializer_from_input.py`` for this). Measured on a Conv-BN-ReLU stack
(opset 17, IR 8): ORT's optimized graph is ``Conv, BatchNormalization, Relu`` x 2 with the weights listed,
``Conv`` (BN and ReLU folded in) x 2 without.

Drawn (the weights stay initializers; only the input list changes)::

    inputs: x, w, scale, bias, mean, var  -->  inputs: x
    x --> Conv(w) --> BatchNormalization(scale, bias, mean, var) --> Relu     (unchanged; ORT now folds it)

The pass removes those entries from the main graph's inputs; the initializers stay. Below IR version 4 (which
requires the listing, and where ORT reads them as constants) it also raises the IR version to 4: upgrade_opset
raises it anyway, and ORT would then stop folding the weights still listed. A model
whose callers do feed a weight at run time (swapping it without re-exporting) loses that input, so the pass is
in the presets' clean-up and the report names every input it removed.
"""

from __future__ import annotations

import onnx_ir as ir

from passes._infra import Pass, PassContext, PassOptions, PassResult

# The IR version from which an initializer need not be a graph input (and one that is, is overridable).
_OVERRIDABLE_FROM = 4


class InitializerInputsOptions(PassOptions):
    """The pass has no options; the model exists so unknown keys are refused like for every pass."""


class InitializerInputs(Pass[InitializerInputsOptions]):
    name = "initializer_inputs"
    summary = (
        "Remove initializers from the graph inputs (keep_initializers_as_inputs exports): ORT folds weights it "
        "may treat as constants (Conv+BatchNorm), not overridable inputs."
    )
    exact = True
    in_place = True

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        graph = model.graph
        listed = [v for v in graph.inputs if v.name in graph.initializers]
        if not listed:
            return PassResult(model, modified=False, counts={"initializer_inputs_removed": 0})
        notes = {}
        if model.ir_version < _OVERRIDABLE_FROM:
            # The format lets the listing go from IR 4 on; a later upgrade_opset raises the version anyway, which
            # would turn the weights still listed into overridable inputs that ORT no longer folds.
            notes["ir_version"] = f"{model.ir_version} -> {_OVERRIDABLE_FROM} (the first that lets the listing go)"
            model.ir_version = _OVERRIDABLE_FROM
        for value in listed:
            graph.inputs.remove(value)
        more = f" and {len(listed) - 5} more" if len(listed) > 5 else ""
        notes["removed_inputs"] = (
            f"{len(listed)} graph inputs that were initializers: " + ", ".join(repr(v.name) for v in listed[:5]) + more
        )
        return PassResult(model, modified=True, counts={"initializer_inputs_removed": len(listed)}, notes=notes)
