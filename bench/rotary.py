"""RotaryEmbedding benchmark: a Llama-shaped decoder as ``torch.onnx.export`` (TorchScript, KV cache) writes it,
against the same model after ``fuse_rotary`` (rotary -> ``com.microsoft::RotaryEmbedding``), on ORT's CPU EP at
its default level (what users run).

Run ``python -m bench.rotary [--threads 1 2] [--past 128] [--prompt 128] [--rounds 9] [--no-write]``.

Model: 4 layers, hidden 512, 8 heads / 2 kv heads (head size 64), MLP 1408, vocabulary 32000, random
weights, built here (transformers config, no hub) into ``bench/out/rotary/`` and never committed. Figures, per
intra-op thread count, batch 1:

* decode: latency of one call with 1 new token after a cache of ``--past`` positions;
* prefill: latency of one call on an empty cache with ``--prompt`` new tokens.

Variants are timed interleaved: every round runs each variant once per figure, in an order that rotates per
round; medians over rounds, ratio = original / variant (> 1: faster). The fused model is checked against the
original (ORT, optimizations off) before it is timed. The table goes into bench/README.md between the
``rotary-table`` markers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx_ir as ir  # noqa: E402

from bench._decoder_ab import LLAMA, build, check, measure  # noqa: E402
from bench._report import machine_line, unmarked, write_blocks  # noqa: E402
from passes._infra import PassContext, op_histogram  # noqa: E402
from passes.fusion.fuse_rotary import FuseRotary  # noqa: E402
from tests.models.build_decoders import Signature, decoder_feeds  # noqa: E402
from workers.benchmark import host_info  # noqa: E402

START, END = "<!-- rotary-table:start -->", "<!-- rotary-table:end -->"
HEADING = "## RotaryEmbedding (issue 19, fuse_rotary)"
WORK = REPO / "bench" / "out" / "rotary"


def fuse(original: Path) -> Path:
    out = original.with_name(f"{original.stem}.rotary.onnx")
    model = ir.load(original)
    result = FuseRotary()(model, PassContext())
    ops = op_histogram(result.model)
    if ops["com.microsoft::RotaryEmbedding"] != 2 * LLAMA.layers or ops["Sin"] or ops["Cos"]:
        raise RuntimeError(f"fuse_rotary fused {dict(ops)}: {[m.reason for m in result.non_matches]}")
    ir.save(result.model, out)
    return out


def fast(original: Path, signature: Signature, *, rotary: bool) -> Path:
    """The ``fast`` preset's passes in order, in-process and without the ledger (nothing rolled back), with or
    without fuse_rotary: what fuse_rotary changes for the attention fusions after it."""
    from passes import registry

    out = original.with_name(f"{original.stem}.fast{'' if rotary else '_norotary'}.onnx")
    if not out.exists():
        model = ir.load(original)
        ctx = PassContext(samples=[decoder_feeds(signature, 1, 16, 0, seed=5), decoder_feeds(signature, 1, 1, 32)])
        for spec in registry.PRESETS["fast"].specs:
            if rotary or spec.name != "fuse_rotary":
                model = registry.build_passes([spec])[0](model, ctx).model
        ir.save(model, out)
    return out


def _attention_ops(path: Path) -> str:
    ops = op_histogram(ir.load(path))
    names = ("RotaryEmbedding", "GroupQueryAttention", "MultiHeadAttention")
    found = [f"{ops[f'com.microsoft::{n}']} {n}" for n in names if ops[f"com.microsoft::{n}"]]
    return ", ".join([*found, f"{ops['Sin'] + ops['Cos']} Sin/Cos"])


def run(args: argparse.Namespace) -> str:
    original = build(WORK / "llama_4x512_past_ts.onnx")
    signature = Signature.of(original)
    variants = {"original": original, "fuse_rotary": fuse(original)}
    if args.fast:
        variants |= {"fast without fuse_rotary": fast(original, signature, rotary=False)}
        variants |= {"fast": fast(original, signature, rotary=True)}
    diffs = {name: check(original, path, signature) for name, path in variants.items() if name != "original"}
    fused_ops = {name: _attention_ops(path) for name, path in variants.items()}
    feeds = {
        f"decode@{args.past}": decoder_feeds(signature, 1, 1, args.past, seed=1),
        f"prefill{args.prompt}": decoder_feeds(signature, 1, args.prompt, 0, seed=2),
    }
    rows = []
    for threads in args.threads:
        got = measure(variants, feeds, threads, args.rounds)
        for figure in feeds:
            base = got["original"][figure]
            cells = [f"{got[v][figure]:.2f} ms ({base / got[v][figure]:.3f}x)" for v in variants if v != "original"]
            rows.append(f"| {figure} | {threads} | {base:.2f} ms | {' | '.join(cells)} |")
            print(rows[-1], flush=True)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return "\n".join(
        [
            f"Llama-shaped, {LLAMA.layers} layers, hidden {LLAMA.hidden}, {LLAMA.heads}/{LLAMA.kv_heads} heads, "
            f"vocabulary {LLAMA.vocab}, random weights, TorchScript export with cache; batch 1; ORT default level; "
            f"medians of {args.rounds} interleaved rounds; ratio = original / variant (> 1: faster). "
            f"fuse_rotary alone: 8 RotaryEmbedding, one 4096-row cos/sin cache. Max |diff| to the original "
            f"(optimizations off): {', '.join(f'{k} {v:.1e}' for k, v in diffs.items())}. Fused ops: "
            f"{'; '.join(f'{k}: {v}' for k, v in fused_ops.items())}.",
            "",
            f"| figure | threads | original | {' | '.join(v for v in variants if v != 'original')} |",
            f"| --- | --- | --- |{' --- |' * (len(variants) - 1)}",
            *rows,
            "",
            machine_line(host_info(target="cpu", intra_op_threads=0), load=load),
            "",
            f"Reproduce: `python -m bench.rotary --threads {' '.join(map(str, args.threads))} --past {args.past} "
            f"--prompt {args.prompt} --rounds {args.rounds}{' --fast' if args.fast else ''}`.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rotary", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--past", type=int, default=128, help="cache length of the decode figure")
    parser.add_argument("--prompt", type=int, default=128, help="new tokens of the prefill figure")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--fast", action="store_true", help="also the fast preset with and without fuse_rotary")
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave bench/README.md alone")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 3
    block = run(args)
    print(unmarked(f"{START}\n{block}\n{END}", START, END))
    if not args.no_write:
        write_blocks({(START, END): block}, heading=HEADING)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
