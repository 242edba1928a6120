"""bench.decoder_variants (a packed gate/up split back into two projections, as the builder has it) and
bench.step_ab's per-op table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench.decoder_variants import split_gate_up
from bench.step_ab import Call, op_table


def _gated(kind: str, scales_flat: bool = True) -> onnx.ModelProto:
    """x[1, S, 64] -> packed projection [.., 16] -> Split 8/8 -> gate * up: the shape of a packed gated MLP."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array([8, 8], np.int64), "sizes")]
    if kind == "MatMul":
        inits.append(numpy_helper.from_array(rng.standard_normal((64, 16)).astype(np.float32), "w"))
        proj = helper.make_node("MatMul", ["x", "w"], ["packed"], "proj")
    else:  # 4-bit, two blocks of 32 per row (flat scales interleave them); random bytes are valid codes
        inits.append(numpy_helper.from_array(rng.integers(0, 256, (16, 2, 16), dtype=np.uint8), "w_q4"))
        scales = rng.uniform(0.01, 0.1, 32 if scales_flat else (16, 2)).astype(np.float32)
        inits.append(numpy_helper.from_array(scales, "w_scales"))
        proj = helper.make_node(
            "MatMulNBits", ["x", "w_q4", "w_scales"], ["packed"], "proj", domain="com.microsoft",
            K=64, N=16, bits=4, block_size=32,
        )  # fmt: skip
    nodes = [
        proj,
        helper.make_node("Split", ["packed", "sizes"], ["gate", "up"], "split", axis=-1),
        helper.make_node("Mul", ["gate", "up"], ["y"], "mul"),
    ]
    graph = helper.make_graph(
        nodes,
        "gated",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "S", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "S", 8])],
        inits,
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize(("kind", "flat"), [("MatMul", True), ("MatMulNBits", True), ("MatMulNBits", False)])
def test_split_gate_up_is_exact_and_removes_the_split(tmp_path: Path, kind: str, flat: bool) -> None:
    src = tmp_path / "packed.onnx"
    onnx.save(_gated(kind, flat), str(src))
    dst = tmp_path / "split" / "model.onnx"
    assert split_gate_up(src, dst) == 1
    graph = onnx.load(str(dst)).graph
    assert [n.op_type for n in graph.node] == [kind, kind, "Mul"]
    if kind == "MatMulNBits":
        assert [a.i for n in graph.node[:2] for a in n.attribute if a.name == "N"] == [8, 8]
    for seq in (1, 5):
        x = np.random.default_rng(seq).standard_normal((1, seq, 64)).astype(np.float32)
        np.testing.assert_array_equal(_run(dst, x), _run(src, x))


def test_split_gate_up_leaves_unequal_splits(tmp_path: Path) -> None:
    model = _gated("MatMul")
    for init in model.graph.initializer:
        if init.name == "sizes":
            init.CopyFrom(numpy_helper.from_array(np.array([6, 10], np.int64), "sizes"))
    model.graph.node[2].op_type = "Add"  # [.., 6] + [.., 10] would not broadcast: only the split is checked
    src = tmp_path / "packed.onnx"
    onnx.save(model, str(src))
    assert split_gate_up(src, tmp_path / "out" / "model.onnx") == 0
    # ``unpacked`` (every=True) splits any packed projection, by its Split's own sizes.
    assert split_gate_up(src, tmp_path / "every" / "model.onnx", every=True) == 1
    every = onnx.load(str(tmp_path / "every" / "model.onnx")).graph
    assert [n.op_type for n in every.node] == ["MatMul", "MatMul", "Add"]
    assert sorted(tuple(i.dims) for i in every.initializer) == [(64, 6), (64, 10)]


def test_op_table_shares_and_missing_ops() -> None:
    tables = [(1000.0, {"MatMul": (800.0, 17), "Slice": (100.0, 8)}), (900.0, {"MatMul": (850.0, 21)})]
    text = op_table(["a/ours/model.onnx", "b/builder/model.onnx"], tables, Call(1, 128, 1, 1, 1), "1.00")
    lines = text.splitlines()
    assert lines[0].startswith("| op (1 thread(s), 1 token(s) after 128; load 1.00) | ours | builder |")
    assert lines[2] == "| MatMul | 0.800 ms x17 (80.0%) | 0.850 ms x21 (94.4%) |"
    assert lines[3] == "| Slice | 0.100 ms x8 (10.0%) | - |"
    assert lines[-1] == "| kernel total | 1.000 ms | 0.900 ms |"


