"""Multimodal rope (M-RoPE) as RotaryEmbedding: a Qwen2.5-VL-shaped language model as ``torch.onnx.export``
(TorchScript) writes it, against the same model after ``fuse_rotary`` (its per-token caches, issue 17/19), on
ORT's CPU EP at its default level.

Run ``python -m bench.mrope_rotary [--threads 1 2] [--rounds 15] [--no-write]``.

Model: transformers' ``Qwen2_5_VLTextModel`` (4 layers, hidden 512, 8 heads / 2 KV heads of 64, M-RoPE sections
8/12/12, MLP 1408) with a bias-free LM head of 32000, random weights, no KV cache (``position_ids [3, batch,
sequence]``, as ``tests/models/build_heldout_mrope.py`` exports its tiny twin), built into ``bench/out/mrope/``,
never committed. Figures: one call at batch 1 with 128 and 512 tokens whose height and width positions run ahead
of the time row (an image's patches). Variants are timed interleaved (``bench._decoder_ab.measure``: each round
runs each variant once per figure, the order rotating); medians over rounds, ratio = original / fused (> 1:
faster). The fused model is checked against the original (optimizations off) first. The table goes into
bench/README.md between the ``mrope-table`` markers.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import onnx_ir as ir  # noqa: E402
import onnxruntime as ort  # noqa: E402

from bench._decoder_ab import measure  # noqa: E402
from bench._report import machine_line, write_blocks  # noqa: E402
from passes._infra import PassContext, op_histogram  # noqa: E402
from passes.fusion.fuse_rotary import FuseRotary  # noqa: E402
from tests.models.build_heldout_mrope import mrope_feeds  # noqa: E402
from workers.benchmark import host_info  # noqa: E402

START, END = "<!-- mrope-table:start -->", "<!-- mrope-table:end -->"
HEADING = "## M-RoPE as RotaryEmbedding (issues 17/19, fuse_rotary per-token caches)"
WORK = REPO / "bench" / "out" / "mrope"
VOCAB, HIDDEN, LAYERS = 32000, 512, 4


def feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The tiny twin's feeds (height and width positions ahead of the time row) over this vocabulary."""
    return mrope_feeds(batch, seq, seed, vocab=VOCAB)


def build(path: Path) -> Path:
    if path.exists():
        return path
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen2_5_VLTextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1408, num_hidden_layers=LAYERS, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=4096,
        rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}, pad_token_id=0,
    )  # fmt: skip

    class LanguageModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = tf.Qwen2_5_VLTextModel(config)
            self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

        def forward(self, input_ids, attention_mask, position_ids):
            hidden = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
            return self.head(hidden.last_hidden_state)

    module = LanguageModel().eval()
    example = tuple(torch.from_numpy(v) for v in feeds(1, 7).values())
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            "position_ids": {1: "batch", 2: "sequence"}, "logits": {0: "batch", 1: "sequence"}}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, example, str(path), opset_version=17, dynamo=False,
                          input_names=["input_ids", "attention_mask", "position_ids"], output_names=["logits"],
                          dynamic_axes=axes)  # fmt: skip
    return path


def fuse(original: Path) -> Path:
    out = original.with_name(f"{original.stem}.rotary.onnx")
    result = FuseRotary()(ir.load(original), PassContext())
    ops = op_histogram(result.model)
    if ops["com.microsoft::RotaryEmbedding"] != 2 * LAYERS:
        raise RuntimeError(f"fuse_rotary fused {ops['com.microsoft::RotaryEmbedding']} rotations: {result.non_matches}")
    ir.save(result.model, out)
    return out


def check(original: Path, fused: Path) -> float:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    a, b = (ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"]) for p in (original, fused))
    worst = max(float(np.abs(a.run(None, f)[0] - b.run(None, f)[0]).max()) for f in (feeds(1, 9, 1), feeds(2, 33, 2)))
    if worst > 1e-3:
        raise RuntimeError(f"{fused.name} differs from the original by {worst}")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    original = build(WORK / "qwen25vl_text_bench.onnx")
    fused = fuse(original)
    worst = check(original, fused)
    figures = {f"prefill {n}": feeds(1, n, n) for n in (128, 512)}
    rows = []
    for threads in args.threads:
        medians = measure({"original": original, "fused": fused}, figures, threads, args.rounds)
        for figure in figures:
            a, b = medians["original"][figure], medians["fused"][figure]
            rows.append(f"| {threads} | {figure} | {a:.2f} | {b:.2f} | {a / b:.3f} |")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    table = "\n".join(
        [
            f"`python -m bench.mrope_rotary --threads {' '.join(map(str, args.threads))} --rounds {args.rounds}`; "
            f"max |diff| {worst:.2g} (optimizations off).",
            "",
            machine_line(host_info(target="cpu", intra_op_threads=0), load=load),
            "",
            "| threads | call | original ms | fused ms | original / fused |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if not args.no_write:
        write_blocks({(START, END): table}, heading=HEADING)


if __name__ == "__main__":
    main()
