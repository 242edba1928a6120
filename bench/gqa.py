"""GroupQueryAttention benchmark: a Llama-shaped decoder as ``torch.onnx.export`` (TorchScript, KV cache) writes
it, against ``fuse_gqa``'s GroupQueryAttention and MultiHeadAttention outputs, on ORT's CPU EP at its default
level (what users run).

Run ``python -m bench.gqa [--threads 1 2] [--past 128 1024] [--prompt 128] [--rounds 7] [--no-write]``. Where the
checkout has ``fuse_rotary``, a third column runs it before ``fuse_gqa`` (as the ``fast`` preset does).

Model: 4 layers, hidden 512, 8 heads / 2 kv heads (head size 64), MLP 1408, vocabulary 32000, random
weights, built here (transformers config, no hub) into ``bench/out/gqa/`` and never committed. Figures, per
intra-op thread count, batch 1:

* decode: latency of one call with 1 new token after a cache of each ``--past`` length (128 and 1024; the cache
  is random: the latency does not depend on its values);
* prefill: latency of one call on an empty cache with ``--prompt`` new tokens.

Variants are timed interleaved: every round runs each variant once per figure, in an order that rotates per
round; medians over rounds, ratios = original / variant (> 1: faster). Each fused model is checked against the
original (ORT, optimizations off) before it is timed. The table goes into bench/README.md between the
``gqa-table`` markers.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from passes.fusion.fuse_gqa import FuseGqa  # noqa: E402
from tests.models.build_decoders import Signature, decoder_feeds  # noqa: E402
from workers.benchmark import host_info  # noqa: E402

START, END = "<!-- gqa-table:start -->", "<!-- gqa-table:end -->"
HEADING = "## GroupQueryAttention (issue 19, fuse_gqa)"
WORK = REPO / "bench" / "out" / "gqa"
TITLES = {
    "gqa": "fuse_gqa: GroupQueryAttention",
    "mha": "fuse_gqa: MultiHeadAttention",
    "rotary+gqa": "fuse_rotary + fuse_gqa",
}


def fuse(original: Path, attention: str) -> Path:
    """fuse_gqa's ``attention`` form; ``rotary+gqa``: fuse_rotary first, where this checkout has it."""
    out = original.with_name(f"{original.stem}.{attention}.onnx")
    model = ir.load(original)
    if attention == "rotary+gqa":
        model = importlib.import_module("passes.fusion.fuse_rotary").FuseRotary()(model).model
        attention = "gqa"
    result = FuseGqa({"attention": attention})(model, PassContext())
    ops = op_histogram(result.model)
    op = {"gqa": "GroupQueryAttention", "mha": "MultiHeadAttention"}[attention]
    if ops[f"com.microsoft::{op}"] != LLAMA.layers or "Softmax" in ops:
        raise RuntimeError(f"fuse_gqa({attention}) fused {dict(ops)}: {[m.reason for m in result.non_matches]}")
    ir.save(result.model, out)
    return out


def run(args: argparse.Namespace) -> str:
    original = build(WORK / "llama_4x512_past_ts.onnx")
    signature = Signature.of(original)
    variants = {"original": original}
    diffs = {}
    forms = ["gqa", "mha"] + (["rotary+gqa"] if importlib.util.find_spec("passes.fusion.fuse_rotary") else [])
    for attention in forms:
        variants[attention] = fuse(original, attention)
        diffs[attention] = check(original, variants[attention], signature)
    feeds = {f"decode@{past}": decoder_feeds(signature, 1, 1, past, seed=1) for past in args.past}
    feeds[f"prefill{args.prompt}"] = decoder_feeds(signature, 1, args.prompt, 0, seed=2)
    rows = []
    for threads in args.threads:
        got = measure(variants, feeds, threads, args.rounds)
        for figure in feeds:
            base = got["original"][figure]
            cells = [f"{got[v][figure]:.2f} ms ({base / got[v][figure]:.2f}x)" for v in forms]
            rows.append(f"| {figure} | {threads} | {base:.2f} ms | {' | '.join(cells)} |")
            print(rows[-1], flush=True)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return "\n".join(
        [
            f"Llama-shaped, {LLAMA.layers} layers, hidden {LLAMA.hidden}, {LLAMA.heads}/{LLAMA.kv_heads} heads, "
            f"vocabulary {LLAMA.vocab}, random weights, TorchScript export with cache; batch 1; ORT default level; "
            f"medians of {args.rounds} interleaved rounds; ratio = original / fused. Max |diff| to the original "
            f"(optimizations off): {', '.join(f'{TITLES[f]} {diffs[f]:.1e}' for f in forms)}.",
            "",
            f"| figure | threads | original | {' | '.join(TITLES[f] for f in forms)} |",
            "| --- | --- | --- |" + " --- |" * len(forms),
            *rows,
            "",
            machine_line(host_info(target="cpu", intra_op_threads=0), load=load),
            "",
            f"Reproduce: `python -m bench.gqa --threads {' '.join(map(str, args.threads))} "
            f"--past {' '.join(map(str, args.past))} --prompt {args.prompt} --rounds {args.rounds}`.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gqa", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--past", type=int, nargs="+", default=[128, 1024], help="cache lengths of the decode figures")
    parser.add_argument("--prompt", type=int, default=128, help="new tokens of the prefill figure")
    parser.add_argument("--rounds", type=int, default=7)
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
