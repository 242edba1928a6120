"""Shared fixtures of the worker tests: small models, fast pipeline settings, and TEST-ONLY passes.

The test passes below are deliberately good, wrong, slow, idle or broken; they exist to prove the ledger
catches each case. They are injected through ``PipelineRequest.pass_resolver``, never registered.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.config import EXACT_TOLERANCE, JobConfig
from core.settings import PipelineSettings
from passes._infra import NonMatch, Pass, PassContext, PassResult
from workers import benchmark
from workers.pipeline import ResolvedPasses

MODELS = Path(__file__).resolve().parents[1] / "models"
CHAIN = 200


class SyntheticClock:
    """``time.perf_counter`` for workers.benchmark, advanced only by the synthetic runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class SyntheticRuns:
    """A model's runs per input set for ``_time_sets``: ``centers[i]`` ms with a relative normal spread."""

    def __init__(self, centers: list[float], spread: float, seed: int) -> None:
        self.centers, self.spread = centers, spread
        self.rng = np.random.default_rng(seed)
        self.warmed: list[int] = []

    def warming(self, index: int, _warmup: int) -> bool:
        self.warmed.append(index)
        return False  # synthetic runs are warm from the first: no warm-up block

    def select(self, index: int) -> Callable[[], float]:
        return lambda: self.centers[index] * (1.0 + self.spread * float(self.rng.standard_normal()))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SyntheticClock:
    """workers.benchmark on a clock its synthetic runs advance by the milliseconds they return."""
    fake = SyntheticClock()
    monkeypatch.setattr(benchmark, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))

    def time_one(run: Callable[[], Any]) -> float:
        ms = float(run())
        fake.now += ms / 1000.0
        return ms

    monkeypatch.setattr(benchmark, "_time_one", time_one)
    return fake


# ----------------------------------------------------------------------------------------- test passes


def _relu_chain_after_first_relu(model: ir.Model, length: int) -> None:
    graph = model.graph
    relu = next(n for n in graph if n.op_type == "Relu")
    out = relu.outputs[0]
    users = list(out.uses())
    prev, nodes = out, []
    for i in range(length):
        node = ir.node("Relu", [prev], name=f"slow_relu_{i}", outputs=[ir.Value(name=f"slow_relu_{i}_out")])
        nodes.append(node)
        prev = node.outputs[0]
    graph.insert_after(relu, nodes)
    for use in users:
        use.node.replace_input_with(use.idx, prev)


class AddReluChain(Pass):
    """SLOW but exact: 200 Relu after a Relu (Relu is idempotent), each one a kernel launch."""

    name = "test_add_relu_chain"
    summary = "test only: makes the model slower"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        _relu_chain_after_first_relu(model, CHAIN)
        return PassResult(model, True, counts={"nodes_added": CHAIN})


class DropReluChain(Pass):
    """GOOD and exact: Relu(Relu(x)) -> Relu(x)."""

    name = "test_drop_relu_chain"
    summary = "test only: removes idempotent Relu chains"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        graph = model.graph
        outputs = set(graph.outputs)
        doomed, non_matches = [], []
        for node in graph:
            if node.op_type != "Relu":
                continue
            producer = node.inputs[0].producer() if node.inputs[0] is not None else None
            if producer is None or producer.op_type != "Relu":
                non_matches.append(NonMatch("input is not produced by a Relu", node.name, node.op_type))
            elif node.outputs[0] in outputs:
                non_matches.append(NonMatch("output is a graph output", node.name, node.op_type))
            else:
                doomed.append(node)
        for node in doomed:
            ir.convenience.replace_all_uses_with(node.outputs[0], node.inputs[0])
        for node in reversed(doomed):
            graph.remove(node, safe=True)
        return PassResult(model, bool(doomed), counts={"nodes_removed": len(doomed)}, non_matches=non_matches)


