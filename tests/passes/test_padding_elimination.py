"""padding_elimination: structure and ORT numerics on small BERT-like encoders, gating, and the refusals."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from core.errors import InvalidPassOptionsError
from passes._infra import PassContext
from passes.compute_order.padding_elimination import PaddingElimination
from tests.passes._bert_like import build_bert, make_inputs

PREFIX = "padding_elimination/"
# (lengths per row, seq): a row with one valid token, a batch without padding, batch 1 and 3, seq 8 and 16.
SHAPES = [([3, 8, 1], 8), ([16], 16), ([5, 16, 2], 16), ([8, 8, 8], 8), ([1], 8), ([11, 7, 16], 16)]


def run_pass(model: onnx.ModelProto, samples=None, **options):
    ir_model = ir.serde.deserialize_model(model)
    result = PaddingElimination(options)(ir_model, PassContext(samples=samples or []))
    optimized = ir.serde.serialize_model(result.model)
    onnx.checker.check_model(optimized, full_check=True)
    return result, optimized, ir_model


def session(model: onnx.ModelProto, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def assert_equal_on_valid(original, optimized, notes, feeds_list, *, atol=1e-5, level=None) -> None:
    """Every output equal, except at the pad positions of the outputs listed in notes['valid_positions']."""
    kwargs = {} if level is None else {"level": level}
    reference, candidate = session(original), session(optimized, **kwargs)
    names = [o.name for o in reference.get_outputs()]
    assert names == [o.name for o in candidate.get_outputs()]
    for feeds in feeds_list:
        for name, want, got in zip(names, reference.run(None, feeds), candidate.run(None, feeds), strict=True):
            assert want.shape == got.shape, name
            where = notes["valid_positions"].get(name)
            valid = np.ones(want.shape, bool) if where is None else feeds[where["mask_input"]] != 0
            np.testing.assert_allclose(got[valid], want[valid], atol=atol, rtol=1e-5, err_msg=name)


def feeds_for(shapes=SHAPES, seed=1, **kwargs) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [make_inputs(rng, lengths, seq, **kwargs) for lengths, seq in shapes]


def roundtrip(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model as the IR serializes it untouched (it adds value_info for initializers)."""
    return ir.serde.serialize_model(ir.serde.deserialize_model(model))


def producer_ops(model: ir.Model, op_type: str) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == op_type and not (n.name or "").startswith(PREFIX)]


def unpadded(value: ir.Value | None) -> bool:
    """Whether the value runs on the valid tokens: its first dim is the pass's symbolic token count."""
    return value is not None and value.shape is not None and str(value.shape[0]) == f"{PREFIX}valid_tokens"


# ------------------------------------------------------------------------------------------- structure


def test_padding_elimination_unpads_projections_ffn_and_layernorm_when_bert_encoder():
    """Q/K/V, the output projection and the FFN run on [K, H]; attention stays padded."""
    model = build_bert()
    result, _, ir_model = run_pass(model, force=True)
    assert result.modified
    assert result.counts == {"ops_unpadded": 48, "boundaries": 7}
    matmuls = producer_ops(ir_model, "MatMul")
    # per layer: Q, K, V, output projection, two FFN MatMuls unpadded; scores and probs@V padded
    assert sum(unpadded(m.outputs[0]) for m in matmuls) == 12
    assert sum(not unpadded(m.outputs[0]) for m in matmuls) == 4
    assert all(unpadded(n.outputs[0]) for n in producer_ops(ir_model, "LayerNormalization"))
    # one PadAndUnflatten (ScatterND -> Reshape) before each head split, one for the output
    scatters = [n for n in ir_model.graph if n.op_type == "ScatterND"]
    assert len(scatters) == 7
    for split in [n for n in producer_ops(ir_model, "Reshape") if n.name.startswith("split")]:
        pad = split.inputs[0].producer()
        assert pad.name.startswith(f"{PREFIX}pad") and pad.inputs[0].producer().op_type == "ScatterND"
    # the output keeps its name and is re-padded to [batch, seq, hidden]
    (out,) = ir_model.graph.outputs
    assert out.name == "last_hidden_state" and out.producer().op_type == "Reshape"
    assert result.notes["valid_positions"] == {"last_hidden_state": {"mask_input": "attention_mask", "axes": [0, 1]}}


