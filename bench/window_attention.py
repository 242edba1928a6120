"""Does fusing Swin's window attention pay on the CPU EP? (issue 17: swin/ts_sdpa slower at batch 8)

Run ``python -m bench.window_attention [--kernel] [--arch swin] [--size tiny|bench] [--exporter ts_sdpa]
[--batches 1 2 4 8] [--seconds 15]``. Two measurements, each timed at ORT's default level, 1 thread, in one
process, interleaved in blocks whose order rotates; medians over blocks and the median of the per-block ratio
(paired):

``--kernel``: one ``com.microsoft::MultiHeadAttention`` against the same attention in ORT's own ops
(Reshape/Transpose, MatMul, Mul, Add, Softmax, MatMul, Transpose/Reshape), with and without a bias on the
scores, over windows of S x S tokens (16 and 49 are Swin's 4x4 and 7x7), head sizes 8 and 32, about the
same work per row. Without a bias ORT runs its flash kernel; with one, a per-(window, head) loop.

the model (default): a corpus model (``--arch``, default Swin; ``tests/models/corpus``: tiny is the committed
export, bench builds the 7x7-window config into ``bench/out/corpus/bench``) through ``fuse_transformer`` +
``unfuse_skip_layernorm`` as ``fast`` leaves it, with attention unfused (``attention="none"``, what the CPU
rule ``passes/fusion/_short_attention`` picks for Swin) and fused (the pass for the cuda target, where that
rule does not apply), plus a second session of the unfused graph (A/A: the host's noise). Outputs are
checked equal first. Prints tables; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx_ir as ir  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from passes._infra import PassContext  # noqa: E402
from passes.fusion.fuse_transformer import FuseTransformer  # noqa: E402
from passes.fusion.unfuse_skip_layernorm import UnfuseSkipLayerNorm  # noqa: E402

HEADS = 2


def _session(blob: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(blob, options, providers=["CPUExecutionProvider"])


def interleaved(sessions: dict[str, ort.InferenceSession], feeds: dict, seconds: float) -> dict[str, list[float]]:
    names, block = list(sessions), 0
    times: dict[str, list[float]] = {n: [] for n in names}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or block < 10:
        for name in names[block % len(names) :] + names[: block % len(names)]:
            start = time.perf_counter()
            sessions[name].run(None, feeds)
            times[name].append((time.perf_counter() - start) * 1e3)
        block += 1
    return times


def _paired(times: dict[str, list[float]], a: str, b: str) -> float:
    return float(np.median(np.array(times[a]) / np.array(times[b])))


def _attention(s: int, d: int, fused: bool, bias: bool) -> bytes:
    """[N, S, D] q, k, v -> [N, S, D]; ``bias`` [1, HEADS, S, S] on the scores, as Swin's relative positions."""
    h = helper
    head = d // HEADS
    io = [h.make_tensor_value_info(n, TensorProto.FLOAT, ["N", s, d]) for n in "qkv"]
    out = h.make_tensor_value_info("y", TensorProto.FLOAT, ["N", s, d])
    rng = np.random.default_rng(0)
    values = rng.standard_normal(HEADS * s * s).astype(np.float32).tolist()
    inits = [h.make_tensor("bias", TensorProto.FLOAT, [1, HEADS, s, s], values)] if bias else []
    if fused:
        inputs = ["q", "k", "v", "", "", "bias" if bias else ""]
        nodes = [h.make_node("MultiHeadAttention", inputs, ["y"], domain="com.microsoft", num_heads=HEADS)]
        opsets = [h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)]
    else:
        inits += [
            h.make_tensor("split", TensorProto.INT64, [4], [0, 0, HEADS, head]),
            h.make_tensor("merge", TensorProto.INT64, [3], [0, 0, d]),
            h.make_tensor("scale", TensorProto.FLOAT, [], [head**-0.5]),
        ]
        nodes = []
        for n in "qkv":
            perm = [0, 2, 3, 1] if n == "k" else [0, 2, 1, 3]
            nodes += [
                h.make_node("Reshape", [n, "split"], [n + "4"]),
                h.make_node("Transpose", [n + "4"], [n + "t"], perm=perm),
            ]
        nodes += [h.make_node("MatMul", ["qt", "kt"], ["s"]), h.make_node("Mul", ["s", "scale"], ["ss"])]
        scores = "ss"
        if bias:
            nodes.append(h.make_node("Add", ["ss", "bias"], ["sb"]))
            scores = "sb"
        nodes += [
            h.make_node("Softmax", [scores], ["p"], axis=-1),
            h.make_node("MatMul", ["p", "vt"], ["o"]),
            h.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
            h.make_node("Reshape", ["ot", "merge"], ["y"]),
        ]
        opsets = [h.make_opsetid("", 17)]
    graph = h.make_graph(nodes, "window_attention", io, [out], inits)
    return h.make_model(graph, opset_imports=opsets).SerializeToString()


