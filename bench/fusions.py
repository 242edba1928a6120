"""Micro-benchmark of the fusions issue 17 added: is each fused model at least as fast as the unfused one on CPU?

Run ``python -m bench.fusions [--width 256] [--seq 64 256] [--seconds 6] [--no-write]`` (needs the dev extra:
torch and transformers build the models, from configs, nothing downloaded).

Models (``tests/models/build_torchscript.py`` at ``--width``, 2 layers, 4 heads, TorchScript exporter, eager
attention), each one new fusion's showcase:

=========  =============================================================================================
t5enc      T5 encoder: relative position bias + mask as MultiHeadAttention's attention_bias, opset-17 RMS
           norms (then SkipSimplifiedLayerNormalization)
gpt2       GPT-2: tanh GELU with its bias -> FastGelu, causal MultiHeadAttention
llama      Llama: opset-17 RMS norms, causal MultiHeadAttention with rotary embeddings left as exported
bartenc    BART encoder: MultiHeadAttention, BiasGelu (erf), Skip-LayerNorm
=========  =============================================================================================

Three graphs per model, each timed at ORT's default level (``ORT_ENABLE_ALL``, what users run), batch 1, one
intra-op thread: ``unfused`` (the export), ``fused`` (``fuse_transformer``, onnxscript engine) and
``fused_cpu`` (then ``unfuse_skip_layernorm``, what the ``fast`` preset runs on CPU). Sessions live in one
process; runs are interleaved in blocks whose order rotates each block; medians over blocks. Outputs are
checked equal within 1e-3 first.

A second table is the RMS-norm residual block ``[1, S, H]``: ``SkipSimplifiedLayerNormalization`` against
``Add`` + the RMS norm in standard ops (which ORT's session fuses into ``SimplifiedLayerNormalization``) and
``Sum`` + the same, the measurement behind ``unfuse_skip_layernorm``'s RMS rewrite. Both tables go into
bench/README.md between the ``fusions-table`` markers (``--no-write`` to skip).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402
import onnx_ir as ir  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from bench._report import machine_line, write_blocks  # noqa: E402
from passes._infra import PassContext  # noqa: E402
from passes.fusion.fuse_transformer import FuseTransformer  # noqa: E402
from passes.fusion.unfuse_skip_layernorm import UnfuseSkipLayerNorm  # noqa: E402
from workers.benchmark import host_info  # noqa: E402

START, END = "<!-- fusions-table:start -->", "<!-- fusions-table:end -->"
HEADING = "### Fusions of issue 17 on the CPU EP: `python -m bench.fusions`"
OUT = REPO / "bench" / "out" / "fusions"
ARCHS = ("t5enc", "gpt2", "llama", "bartenc")
GRAPHS = ("unfused", "fused", "fused_cpu")
RMS_FORMS = ("skip_simplified", "add_rms", "sum_rms")


def session(model: bytes, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def interleaved(sessions: dict[str, Any], feeds: dict[str, np.ndarray], seconds: float, inner: int) -> tuple:
    """Median microseconds per run of each session, timed in rotating blocks; and the block count."""
    names = list(sessions)
    times: dict[str, list[float]] = {n: [] for n in names}
    deadline, block = time.monotonic() + seconds, 0
    while time.monotonic() < deadline or block < 6:
        for name in names[block % len(names) :] + names[: block % len(names)]:
            start = time.perf_counter()
            for _ in range(inner):
                sessions[name].run(None, feeds)
            times[name].append((time.perf_counter() - start) / inner * 1e6)
        block += 1
    return {n: float(np.median(v)) for n, v in times.items()}, block


def graphs(arch: str, width: int) -> tuple[dict[str, bytes], dict[str, int]]:
    from tests.models.build_torchscript import build

    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"ts_{arch}_eager_w{width}.onnx"
    if not path.exists():
        with tempfile.TemporaryDirectory() as tmp:
            built = build(arch, "eager", Path(tmp), width=width)
            built.replace(path)
    model = ir.load(path)
    fused = FuseTransformer({"engines": ["onnxscript"]})(model)
    cpu = UnfuseSkipLayerNorm()(ir.serde.deserialize_model(ir.serde.serialize_model(fused.model)), PassContext())
    return {
        "unfused": path.read_bytes(),
        "fused": ir.serde.serialize_model(fused.model).SerializeToString(),
        "fused_cpu": ir.serde.serialize_model(cpu.model).SerializeToString(),
    }, fused.counts


def measure_models(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tests.models.build_torchscript import inputs

    rows = []
    for arch in args.archs:
        models, counts = graphs(arch, args.width)
        sessions = {name: session(blob) for name, blob in models.items()}
        for seq in args.seq:
            ids, mask = inputs(1, seq, seed=seq)
            feeds = {"input_ids": ids, "attention_mask": np.ones_like(mask)}
            outs = {n: s.run(None, feeds)[0] for n, s in sessions.items()}
            for name in GRAPHS[1:]:
                np.testing.assert_allclose(outs[name], outs["unfused"], rtol=1e-3, atol=1e-3, err_msg=f"{arch} {name}")
            us, blocks = interleaved(sessions, feeds, args.seconds, args.inner)
            fused = {k[len("fused_") :]: v for k, v in counts.items() if k.startswith("fused_") and v}
            rows.append({"arch": arch, "seq": seq, "us": us, "blocks": blocks, "fused": fused})
            print(f"{arch} S={seq}: {us}", flush=True)
    return rows


def rms_block(form: str, hidden: int, seq: int) -> bytes:
    rng = np.random.default_rng(0)
    gamma = numpy_helper.from_array(rng.uniform(0.5, 1.5, hidden).astype(np.float32), "gamma")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    eps = numpy_helper.from_array(np.array(1e-6, np.float32), "eps")
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, seq, hidden]) for n in ("x", "skip")]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, hidden])
    if form == "skip_simplified":
        nodes = [
            helper.make_node(
                "SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["y"], domain="com.microsoft", epsilon=1e-6
            )
        ]
    else:
        nodes = [
            helper.make_node("Add" if form == "add_rms" else "Sum", ["x", "skip"], ["h"]),
            helper.make_node("Pow", ["h", "two"], ["square"]),
            helper.make_node("ReduceMean", ["square"], ["mean"], axes=[-1], keepdims=1),
            helper.make_node("Add", ["mean", "eps"], ["shifted"]),
            helper.make_node("Sqrt", ["shifted"], ["rms"]),
            helper.make_node("Div", ["h", "rms"], ["normed"]),
            helper.make_node("Mul", ["normed", "gamma"], ["y"]),
        ]
    graph = helper.make_graph(nodes, "rms", inputs, [output], [gamma, two, eps])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def measure_rms(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for hidden in args.rms_hidden:
        for seq in args.seq:
            sessions = {form: session(rms_block(form, hidden, seq)) for form in RMS_FORMS}
            rng = np.random.default_rng(1)
            feeds = {n: rng.standard_normal((1, seq, hidden), dtype=np.float32) for n in ("x", "skip")}
            outs = {f: s.run(None, feeds)[0] for f, s in sessions.items()}
            for form in RMS_FORMS[:-1]:
                np.testing.assert_allclose(outs[form], outs["sum_rms"], rtol=1e-4, atol=1e-4)
            us, blocks = interleaved(sessions, feeds, args.seconds / 2, args.inner * 2)
            rows.append({"hidden": hidden, "seq": seq, "us": us, "blocks": blocks})
            print(f"rms H={hidden} S={seq}: {us}", flush=True)
    return rows


def render(models: list[dict[str, Any]], rms: list[dict[str, Any]], command: str) -> str:
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        f"Command: `{command}`",
        "",
        machine_line(host_info(target="cpu", intra_op_threads=1), load=load),
        "",
        "| model | seq | fused ops | blocks | unfused us | fused us | fused + unfuse_skip_layernorm us | "
        "unfused / fused | unfused / fused (CPU) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in models:
        us = r["us"]
        ops = ", ".join(f"{k} {v}" for k, v in r["fused"].items())
        lines.append(
            f"| {r['arch']} | {r['seq']} | {ops} | {r['blocks']} | {us['unfused']:.0f} | {us['fused']:.0f} | "
            f"{us['fused_cpu']:.0f} | **{us['unfused'] / us['fused']:.2f}x** | "
            f"**{us['unfused'] / us['fused_cpu']:.2f}x** |"
        )
    lines += [
        "",
        "| hidden | seq | blocks | SkipSimplifiedLayerNormalization us | Add + RMS us | Sum + RMS us | "
        "Skip / Add + RMS |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rms:
        us = r["us"]
        lines.append(
            f"| {r['hidden']} | {r['seq']} | {r['blocks']} | {us['skip_simplified']:.1f} | {us['add_rms']:.1f} | "
            f"{us['sum_rms']:.1f} | **{us['skip_simplified'] / us['add_rms']:.2f}x** |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fusions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS))
    parser.add_argument("--width", type=int, default=256, help="hidden size of the models (4 heads, 2 layers)")
    parser.add_argument("--seq", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rms-hidden", type=int, nargs="+", default=[384, 768])
    parser.add_argument("--inner", type=int, default=5, help="runs of one graph per timed block")
    parser.add_argument("--seconds", type=float, default=6.0, help="timing budget per model and sequence")
    parser.add_argument("--no-write", action="store_true", help="do not write bench/README.md")
    args = parser.parse_args(argv)
    onnx.checker.check_model(rms_block("add_rms", 8, 2))  # the hand-built block is valid ONNX
    models = measure_models(args)
    rms = measure_rms(args)
    command = "python -m bench.fusions " + shlex.join(argv if argv is not None else sys.argv[1:])
    table = render(models, rms, command.strip())
    print(table)
    if not args.no_write:
        write_blocks({(START, END): table}, heading=HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