def _windowed(window: int) -> onnx.ModelProto:
    """One GroupQueryAttention layer (1 head of 8, sliding window) whose presents are cropped to the last
    ``window - 1`` positions into the graph outputs, as a Mistral export's are after fuse_gqa."""
    f, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    inits = [
        numpy_helper.from_array(np.array([-(window - 1)], np.int64), "start"),
        numpy_helper.from_array(np.array([2**63 - 1], np.int64), "end"),
        numpy_helper.from_array(np.array([2], np.int64), "axis"),
        numpy_helper.from_array(np.array([1], np.int64), "one_axis"),
        numpy_helper.from_array(np.array(1, np.int32), "one"),
    ]
    nodes = [
        helper.make_node("Cast", ["mask"], ["mask32"], to=i32),
        helper.make_node("ReduceSum", ["mask32", "one_axis"], ["summed"], keepdims=0),
        helper.make_node("Sub", ["summed", "one"], ["seqlens_k"]),
        helper.make_node("Shape", ["mask"], ["mask_shape"], start=1, end=2),
        helper.make_node("Squeeze", ["mask_shape"], ["length"]),
        helper.make_node("Cast", ["length"], ["total"], to=i32),
        helper.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total"],
            ["out", "gqa_key", "gqa_value"],
            domain="com.microsoft",
            num_heads=1,
            kv_num_heads=1,
            local_window_size=window - 1,
        ),
        helper.make_node("Slice", ["gqa_key", "start", "end", "axis"], ["present_key"]),
        helper.make_node("Slice", ["gqa_value", "start", "end", "axis"], ["present_value"]),
    ]
    inputs = [helper.make_tensor_value_info(n, f, [1, "S", 8]) for n in ("q", "k", "v")]
    inputs += [helper.make_tensor_value_info(n, f, [1, 1, "P", 8]) for n in ("past_key", "past_value")]
    inputs.append(helper.make_tensor_value_info("mask", i64, [1, "T"]))
    outputs = [helper.make_tensor_value_info("out", f, [1, "S", 8])]
    outputs += [helper.make_tensor_value_info(n, f, [1, 1, None, 8]) for n in ("present_key", "present_value")]
    graph = helper.make_graph(nodes, "windowed", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _feeds(seq: int, past: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seq * 100 + past)
    feeds = {n: rng.standard_normal((1, seq, 8)).astype(np.float32) for n in ("q", "k", "v")}
    feeds |= {n: rng.standard_normal((1, 1, past, 8)).astype(np.float32) for n in ("past_key", "past_value")}
    feeds["mask"] = np.ones((1, past + seq), np.int64)
    return feeds


def test_present_crop_variants(tmp_path: Path) -> None:
    from bench.decoder_variants import conditional_crops, drop_present_crops

    src = tmp_path / "windowed.onnx"
    onnx.save(_windowed(8), str(src))
    assert drop_present_crops(src, tmp_path / "none" / "model.onnx") == 2
    assert conditional_crops(src, tmp_path / "if" / "model.onnx") == 2
    ops = [n.op_type for n in onnx.load(str(tmp_path / "if" / "model.onnx")).graph.node]
    assert "Slice" not in ops and ops.count("If") == 1
    sessions = {
        name: ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for name, path in (("src", src), ("none", tmp_path / "none/model.onnx"), ("if", tmp_path / "if/model.onnx"))
    }
    # Below the window, across its edge (the crop cuts), and a prompt after a past: the If is exact everywhere;
    # dropping the crop is exact only while the present fits the window.
    for seq, past in ((5, 0), (1, 3), (1, 6), (1, 7), (1, 9), (3, 5)):
        feeds = _feeds(seq, past)
        want = sessions["src"].run(None, feeds)
        for got, expected in zip(sessions["if"].run(None, feeds), want, strict=True):
            np.testing.assert_array_equal(got, expected)
        fits = past + seq <= 7
        dropped = sessions["none"].run(None, feeds)
        assert (dropped[1].shape == want[1].shape) == fits
        assert want[1].shape[2] == min(past + seq, 7)


def test_step_ab_feeds_token_ids_below_every_compared_models_vocabulary_when_the_table_is_small() -> None:
    """The A/B's token ids come from the models' own embedding tables: a test decoder's 256-row table ran out of
    range under the fixed 1000 it drew from before (ORT's Gather refuses such an index)."""
    from bench.step_ab import feeds_for, session, vocabulary

    path = str(Path(__file__).parent / "models" / "decoders" / "llama_past_ts.onnx")
    vocab = vocabulary([path, path])
    assert vocab == 256
    sess = session(path, 1)
    for past, tokens in ((0, 7), (5, 1)):
        feeds = feeds_for(sess, past, tokens, vocab)
        assert feeds["input_ids"].max() < vocab and feeds["attention_mask"].shape == (1, past + tokens)
        logits = sess.run(None, feeds)[0]
        assert logits.shape == (1, tokens, vocab) and np.isfinite(logits).all()