def kernel(seconds: float) -> None:
    print(
        "| head size | window S | rows N | MHA ms | MHA + bias ms | ORT ops + bias ms | MHA + bias / ORT ops + bias "
        "| MHA / MHA + bias | blocks | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for head in (8, 32):
        for s in (16, 25, 36, 49, 64, 100, 144):
            n = max(4, round(256 * 16 * 16 / (s * s)))  # 256 windows of 16 tokens: the tiny Swin's first stage at b8
            rng = np.random.default_rng(s)
            feeds = {k: rng.standard_normal((n, s, HEADS * head), dtype=np.float32) for k in "qkv"}
            blobs = {
                "mha": _attention(s, HEADS * head, True, False),
                "mha_bias": _attention(s, HEADS * head, True, True),
                "ops_bias": _attention(s, HEADS * head, False, True),
            }
            sessions = {k: _session(b) for k, b in blobs.items()}
            ref = sessions["ops_bias"].run(None, feeds)[0]
            np.testing.assert_allclose(sessions["mha_bias"].run(None, feeds)[0], ref, rtol=1e-4, atol=1e-5)
            t = interleaved(sessions, feeds, seconds)
            med = {k: float(np.median(v)) for k, v in t.items()}
            print(
                f"| {head} | {s} | {n} | {med['mha']:.3f} | {med['mha_bias']:.3f} | {med['ops_bias']:.3f} "
                f"| {_paired(t, 'mha_bias', 'ops_bias'):.2f} | {_paired(t, 'mha', 'mha_bias'):.2f} "
                f"| {len(t['mha'])} | {os.getloadavg()[0]:.1f} |",
                flush=True,
            )


def model(arch: str, size: str, exporter: str, batches: list[int], seconds: float) -> None:
    from tests.models import corpus

    if size == "tiny" and corpus.committed_path(arch, exporter).exists():
        path = corpus.committed_path(arch, exporter)
    else:
        info = corpus.cached(arch, exporter, size) or corpus.build(arch, exporter, size)
        if not info.get("ok"):
            raise SystemExit(f"{arch} {exporter}: {info.get('error')}")
        path = Path(corpus.default_out(size)) / corpus.filename(arch, exporter)
    blobs = {"export": path.read_bytes()}
    # unfused: attention="none", what the CPU rule (_short_attention) picks for Swin; fused: the pass for the cuda
    # target, where that rule does not apply (the graph is the CPU one otherwise)
    for name, mode, target in (("unfused", "none", "cpu"), ("fused", "attention", "cuda")):
        options = {"engines": ["onnxscript"], "attention": mode}
        fused = FuseTransformer(options)(ir.load(path), PassContext(target=target))
        cpu = UnfuseSkipLayerNorm()(fused.model, PassContext())
        blobs[name] = ir.serde.serialize_model(cpu.model).SerializeToString()
        print(f"<!-- {name}: { ({k: v for k, v in fused.counts.items() if k.startswith('fused_') and v}) } -->")
    blobs["unfused_copy"] = blobs["unfused"]
    print(
        "| batch | export ms | fused ms | unfused ms | fused / unfused (paired) | A/A: copy / unfused | blocks | load |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for batch in batches:
        feeds = corpus.feeds(arch, size, batch, 64, seed=batch)
        sessions = {name: _session(blob) for name, blob in blobs.items()}
        ref = sessions["export"].run(None, feeds)[0]
        for name in blobs:
            np.testing.assert_allclose(sessions[name].run(None, feeds)[0], ref, rtol=1e-4, atol=1e-4, err_msg=name)
        t = interleaved(sessions, feeds, seconds)
        med = {k: float(np.median(v)) for k, v in t.items()}
        print(
            f"| {batch} | {med['export']:.3f} | {med['fused']:.3f} | {med['unfused']:.3f} "
            f"| {_paired(t, 'fused', 'unfused'):.2f}x | {_paired(t, 'unfused_copy', 'unfused'):.2f} "
            f"| {len(t['export'])} | {os.getloadavg()[0]:.1f} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.window_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--kernel", action="store_true", help="the kernel sweep instead of the model")
    parser.add_argument("--arch", default="swin", help="a corpus architecture (tests.models.corpus)")
    parser.add_argument("--size", choices=["tiny", "bench"], default="tiny")
    parser.add_argument("--exporter", choices=["ts_eager", "ts_sdpa", "dynamo"], default="ts_sdpa")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--seconds", type=float, default=15.0, help="timing per row")
    args = parser.parse_args(argv)
    print(f"command: python -m bench.window_attention {shlex.join(argv if argv is not None else sys.argv[1:])}")
    if args.kernel:
        kernel(args.seconds)
    else:
        model(args.arch, args.size, args.exporter, args.batches, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
