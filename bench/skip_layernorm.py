"""Benchmark of one residual block on ORT's CPU EP: why ``unfuse_skip_layernorm`` exists.

Run ``python -m bench.skip_layernorm [--hidden 384 768] [--threads 1 2] [--seconds 8] [--no-write]``.

Three one-block graphs on ``x, skip: float[1, S, H]`` (S=128 by default), each timed at ORT's default level
(``ORT_ENABLE_ALL``, what users run):

=====================  ==============================================================================
skip_layernorm         ``com.microsoft::SkipLayerNormalization(x, skip, gamma, beta)``: what ORT's own
                       ``SkipLayerNormFusion`` and onnxscript's fusions make of the pattern below
add_layernorm          ``LayerNormalization(Add(x, skip))`` as exported; ORT fuses it into the above, so
                       this row times the fused kernel too (the table shows the op ORT ran)
sum_layernorm          ``LayerNormalization(Sum(x, skip))``: unfuse_skip_layernorm's form, which ORT's
                       fusion does not match
=====================  ==============================================================================

The three sessions live in one process; runs are interleaved in blocks whose order rotates by one each block;
each block times ``--inner`` runs of each graph. Medians over blocks; the ratio is median(skip_layernorm) /
median(sum_layernorm). Outputs are checked equal within 1e-5. Written into bench/README.md between the
``skip-layernorm-table`` markers (``--no-write`` to skip).
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
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from bench._report import machine_line, write_blocks  # noqa: E402
from workers.benchmark import host_info  # noqa: E402

START, END = "<!-- skip-layernorm-table:start -->", "<!-- skip-layernorm-table:end -->"
HEADING = "### SkipLayerNormalization on the CPU EP: `python -m bench.skip_layernorm`"
FORMS = ("skip_layernorm", "add_layernorm", "sum_layernorm")


def block_model(form: str, hidden: int, seq: int) -> bytes:
    rng = np.random.default_rng(0)
    gamma = numpy_helper.from_array(rng.uniform(0.5, 1.5, hidden).astype(np.float32), "gamma")
    beta = numpy_helper.from_array(rng.uniform(-0.5, 0.5, hidden).astype(np.float32), "beta")
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, seq, hidden]) for n in ("x", "skip")]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, hidden])
    if form == "skip_layernorm":
        nodes = [
            helper.make_node(
                "SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["y"], domain="com.microsoft", epsilon=1e-12
            )
        ]
    else:
        nodes = [
            helper.make_node("Add" if form == "add_layernorm" else "Sum", ["x", "skip"], ["total"]),
            helper.make_node("LayerNormalization", ["total", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-12),
        ]
    graph = helper.make_graph(nodes, form, inputs, [output], [gamma, beta])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()


def session(model: bytes, threads: int, optimized_path: str) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.optimized_model_filepath = optimized_path
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def measure(hidden: int, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((1, args.seq, hidden)).astype(np.float32) for n in ("x", "skip")}
    sessions, ran = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for form in FORMS:
            path = os.path.join(tmp, f"{form}.onnx")
            sessions[form] = session(block_model(form, hidden, args.seq), threads, path)
            ran[form] = "+".join(n.op_type for n in onnx.load(path).graph.node)
    outputs = {form: s.run(None, feeds)[0] for form, s in sessions.items()}
    for form in FORMS[1:]:
        np.testing.assert_allclose(outputs[form], outputs[FORMS[0]], atol=1e-5, err_msg=form)
    for s in sessions.values():
        for _ in range(args.inner):
            s.run(None, feeds)
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    deadline, block = time.monotonic() + args.seconds, 0
    while time.monotonic() < deadline or block < 10:
        order = FORMS[block % 3 :] + FORMS[: block % 3]
        for form in order:
            start = time.perf_counter()
            for _ in range(args.inner):
                sessions[form].run(None, feeds)
            times[form].append((time.perf_counter() - start) / args.inner * 1e6)
        block += 1
    medians = {form: float(np.median(v)) for form, v in times.items()}
    return {"hidden": hidden, "threads": threads, "blocks": block, "us": medians, "ran": ran}


def render(rows: list[dict[str, Any]], command: str) -> str:
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        f"Command: `{command}`",
        "",
        machine_line(host_info(target="cpu", intra_op_threads=0), load=load),
        "",
        "| hidden | threads | blocks | SkipLayerNormalization us | Add + LayerNorm us (ORT ran) | "
        "Sum + LayerNorm us (ORT ran) | SkipLayerNormalization / Sum + LayerNorm |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        us = r["us"]
        lines.append(
            f"| {r['hidden']} | {r['threads']} | {r['blocks']} | {us['skip_layernorm']:.1f} | "
            f"{us['add_layernorm']:.1f} ({r['ran']['add_layernorm']}) | "
            f"{us['sum_layernorm']:.1f} ({r['ran']['sum_layernorm']}) | "
            f"**{us['skip_layernorm'] / us['sum_layernorm']:.2f}x** |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.skip_layernorm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[384, 768])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--inner", type=int, default=10, help="runs of one graph per timed block")
    parser.add_argument("--seconds", type=float, default=8.0, help="timing budget per row")
    parser.add_argument("--quick", action="store_true", help="2 s per row")
    parser.add_argument("--no-write", action="store_true", help="do not write bench/README.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = 2.0
    rows = []
    for hidden in args.hidden:
        for threads in args.threads:
            rows.append(measure(hidden, threads, args))
            print(f"H={hidden} threads={threads}: {rows[-1]['us']}", flush=True)
    command = "python -m bench.skip_layernorm " + shlex.join(argv if argv is not None else sys.argv[1:])
    table = render(rows, command.strip())
    print(table)
    if not args.no_write:
        write_blocks({(START, END): table}, heading=HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
