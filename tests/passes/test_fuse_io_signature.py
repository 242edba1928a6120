"""fuse_transformer keeps the graph's declared inputs and outputs (issue 17).

On the TorchScript exports of ViT (and DeiT, Swin, CLIP vision: a fixed image size), the shape inference
inside fuse_transformer resolved the output's symbolic sequence and hidden axes to numbers
(``last_hidden_state: float[batch, 17, 32]`` where the upload declares symbols), and the pipeline's ledger
rolled the pass back as "made dynamic axes static". The committed exports come from tests/models/corpus.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from core.config import JobConfig
from core.settings import PipelineSettings
from passes import _io_signature as io_signature
from passes import registry
from passes._infra import PassContext, op_histogram
from passes.fusion.unfuse_skip_layernorm import UnfuseSkipLayerNorm
from tests.models.corpus import feeds
from tests.passes._util import MODELS, parse, session
from workers.artifacts import proto_dynamic_axes
from workers.pipeline import PipelineRequest, run_pipeline

CORPUS = MODELS / "corpus"
EXPORTS = ("vit_ts_eager", "vit_ts_sdpa")
LAYERS = 2
BATCHES = (1, 3, 5)  # the export's batch is 2
FUSION_PASSES = ("fuse_transformer", "unfuse_skip_layernorm")

pytestmark = pytest.mark.filterwarnings("ignore")


def io_declarations(proto: onnx.ModelProto) -> tuple[list[str], list[str]]:
    """The graph inputs (initializers excluded) and outputs as serialized: names, element types, dims."""
    graph = proto.graph
    initializers = {i.name for i in graph.initializer}

    def text(value: onnx.ValueInfoProto) -> str:
        return f"{value.name}: {value.type.SerializeToString().hex()}"

    return [text(v) for v in graph.input if v.name not in initializers], [text(v) for v in graph.output]


def lost_axes(expected: dict[str, set[int]], model: ir.Model) -> set[str]:
    now = proto_dynamic_axes(ir.serde.serialize_model(model))
    return {f"{key} axis {a}" for key, axes in expected.items() for a in axes - now.get(key, set())}


def run_fast_as_ledger(name: str) -> tuple[ir.Model, dict[str, ir.Model], dict[str, set[str]]]:
    """The fast preset's passes in order, each on the model the previous ones left, kept the way the
    pipeline's ledger keeps them: a pass that changed nothing, or froze an axis the upload declares
    dynamic, is discarded. Returns the model, each fusion pass's input and result, and the frozen axes."""
    upload = onnx.load(CORPUS / f"{name}.onnx")
    dynamic = proto_dynamic_axes(upload)
    model = ir.serde.deserialize_model(upload)
    ctx = PassContext(samples=[])
    seen: dict[str, ir.Model] = {}
    frozen: dict[str, set[str]] = {}
    for p in registry.build_passes(registry.PRESETS["fast"].specs):
        kept = ir.serde.serialize_model(model)  # in-place passes edit the model they are given
        result = p(model, ctx)
        lost = lost_axes(dynamic, result.model)
        if p.name in FUSION_PASSES:
            seen[f"{p.name}:in"], seen[p.name] = ir.serde.deserialize_model(kept), result.model
        if lost and result.modified:
            frozen[p.name] = lost
        model = result.model if result.modified and not lost else ir.serde.deserialize_model(kept)
    return model, seen, frozen


