"""Small helpers the pass tests share: build a model from ONNX text, run a pass on a copy of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort

from passes._infra import Pass, PassContext, PassResult, op_histogram
from tests.models.build_hf import make_inputs

MODELS = Path(__file__).resolve().parent.parent / "models"
MLP_CLEANUP = MODELS / "mlp_cleanup.onnx"
# (batch, sequence, share of padding) for the tiny HF exports: right-padded masks, as tokenizers produce them
HF_SHAPES = ((1, 5, 0.0), (3, 7, 0.3), (2, 17, 0.5), (4, 24, 0.25))


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


def session(model: ir.Model | str | Path, optimized: bool = False) -> ort.InferenceSession:
    """A CPU session with every graph optimization off: the reference every rewrite is compared with; with
    ``optimized``, at ORT's default level (a fused candidate as a user's session runs it)."""
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    source = str(model) if isinstance(model, str | Path) else ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def assert_same_outputs(name: str, optimized: ir.Model, atol: float = 1e-4) -> None:
    """The tiny HF export ``hf_<name>.onnx`` and ``optimized`` give the same outputs at 1e-4 on padded batches
    of several shapes (``HF_SHAPES``)."""
    reference, candidate = session(str(MODELS / f"hf_{name}.onnx")), session(optimized)
    inputs = {i.name for i in reference.get_inputs()}
    for batch, seq, pad in HF_SHAPES:
        feeds = {k: v for k, v in make_inputs(name, batch, seq, pad_fraction=pad, size="tiny").items() if k in inputs}
        for ref, got in zip(reference.run(None, feeds), candidate.run(None, feeds), strict=True):
            assert ref.shape == got.shape
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=atol, err_msg=f"{name} at {batch}x{seq}")