def test_padding_elimination_unpads_output_projection_at_the_head_merge_when_residual_reads_it():
    """The unpad moves above MatMul(Wo)+Add(bo) to the head-merge output, so the projection runs unpadded."""
    _, _, ir_model = run_pass(build_bert(layers=1), force=True)
    merge = next(n for n in ir_model.graph if (n.name or "").startswith("merge"))
    (use,) = merge.outputs[0].uses()  # read by the unpad only: no Expand of an already [B,S,H] tensor
    flatten = use.node
    assert flatten.op_type == "Reshape" and flatten.name.startswith(f"{PREFIX}flatten")
    gather = flatten.outputs[0].uses()[0].node
    assert gather.op_type == "Gather"
    projection = gather.outputs[0].uses()[0].node
    assert projection.op_type == "MatMul" and unpadded(projection.outputs[0])


def test_padding_elimination_gathers_token_type_rows_when_embedding_sum():
    """token_type embeddings are looked up for the valid ids only (the unpad moves onto the ids)."""
    _, _, ir_model = run_pass(build_bert(layers=1), force=True)
    types = next(n for n in ir_model.graph if (n.name or "").startswith("types"))
    assert unpadded(types.outputs[0])
    assert types.inputs[1].producer().name.startswith(f"{PREFIX}unpad")


# -------------------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"gelu": "onnx", "opset": 20, "decomposed_ln": True, "mask_form": "finfo"},
        {"gelu": "ms", "decomposed_ln": True},
        {"mask_dtype": TensorProto.FLOAT, "opset": 18, "decomposed_ln": True},
        {"mask_form": "where4d", "pooling": "cls"},
    ],
    ids=["erf-gelu-1e4", "onnx-gelu-decomposed-ln-finfo", "ms-gelu", "float-mask-opset18", "where-4d-mask"],
)
def test_padding_elimination_matches_ort_on_valid_positions_when_right_padded(variant):
    model = build_bert(**variant)
    result, optimized, _ = run_pass(model, force=True)
    assert result.modified, result.non_matches
    mask_dtype = np.float32 if variant.get("mask_dtype") == TensorProto.FLOAT else np.int64
    assert_equal_on_valid(model, optimized, result.notes, feeds_for(mask_dtype=mask_dtype))


def test_padding_elimination_matches_ort_when_full_graph_optimizations():
    """ORT's own fusions (ENABLE_ALL) accept the rewritten graph and agree on valid positions."""
    model = build_bert()
    result, optimized, _ = run_pass(model, force=True)
    assert_equal_on_valid(
        model, optimized, result.notes, feeds_for(), atol=1e-4, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    )


def test_padding_elimination_is_exact_everywhere_when_masked_mean_pooling():
    """sum(h * mask) / sum(mask) reads pad positions only through the mask: pooled is compared in full."""
    model = build_bert(pooling="masked_mean")
    result, optimized, _ = run_pass(model, force=True)
    assert result.modified, result.non_matches
    assert set(result.notes["valid_positions"]) == {"last_hidden_state"}
    assert_equal_on_valid(model, optimized, result.notes, feeds_for())


def test_padding_elimination_keeps_cls_exact_when_left_padded():
    """h[:, 0] is exact even when position 0 is padding: position 0 of every row is always kept."""
    model = build_bert(pooling="cls")
    result, optimized, _ = run_pass(model, force=True)
    assert result.modified, result.non_matches
    assert set(result.notes["valid_positions"]) == {"last_hidden_state"}
    assert_equal_on_valid(model, optimized, result.notes, feeds_for() + feeds_for(left=True, seed=2))


