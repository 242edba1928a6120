"""Bidirectional attention with sinks fused as MultiHeadAttention (the sink one more key) against the unfused graph
(issue 17, ``passes/fusion/_sink_column.py``).

Run ``python -m bench.sink_attention_ab [--hidden 512] [--heads 8] [--kv-heads 2] [--layers 2] [--threads 1]
[--blocks 20] [--calls 5]``. OpenAI's privacy filter from its transformers config (heads of 64, a band of 128 keys
either way, attention sinks, 4 experts, random weights; TorchScript exporter, no cache; ``bench.heldout_dec_nocache``'s
builder) goes through the ``fast`` passes twice: with its sinks first written as one more key
(``_sink_column.as_extra_key``: fuse_transformer then fuses MultiHeadAttention over keys and values with a zero row,
the sinks in ``attention_bias``) and as the passes leave it (unfused, ORT's own kernels). Both run a batch of 1 at
128 and 512 tokens, interleaved in blocks of ``--calls`` calls, the order reversed every other block; printed: each
median (ms), the median of the per-block ratio unfused / fused, and the time ORT's profile puts in the attention
nodes (the ``self_attn`` nodes and MultiHeadAttention, over 5 profiled calls): the experts' weight gathers of the
export's batched MoE dominate the whole model's time at these sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OUT = REPO / "bench" / "out" / "sink_ab"


def _fast(path: Path, extra_key: bool) -> bytes:
    """``fast``'s passes on the export, its sinks first written as one more key where ``extra_key``."""
    import onnx_ir as ir

    from passes import registry
    from passes._infra import PassContext
    from passes.fusion import _sink_column

    model = ir.load(path)
    if extra_key:
        ir.passes.common.ShapeInferencePass()(model)
        _sink_column.as_extra_key(model)
    for each in registry.build_passes(registry.PRESETS["fast"].specs):
        model = each(model, PassContext()).model
    return ir.serde.serialize_model(model).SerializeToString()


def _attention_ms(blob: bytes, feeds: dict, threads: int, calls: int = 5) -> float:
    """Milliseconds per call ORT's profile puts in the attention's nodes (by name) and MultiHeadAttention."""
    import json

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_profiling, options.intra_op_num_threads, options.log_severity_level = True, threads, 3
    options.profile_file_prefix = str(OUT / "profile")
    session = ort.InferenceSession(blob, options, providers=["CPUExecutionProvider"])
    for _ in range(calls):
        session.run(None, feeds)
    trace = Path(session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    total = sum(
        e["dur"]
        for e in events
        if e.get("cat") == "Node"
        and e["name"].endswith("_kernel_time")
        and ("self_attn" in e["name"] or e["args"].get("op_name") == "MultiHeadAttention")
    )
    return total / calls / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)

    import numpy as np
    import onnx
    import onnxruntime as ort

    from bench import heldout_dec_nocache as nocache
    from bench import heldout_dec_round9  # noqa: F401  (registers the privacy filter)
    from bench.heldout_dec_round2 import SPECS

    name = "openai_privacy_filter"
    sizes = {"hidden_size": args.hidden, "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
             "head_dim": 64, "intermediate_size": args.hidden, "num_hidden_layers": args.layers,
             "sliding_window": 128, "max_position_embeddings": 1024}  # fmt: skip
    spec = dataclasses.replace(SPECS[name], kwargs={**SPECS[name].kwargs, **sizes})
    OUT.mkdir(parents=True, exist_ok=True)
    built = nocache.build(name, "ts_eager", OUT, {name: spec}, "bench.sink_attention_ab")
    if not built.get("ok"):
        print("export failed:", built.get("error"))
        return 1
    path = Path(built["path"])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = args.threads, 3
    fused, unfused = _fast(path, extra_key=True), _fast(path, extra_key=False)
    sessions = {
        label: ort.InferenceSession(blob, options, providers=["CPUExecutionProvider"])
        for label, blob in (("fused", fused), ("unfused", unfused))
    }
    fused_ops, unfused_ops = (
        sum(n.op_type == "MultiHeadAttention" for n in onnx.load_from_string(b).graph.node) for b in (fused, unfused)
    )
    print(f"privacy filter hidden {args.hidden}, {args.heads} heads / {args.kv_heads} kv, {args.layers} layers, "
          f"{args.threads} thread(s); MultiHeadAttention: {fused_ops} and {unfused_ops}")  # fmt: skip
    rng = np.random.default_rng(1)
    for seq in (128, 512):
        feeds = {"input_ids": rng.integers(5, 1000, (1, seq)), "attention_mask": np.ones((1, seq), np.int64)}
        outs = {label: s.run(None, feeds)[0] for label, s in sessions.items()}
        diff = float(np.abs(outs["fused"] - outs["unfused"]).max())
        times: dict[str, list[float]] = {label: [] for label in sessions}
        for block in range(args.blocks):
            for label in list(sessions)[:: 1 if block % 2 == 0 else -1]:
                start = time.perf_counter()
                for _ in range(args.calls):
                    sessions[label].run(None, feeds)
                times[label].append((time.perf_counter() - start) / args.calls * 1e3)
        ratio = np.median(np.array(times["unfused"]) / np.array(times["fused"]))
        attention = {label: _attention_ms(blob, feeds, args.threads) for label, blob in (("fused", fused),
                     ("unfused", unfused))}  # fmt: skip
        print(f"| 1 x {seq} | fused {np.median(times['fused']):.2f} ms | unfused {np.median(times['unfused']):.2f} ms"
              f" | unfused / fused {ratio:.3f} | attention fused {attention['fused']:.2f} ms, unfused "
              f"{attention['unfused']:.2f} ms | max abs diff {diff:.1e} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
