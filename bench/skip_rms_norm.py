"""Residual + RMS norm at decoder shapes on ORT's CPU EP: is ``unfuse_skip_layernorm`` still right for decoders?

Run ``python -m bench.skip_rms_norm [--hidden 512] [--seqs 1 128 512] [--threads 1 2] [--blocks 30]``.

Two one-block graphs on ``x, skip: float[1, S, H]``, both returning the normalized value and the residual sum
(the next block's residual), timed at ORT's default level:

* ``skip``: ``com.microsoft::SkipSimplifiedLayerNormalization(x, skip, gamma)`` (output 3: the sum), what
  onnxruntime-genai's model builder emits and what ``unfuse_skip_layernorm`` takes apart on CPU;
* ``add``: ``Add(x, skip)`` then ``SimplifiedLayerNormalization``: the pass's form.

S=1 is a decode step, S=128 / 512 prefills. Runs are interleaved in blocks (order alternating per block), each
block timing ``--inner`` runs of one graph; medians over blocks. Outputs are checked equal within 1e-4. Prints
a Markdown table (bench/README.md, RotaryEmbedding section, quotes it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def graph(kind: str, hidden: int) -> bytes:
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "s", hidden]) for n in ("x", "skip")]
    gamma = numpy_helper.from_array(np.random.default_rng(0).standard_normal(hidden).astype(np.float32), "g")
    if kind == "skip":
        nodes = [
            helper.make_node(
                "SkipSimplifiedLayerNormalization", ["x", "skip", "g"], ["y", "", "", "sum"], domain="com.microsoft",
                epsilon=1e-6,
            )
        ]  # fmt: skip
    else:
        nodes = [
            helper.make_node("Add", ["x", "skip"], ["sum"]),
            helper.make_node("SimplifiedLayerNormalization", ["sum", "g"], ["y"], epsilon=1e-6, axis=-1),
        ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "sum")]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(
        helper.make_graph(nodes, kind, inputs, outputs, [gamma]), opset_imports=opsets
    ).SerializeToString()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.skip_rms_norm", description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 128, 512])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--inner", type=int, default=50)
    args = parser.parse_args(argv)
    rows = []
    for threads in args.threads:
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = threads, 1, 3
        sessions = {
            k: ort.InferenceSession(graph(k, args.hidden), options, providers=["CPUExecutionProvider"])
            for k in ("skip", "add")
        }
        for seq in args.seqs:
            rng = np.random.default_rng(seq)
            feeds = {n: rng.standard_normal((1, seq, args.hidden)).astype(np.float32) for n in ("x", "skip")}
            a, b = (sessions[k].run(None, feeds) for k in ("skip", "add"))
            assert all(np.abs(x - y).max() < 1e-4 for x, y in zip(a, b, strict=True))
            times: dict[str, list[float]] = {k: [] for k in sessions}
            inner = args.inner * (4 if seq == 1 else 1)
            for block in range(args.blocks):
                for kind in ("skip", "add") if block % 2 else ("add", "skip"):
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        sessions[kind].run(None, feeds)
                    times[kind].append((time.perf_counter() - t0) / inner * 1e6)
            skip, add = (statistics.median(times[k]) for k in ("skip", "add"))
            rows.append(f"| [1, {seq}, {args.hidden}] | {threads} | {skip:.1f} us | {add:.1f} us | {skip / add:.2f}x |")
    print("| shape | threads | SkipSimplifiedLayerNormalization | Add + SimplifiedLayerNormalization | skip / add |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print(f"\nLoad average: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}; `python -m bench.skip_rms_norm "
          f"{' '.join(sys.argv[1:])}`")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
