"""Does fusing BLOOM's ALiBi attention into ``MultiHeadAttention`` pay on the CPU EP? (issue 17/19)

Run ``python -m bench.bloom_alibi_attention [--hidden 256] [--heads 4] [--layers 2] [--shapes 1x64 4x256]
[--threads 1 2] [--seconds 15] [--past]`` (needs the dev extra: torch and transformers build a BLOOM of that
size from its config, TorchScript eager export, into ``bench/out/bloom_alibi/``; reused while the file is
there). Without ``--past``: ``bench.heldout_dec_nocache``'s builder, ``(input_ids, attention_mask) -> logits``,
shapes ``BATCHxSEQ``. With ``--past``: ``bench.heldout_dec_past``'s (Optimum's text-generation-with-past
signature, no ``position_ids``), shapes ``BATCHxSEQ+PAST`` (``4x1+255``: a decode step after 255 cached
positions; ``1x64+0``: a prefill), the first row's first third padding (left padding, as a batch of prompts of
unequal length is generated).

Graphs, each as the ``fast`` preset leaves it on CPU (``fuse_transformer`` with the onnxscript engine, then
``unfuse_skip_layernorm``), differing only in ``fuse_transformer``'s ``attention`` option: ``none`` (the
attention left to ORT's kernels: batched MatMul, ALiBi Add, mask Add, Softmax; every other fusion made) and
``mha`` (``MultiHeadAttention`` with ALiBi + mask as ``attention_bias``), plus ``mha_copy``, a second session
of the ``mha`` graph (A/A control: its ratio to ``mha`` is the host's noise). Sessions at ORT's default level,
timed interleaved in blocks whose order rotates; medians per graph and the median of the per-block ratio.
Outputs are checked against the upload (1e-4) first, on right-padded masks (the last row half padding).
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

OUT = REPO / "bench" / "out" / "bloom_alibi"
MODES = ("none", "mha")


def export(hidden: int, heads: int, layers: int) -> Path:
    from bench import heldout_dec_nocache as probe

    path = OUT / f"bloom_h{hidden}_n{heads}_l{layers}_ts_eager.onnx"
    if path.exists():
        return path
    OUT.mkdir(parents=True, exist_ok=True)
    base = probe.SPECS["bloom"]
    spec = probe.Spec(base.name, base.config, base.model, {**base.kwargs, "hidden_size": hidden, "n_head": heads})
    spec = probe.Spec(spec.name, spec.config, spec.model, {**spec.kwargs, "n_layer": layers}, rotary=False)
    wrapper = probe._wrapper(probe._model(spec, "eager"))
    probe._export(wrapper, "ts_eager", probe.feeds(2, 16, seed=0), path)
    probe._verify(wrapper, path)
    return path


def export_past(hidden: int, heads: int, layers: int) -> Path:
    import onnx

    from bench import heldout_dec_past as past

    path = OUT / f"bloom_past_h{hidden}_n{heads}_l{layers}_ts.onnx"
    if path.exists():
        return path
    OUT.mkdir(parents=True, exist_ok=True)
    # the probe reads its sizes from module constants when it builds and checks
    past.LAYERS, past.HIDDEN, past.HEADS, past.HEAD_DIM = layers, hidden, heads, hidden // heads
    probe = past.PROBES["bloom"]
    mod = past.module(probe)
    onnx.save(past.export(mod, probe, "ts", path), str(path))
    past.verify(mod, probe, path)
    return path


def past_feeds(path: Path, batch: int, seq: int, cached: int, seed: int) -> dict[str, np.ndarray]:
    import onnx

    rng = np.random.default_rng(seed)
    mask = np.ones((batch, cached + seq), np.int64)
    mask[0, : (cached + seq) // 3] = 0
    feeds = {"input_ids": rng.integers(5, 256, size=(batch, seq), dtype=np.int64), "attention_mask": mask}
    for value in onnx.load(str(path), load_external_data=False).graph.input:
        if value.name.startswith("past_key_values."):
            heads, dim = (d.dim_value for d in value.type.tensor_type.shape.dim[1:4:2])
            feeds[value.name] = rng.standard_normal((batch, heads, cached, dim)).astype(np.float32)
    return feeds


def graphs(path: Path) -> tuple[dict[str, bytes], dict[str, dict[str, int]]]:
    blobs, counts = {"export": path.read_bytes()}, {}
    for mode in MODES:
        fused = FuseTransformer({"engines": ["onnxscript"], "attention": mode})(ir.load(path), PassContext())
        cpu = UnfuseSkipLayerNorm()(fused.model, PassContext())
        blobs[mode] = ir.serde.serialize_model(cpu.model).SerializeToString()
        counts[mode] = {k: v for k, v in fused.counts.items() if k.startswith("fused_") and v}
    blobs["mha_copy"] = blobs["mha"]
    return blobs, counts


def _session(blob: bytes, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(blob, options, providers=["CPUExecutionProvider"])


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
    from bench import heldout_dec_nocache as probe

    parser = argparse.ArgumentParser(prog="python -m bench.bloom_alibi_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", default=["1x64", "4x256"], help="BATCHxSEQ")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--seconds", type=float, default=15.0, help="timing budget per shape and thread count")
    parser.add_argument("--past", action="store_true", help="the KV-cache export; shapes BATCHxSEQ+PAST")
    args = parser.parse_args(argv)
    print(f"command: python -m bench.bloom_alibi_attention {shlex.join(argv if argv is not None else sys.argv[1:])}")
    path = (export_past if args.past else export)(args.hidden, args.heads, args.layers)
    blobs, counts = graphs(path)
    print(f"<!-- fusions: {counts} -->")
    print("| shape | threads | export ms | none ms | mha ms | mha / none (paired) | A/A: copy / mha | blocks | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        if args.past:
            size, cached = shape.split("+")
            batch, seq = (int(x) for x in size.split("x"))
            feeds = past_feeds(path, batch, seq, int(cached), seed=seq)
        else:
            batch, seq = (int(x) for x in shape.split("x"))
            feeds = probe.feeds(batch, seq, seed=seq, pad=True)
        for threads in args.threads:
            sessions = {name: _session(blob, threads) for name, blob in blobs.items()}
            outs = {n: s.run(None, feeds) for n, s in sessions.items()}
            for name in (*MODES, "mha_copy"):
                for got, want in zip(outs[name], outs["export"], strict=True):
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)
            ms, blocks = interleaved(sessions, feeds, args.seconds)
            print(
                f"| {shape} | {threads} | {ms['export']:.2f} | {ms['none']:.2f} | {ms['mha']:.2f} "
                f"| {ms['mha/none']:.3f} | {ms['copy/mha']:.3f} | {blocks} | {os.getloadavg()[0]:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