class OneUlp(Pass):
    """Within any tolerance, yet another program: the first element of the first float weight moves by one ulp
    (other bytes and, unlike a doc string, another graph under ORT's optimizations, so the gate times it)."""

    name = "test_one_ulp"
    summary = "test only: one weight one ulp up"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        for value in model.graph.initializers.values():
            array = value.const_value.numpy() if value.const_value is not None else None
            if array is not None and array.dtype == np.float32 and array.size:
                moved = array.copy()
                moved.flat[0] = np.nextafter(moved.flat[0], np.float32(np.inf))
                value.const_value = ir.tensor(moved, name=value.name)
                return PassResult(model, True, counts={"weights_moved": 1})
        return PassResult(model, False)


class FlipSign(Pass):
    """WRONG: negates the W2 initializer."""

    name = "test_flip_sign"
    summary = "test only: computes something else"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        value = model.graph.initializers["W2"]
        assert value.const_value is not None
        value.const_value = ir.tensor(-value.const_value.numpy(), name="W2")
        return PassResult(model, True, counts={"initializers_changed": 1})


class Idle(Pass):
    """Does nothing, and says why, naming a node (hostile names included: the report must escape them)."""

    name = "test_idle"
    summary = "test only: never matches"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        return PassResult(
            model,
            False,
            non_matches=[NonMatch("no Gelu pattern: Erf not found", "<script>alert(1)</script>", "Div")],
        )


class Crash(Pass):
    name = "test_crash"
    summary = "test only: raises"

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        raise RuntimeError("boom in the pass")


def resolver(*passes: Pass):
    """A pass_resolver returning the given passes with the exact tolerance (or the config's)."""

    def resolve(config: JobConfig, settings: PipelineSettings) -> ResolvedPasses:
        return ResolvedPasses(list(passes), "test", config.tolerance or EXACT_TOLERANCE)

    return resolve


# -------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def mlp_path() -> Path:
    return MODELS / "mlp_cleanup.onnx"


@pytest.fixture(scope="session")
def slow_mlp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mlp_cleanup with a 200-Relu chain in it: DropReluChain makes it clearly faster."""
    model = ir.serde.deserialize_model(onnx.load(str(MODELS / "mlp_cleanup.onnx")))
    _relu_chain_after_first_relu(model, CHAIN)
    directory = tmp_path_factory.mktemp("slow_mlp")
    path = directory / "slow_mlp.onnx"
    ir.save(model, path)
    onnx.checker.check_model(str(path))
    return path


@pytest.fixture
def fast_settings() -> PipelineSettings:
    return PipelineSettings(
        verify_shape_sets=2,
        benchmark_warmup=2,
        benchmark_min_runs=15,
        benchmark_max_seconds=0.2,
        ledger_runs=9,
        intra_op_threads=1,
    )


def make_bert_like(vocab: int = 50, hidden: int = 8) -> onnx.ModelProto:
    """input_ids -> Gather(embedding); attention_mask scales it; token_type_ids through a second table."""
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((vocab, hidden)).astype(np.float32)
    types = rng.standard_normal((2, hidden)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["word_embeddings", "input_ids"], ["emb"], name="embed"),
        helper.make_node("Gather", ["type_embeddings", "token_type_ids"], ["temb"], name="type_embed"),
        helper.make_node("Add", ["emb", "temb"], ["sum"], name="add_types"),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], name="cast_mask", to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "axis_last"], ["mask_3d"], name="unsqueeze_mask"),
        helper.make_node("Mul", ["sum", "mask_3d"], ["hidden"], name="apply_mask"),
    ]
    graph = helper.make_graph(
        nodes,
        "bert_like",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["batch", "sequence"]),
        ],
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "sequence", hidden])],
        initializer=[
            numpy_helper.from_array(emb, "word_embeddings"),
            numpy_helper.from_array(types, "type_embeddings"),
            numpy_helper.from_array(np.array([-1], np.int64), "axis_last"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model
