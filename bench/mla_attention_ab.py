"""Multi-head latent attention fused as MultiHeadAttention against the unfused graph (issue 19, ``fuse_gqa``).

Run ``python -m bench.mla_attention_ab [--hidden 1024] [--heads 16] [--threads 1] [--blocks 30] [--calls 20]``.
A MiniCPM3 decoder from its transformers config (2 layers, q LoRA 384, kv latent 32, keys 64 + 32 rotated, values
64, random weights, Optimum's cached signature, TorchScript exporter; ``bench.heldout_dec_past``'s builder) goes
through the ``fast`` passes twice: ``fuse_gqa`` with ``attention='mha'`` (MultiHeadAttention on flat keys and
values) and with ``attention='gqa'`` (left unfused: GroupQueryAttention takes one head size). Both run a prefill of
64 tokens and one token after caches of 128 and 512, interleaved in blocks of ``--calls`` calls, the order reversed
every other block; printed: each median (ms) and the median of the per-block ratio unfused / MHA.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OUT = REPO / "bench" / "out" / "mla_ab"


def _fast(path: Path, attention: str) -> bytes:
    import onnx_ir as ir

    from passes import registry
    from passes._infra import PassContext

    model = ir.load(path)
    specs = [s for s in registry.PRESETS["fast"].specs if s.name != "padding_elimination"]
    for each in registry.build_passes(specs):
        step = type(each)(each.options.model_copy(update={"attention": attention})) if each.name == "fuse_gqa" else each
        model = step(model, PassContext()).model
    return ir.serde.serialize_model(model).SerializeToString()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)

    import numpy as np
    import onnxruntime as ort

    from bench import heldout_dec_past as past
    from bench.heldout_dec_round2 import IDS
    from tests.models.build_decoders import Signature, decoder_feeds

    extra = {"num_attention_heads": args.heads, "num_key_value_heads": args.heads, "q_lora_rank": 384,
             "kv_lora_rank": 32, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
             "tie_word_embeddings": False, **IDS}  # fmt: skip
    probe = past.Probe(
        "minicpm3_mla", "MiniCPM3Config", "MiniCPM3ForCausalLM", kv_heads=1, extra=tuple(extra.items()),
        hidden=args.hidden, intermediate=args.hidden * 11 // 4, vocab=1024, cache_head_dim=32,
    )  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    built = past.build(probe, "ts", True, OUT, "bench.mla_attention_ab")
    if not built["ok"]:
        print("export failed:", built)
        return 1
    path = Path(built["file"])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = args.threads, 3
    sessions = {
        a: ort.InferenceSession(_fast(path, a), options, providers=["CPUExecutionProvider"]) for a in ("mha", "gqa")
    }
    signature = Signature.of(path)
    print(f"MiniCPM3 hidden {args.hidden}, {args.heads} heads, {args.threads} thread(s)")
    for name, (batch, seq, cache) in {
        "prefill 64": (1, 64, 0),
        "decode @128": (1, 1, 128),
        "decode @512": (1, 1, 512),
    }.items():
        feeds = decoder_feeds(signature, batch, seq, cache, seed=1)
        times: dict[str, list[float]] = {a: [] for a in sessions}
        for block in range(args.blocks):
            for a in list(sessions)[:: 1 if block % 2 == 0 else -1]:
                start = time.perf_counter()
                for _ in range(args.calls):
                    sessions[a].run(None, feeds)
                times[a].append((time.perf_counter() - start) / args.calls * 1e3)
        ratio = np.median(np.array(times["gqa"]) / np.array(times["mha"]))
        print(f"| {name} | MHA {np.median(times['mha']):.3f} ms | unfused {np.median(times['gqa']):.3f} ms | "
              f"unfused / MHA {ratio:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