@pytest.mark.parametrize("name", EXPORTS)
def test_fast_preset_keeps_declared_io_and_fuses_when_vit_torchscript_export(name):
    upload = onnx.load(CORPUS / f"{name}.onnx")
    model, seen, frozen = run_fast_as_ledger(name)
    assert not set(frozen) & set(FUSION_PASSES), frozen
    for pass_name in FUSION_PASSES:  # each keeps exactly what it was given
        given = io_declarations(ir.serde.serialize_model(seen[f"{pass_name}:in"]))
        assert io_declarations(ir.serde.serialize_model(seen[pass_name])) == given, pass_name
    optimized = ir.serde.serialize_model(model)
    assert io_declarations(optimized) == io_declarations(upload)
    ops = op_histogram(model)
    assert ops["com.microsoft::Attention"] == LAYERS  # the fusion the rollback used to discard
    assert "Softmax" not in ops
    onnx.checker.check_model(optimized, full_check=True)
    reference, candidate = session(str(CORPUS / f"{name}.onnx")), session(model)
    for batch in BATCHES:
        feed = feeds("vit", "tiny", batch, 0, seed=batch)
        for want, got in zip(reference.run(None, feed), candidate.run(None, feed), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{name} at batch {batch}")


def test_pipeline_applies_fuse_transformer_when_vit_torchscript_export_declares_symbolic_output(tmp_path):
    settings = PipelineSettings(
        verify_shape_sets=2,
        benchmark_warmup=2,
        benchmark_min_runs=15,
        benchmark_max_seconds=0.2,
        ledger_runs=9,
        intra_op_threads=1,
    )
    source = CORPUS / "vit_ts_eager.onnx"
    result = run_pipeline(
        PipelineRequest(
            model_path=source,
            output_dir=tmp_path / "out",
            config=JobConfig.parse({"preset": "fast"}),
            settings=settings,
        )
    )
    record = next(r for r in result.report["passes"] if r["name"] == "fuse_transformer")
    # Kept or not is the benchmark's call on this machine; a frozen axis is no longer a reason.
    assert "dynamic axes static" not in (record["reason"] or ""), record["reason"]
    assert record["status"] in ("applied", "rolled_back"), record
    assert record["modified"] and record["counts"]["fused_attention"] == LAYERS
    written = onnx.load(str(result.model_path), load_external_data=False)
    assert io_declarations(written) == io_declarations(onnx.load(source))


SIGNATURE = """
<ir_version: 10, opset_import: ["" : 17]>
g (float[batch, seq, 4] x) => (float[batch, seq, 4] y) {
    y = Relu(x)
}
"""


def test_io_signature_restores_declared_symbols_when_inference_resolved_them():
    """y = Relu(x): inference wrote y as float[2, 7, 4]; the declaration goes back to float[batch, seq, 4]."""
    model = ir.serde.deserialize_model(parse(SIGNATURE))
    declared = io_signature.capture(model)
    model.graph.outputs[0].shape = ir.Shape([2, 7, 4])
    assert io_signature.restore(model, declared) == 1
    assert str(model.graph.outputs[0].shape) == "[batch,seq,4]"
    assert io_declarations(ir.serde.serialize_model(model)) == io_declarations(parse(SIGNATURE))


def test_io_signature_refuses_candidate_when_output_renamed_or_retyped():
    model = ir.serde.deserialize_model(parse(SIGNATURE))
    declared = io_signature.capture(model)
    model.graph.outputs[0].dtype = ir.DataType.FLOAT16
    with pytest.raises(io_signature.SignatureChanged, match="changed type"):
        io_signature.restore(model, declared)
    model.graph.outputs[0].dtype, model.graph.outputs[0].name = ir.DataType.FLOAT, "z"
    with pytest.raises(io_signature.SignatureChanged, match="outputs changed"):
        io_signature.restore(model, declared)


def test_unfuse_skip_layernorm_keeps_declared_output_when_it_replaces_the_output_producer():
    """y = SkipLayerNormalization(x, skip, gamma) is the graph output: the LayerNormalization that replaces
    it takes the name ``y`` and its declaration float[batch, seq, 4], symbols included."""
    text = """
    <ir_version: 10, opset_import: ["" : 17, "com.microsoft" : 1]>
    g (float[batch, seq, 4] x, float[batch, seq, 4] skip) => (float[batch, seq, 4] y) <float[4] gamma = {1, 2, 3, 4}> {
        y = com.microsoft.SkipLayerNormalization <epsilon: float = 1e-5> (x, skip, gamma)
    }
    """
    proto = parse(text, check=False)
    model = ir.serde.deserialize_model(proto)
    result = UnfuseSkipLayerNorm()(model, PassContext(target="cpu"))
    assert result.counts["skip_layernorms_unfused"] == 1
    assert "com.microsoft::SkipLayerNormalization" not in op_histogram(model)
    assert io_declarations(ir.serde.serialize_model(model)) == io_declarations(proto)
