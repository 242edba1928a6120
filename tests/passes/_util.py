"""Small helpers the pass tests share: build a model from ONNX text, run a pass on a copy of it."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx.parser
import onnx_ir as ir

from passes._infra import Pass, PassContext, PassResult, op_histogram

MODELS = Path(__file__).resolve().parent.parent / "models"
MLP_CLEANUP = MODELS / "mlp_cleanup.onnx"


def parse(text: str, check: bool = True) -> onnx.ModelProto:
    """A ModelProto from ONNX text syntax (``[name] out = Op <attr=...> (in)``), checked by default."""
    model = onnx.parser.parse_model(text)
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def apply(pass_: Pass, model: onnx.ModelProto, ctx: PassContext | None = None) -> tuple[ir.Model, PassResult]:
    """Run the pass on an IR copy of ``model`` (the proto stays the reference) and check the result."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    ir_model = ir.serde.deserialize_model(copy)
    result = pass_(ir_model, ctx)
    assert result.model is ir_model  # every pass here is in place
    return ir_model, result


def ops(model: ir.Model) -> dict[str, int]:
    return dict(op_histogram(model))


def node_names(model: ir.Model) -> list[str | None]:
    return [node.name for node in ir.traversal.RecursiveGraphIterator(model.graph)]


def checked(model: ir.Model) -> onnx.ModelProto:
    """The IR model as a proto that passes the full ONNX checker (names unique, types consistent)."""
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)
    return proto