def test_padding_elimination_uses_ids_when_pad_token_id_given():
    """Validity from ids != pad; the model's own mask (named by mask_input) still counts as masking."""
    model = build_bert(mask_name="segment_valid")
    samples = feeds_for([([2, 2], 8)], mask_name="segment_valid")
    samples[0]["segment_valid"][:] = 1  # the density is measured on the ids, not on this mask
    result, optimized, _ = run_pass(model, samples, pad_token_id=0, mask_input="segment_valid")
    assert result.modified, result.non_matches
    assert result.notes["token_density"] == pytest.approx(0.25)
    assert result.notes["valid_positions"]["last_hidden_state"]["mask_input"] == "segment_valid"
    assert_equal_on_valid(model, optimized, result.notes, feeds_for(mask_name="segment_valid"))


def test_padding_elimination_uses_named_mask_when_mask_input_given():
    model = build_bert(mask_name="segment_valid")
    result, optimized, _ = run_pass(model, force=True, mask_input="segment_valid")
    assert result.modified, result.non_matches
    assert_equal_on_valid(model, optimized, result.notes, feeds_for(mask_name="segment_valid"))


def test_padding_elimination_runs_when_every_token_is_padding():
    """An all-padding batch: position 0 is kept, so no op sees an empty tensor; output shapes match."""
    model = build_bert()
    _, optimized, _ = run_pass(model, force=True)
    feeds = make_inputs(np.random.default_rng(0), [0, 0], 8)
    (got,) = session(optimized).run(None, feeds)
    assert got.shape == (2, 8, 16) and np.isfinite(got).all()


def test_padding_elimination_fills_shapes_when_value_info_missing():
    model = build_bert(layers=1)
    del model.graph.value_info[:]
    result, optimized, _ = run_pass(model, force=True)
    assert result.modified, result.non_matches
    assert "shape_inference" in result.notes
    assert_equal_on_valid(model, optimized, result.notes, feeds_for(SHAPES[:2]))


# ---------------------------------------------------------------------------------------------- gating


def test_padding_elimination_applies_when_token_density_below_threshold():
    samples = feeds_for([([4, 4], 8)])  # 50% valid
    result, _, _ = run_pass(build_bert(layers=1), samples=samples)
    assert result.modified
    assert result.notes["token_density"] == pytest.approx(0.5)
    assert result.notes["decision"] == "applied"


def test_padding_elimination_skips_when_no_padding_in_samples():
    model = build_bert(layers=1)
    result, optimized, _ = run_pass(model, samples=feeds_for([([8, 8], 8)]))
    assert not result.modified
    assert result.notes["token_density"] == 1.0 and result.notes["decision"] == "skipped"
    assert "threshold" in result.non_matches[0].reason
    assert optimized.graph == roundtrip(model).graph


def test_padding_elimination_skips_when_no_samples_and_not_forced():
    result, _, _ = run_pass(build_bert(layers=1))
    assert not result.modified
    assert "no samples" in result.non_matches[0].reason


def test_padding_elimination_rejects_unknown_option():
    with pytest.raises(InvalidPassOptionsError):
        PaddingElimination({"pad_id": 0})


# --------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"pooling": "mean"}, "unmasked mean pooling"),
        ({"pooling": "token1"}, "Gather on a token axis at a position that may be padding"),
        ({"mask_form": "none"}, "Softmax over the sequence axis reads pad positions"),
    ],
    ids=["unmasked-mean-pooling", "gather-position-1", "unmasked-attention"],
)
def test_padding_elimination_refuses_when_a_reader_sees_pad_positions(kwargs, reason):
    model = build_bert(**kwargs)
    result, optimized, _ = run_pass(model, force=True)
    assert not result.modified
    (non_match,) = result.non_matches
    assert reason in non_match.reason and non_match.node
    assert optimized.graph == roundtrip(model).graph


def test_padding_elimination_refuses_when_no_validity_source():
    model = build_bert(mask_name="segment_valid")
    result, optimized, _ = run_pass(model, force=True)
    assert not result.modified
    assert "no validity source" in result.non_matches[0].reason
    assert optimized.graph == roundtrip(model).graph


def test_padding_elimination_refuses_when_no_embedding_gather():
    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["y"], to=TensorProto.FLOAT)],
        "no_embedding",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    result, _, _ = run_pass(model, force=True)
    assert not result.modified
    assert "no word-embedding Gather" in result.non_matches[0].reason
