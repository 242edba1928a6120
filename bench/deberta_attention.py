"""Does fusing DeBERTa-v3's disentangled attention pay on the CPU EP? (issue 17 item 2)

Run ``python -m bench.deberta_attention [--size bench|tiny] [--exporters ts_eager dynamo] [--shapes 1x64 8x256]
[--threads 1 2] [--seconds 20]`` (tiny: the committed export; bench: the dev extra: torch and transformers build
the corpus's bench-size ``deberta_v3``, hidden 256, 4 layers, 4 heads, 256 position buckets, into
``bench/out/corpus/bench``; reused while its spec holds).

Graphs, each as the ``fast`` preset leaves it on CPU (``fuse_transformer`` with the onnxscript engine, then
``unfuse_skip_layernorm``), differing only in ``fuse_transformer``'s ``attention`` option:

==========  ===================================================================================
none        attention left to ORT's kernels (MatMul, Softmax...), every other fusion made
mha         ``MultiHeadAttention`` with the relative c2p/p2c terms + mask as ``attention_bias``
==========  ===================================================================================

plus ``export`` (the upload) and ``mha_copy``, a second session of the same ``mha`` graph: an A/A control
whose ratio to ``mha`` is the noise of the host. ``attention="attention"`` gives the ``mha`` graph on
DeBERTa (q and k also feed the relative terms, so onnxscript does not pack Q/K/V), so it is not timed apart.
Each is timed at ORT's default level, in one process, interleaved in blocks whose order rotates; medians over
blocks, and the median over blocks of the per-block ratio (paired: both ran in the same block, under the
same load). Outputs are checked equal (1e-4) first. Prints a table; writes nothing.
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

from passes._infra import PassContext  # noqa: E402
from passes.fusion.fuse_transformer import FuseTransformer  # noqa: E402
from passes.fusion.unfuse_skip_layernorm import UnfuseSkipLayerNorm  # noqa: E402

ARCH = "deberta_v3"
MODES = ("none", "mha")


def _session(blob: bytes, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(blob, options, providers=["CPUExecutionProvider"])


def graphs(exporter: str, size: str) -> tuple[dict[str, bytes], dict[str, dict[str, int]]]:
    from tests.models import corpus

    if size == "tiny":  # the committed export
        path = corpus.committed_path(ARCH, exporter)
    else:
        info = corpus.cached(ARCH, exporter, size) or corpus.build(ARCH, exporter, size)
        if not info.get("ok"):
            raise SystemExit(f"{ARCH} {exporter}: {info.get('error')}")
        path = Path(corpus.default_out(size)) / corpus.filename(ARCH, exporter)
    blobs, counts = {"export": path.read_bytes()}, {}
    for mode in MODES:
        fused = FuseTransformer({"engines": ["onnxscript"], "attention": mode})(ir.load(path), PassContext())
        cpu = UnfuseSkipLayerNorm()(fused.model, PassContext())
        blobs[mode] = ir.serde.serialize_model(cpu.model).SerializeToString()
        counts[mode] = {k: v for k, v in fused.counts.items() if k.startswith("fused_") and v}
    blobs["mha_copy"] = blobs["mha"]
    return blobs, counts


def interleaved(sessions: dict[str, ort.InferenceSession], feeds: dict, seconds: float) -> tuple[dict, int]:
    names = list(sessions)
    times: dict[str, list[float]] = {n: [] for n in names}
    deadline, block = time.monotonic() + seconds, 0
    while time.monotonic() < deadline or block < 8:
        for name in names[block % len(names) :] + names[: block % len(names)]:
            start = time.perf_counter()
            sessions[name].run(None, feeds)
            times[name].append((time.perf_counter() - start) * 1e3)
        block += 1
    ratios = {
        "mha/none": float(np.median(np.array(times["mha"]) / np.array(times["none"]))),
        "copy/mha": float(np.median(np.array(times["mha_copy"]) / np.array(times["mha"]))),
    }
    return {n: float(np.median(v)) for n, v in times.items()} | ratios, block


def main(argv: list[str] | None = None) -> int:
    from tests.models import corpus

    parser = argparse.ArgumentParser(prog="python -m bench.deberta_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["tiny", "bench"], default="bench")
    parser.add_argument("--exporters", nargs="+", default=["ts_eager", "dynamo"], choices=["ts_eager", "dynamo"])
    parser.add_argument("--shapes", nargs="+", default=["1x64", "8x256"], help="BATCHxSEQ")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--seconds", type=float, default=20.0, help="timing budget per exporter, shape, threads")
    args = parser.parse_args(argv)
    print(f"command: python -m bench.deberta_attention {shlex.join(argv if argv is not None else sys.argv[1:])}")
    print(
        "| exporter | shape | threads | export ms | none ms | mha ms | mha / none (paired) | A/A: copy / mha "
        "| blocks | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for exporter in args.exporters:
        blobs, counts = graphs(exporter, args.size)
        print(f"<!-- {exporter} fusions: {counts} -->", flush=True)
        for shape in args.shapes:
            batch, seq = (int(x) for x in shape.split("x"))
            feeds = corpus.feeds(ARCH, args.size, batch, seq, seed=seq, pad=True)
            for threads in args.threads:
                sessions = {name: _session(blob, threads) for name, blob in blobs.items()}
                outs = {n: s.run(None, feeds)[0] for n, s in sessions.items()}
                for name in (*MODES, "mha_copy"):
                    np.testing.assert_allclose(outs[name], outs["export"], rtol=1e-4, atol=1e-4, err_msg=name)
                ms, blocks = interleaved(sessions, feeds, args.seconds)
                load = os.getloadavg()[0]
                print(
                    f"| {exporter} | {shape} | {threads} | {ms['export']:.2f} | {ms['none']:.2f} | {ms['mha']:.2f} "
                    f"| {ms['mha/none']:.3f} | {ms['copy/mha']:.3f} | {blocks} | {load:.1f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
