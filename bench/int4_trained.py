"""quantize_int4 on the trained decoder (issue 19 "done when", accuracy): the pass with its defaults on the
held-out bytes (1,024 teacher-forced positions), and the figures its notes give, beside the fp32 original's
decode and prefill speed and weight bytes, timed interleaved on ORT's CPU EP at its default level.

Run ``python -m bench.int4_trained [--threads 1 2] [--rounds 5] [--decode-tokens 32] [--embeddings]``;
the defaults make the token table 8-bit GatherBlockQuantized where the budget holds (``embeddings="auto"``);
``--embeddings`` adds the same pass with the table float and with it int4; ``--heads`` adds it with the lm_head
float and with it 8-bit asked for (auto times the 8-bit head against the float one: on this 90k-weight decoder
that is per-op noise, so either may come out of a default run; these rows give both). Prints the figures and a markdown
table (the one in bench/README.md); writes nothing. The decoder is tiny (hidden 64, 2 layers, 90k MatMul
weights): its speed ratios say what per-op overhead does, not what int4 gains on a real model
(``bench.decoders --qwen05`` measures that).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx_ir as ir  # noqa: E402

from bench.decoders import decode_ms, prefill_ms, session, tables_summary, weight_bytes  # noqa: E402
from passes._infra import PassContext  # noqa: E402
from passes.precision import _quantization as q  # noqa: E402
from passes.precision.quantize_int4 import QuantizeInt4  # noqa: E402
from tests.models.build_decoders import OUT, Signature  # noqa: E402
from tests.passes.test_quantize_int4_trained import heldout_samples  # noqa: E402

KEY = "logits (teacher forcing)"
PATH = OUT / "trained_llama_past_ts.onnx"


def quantize(options: dict[str, Any] | None, out: Path) -> dict[str, Any] | str:
    """The pass's figures, or its refusal reason."""
    t0 = time.perf_counter()
    result = QuantizeInt4(options)(ir.load(PATH), PassContext(samples=heldout_samples()))
    seconds = time.perf_counter() - t0
    notes = result.notes
    if not result.modified:
        return "refused: " + "; ".join(m.reason for m in result.non_matches)
    proto = ir.serde.serialize_model(result.model)
    q.save_proto(proto, out, False)
    full, final = notes["accuracy_all_quantized"][KEY], notes["accuracy"][KEY]
    return {
        "seconds": round(seconds, 1),
        "block": notes["block_size"]["chosen"],
        "level": notes["accuracy_level"]["chosen"],
        "head": notes.get("lm_head_decision", "float").split(":")[0],
        "full_top1": full["top1_agreement"],
        "full_flipped": full["flipped"],
        "top1": final["top1_agreement"],
        "flipped": final["flipped"],
        "max_logit_diff": final["max_logit_diff"],
        "ppl": (final["perplexity"]["original"], final["perplexity"]["quantized"]),
        "int4_share": notes["int4_share"]["of_matmul_weights"],
        "tables": tables_summary(notes.get("embeddings", {})),
        "precision": notes["precision"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--embeddings", action="store_true")
    parser.add_argument("--heads", action="store_true")
    args = parser.parse_args(argv)
    signature = Signature.of(PATH)
    with tempfile.TemporaryDirectory(prefix="onnxforge-int4-") as tmp:
        work = Path(tmp)
        variants: dict[str, dict[str, Any] | None] = {"int4": None}
        if args.embeddings:
            variants |= {"int4 tables float": {"embeddings": "float"}, "int4 tables int4": {"embeddings": "int4"}}
        if args.heads:
            variants |= {"int4 head float": {"lm_head": "float"}, "int4 head int8": {"lm_head": "int8"}}
        paths = {"fp32": PATH}
        info: dict[str, dict[str, Any] | str] = {}
        for i, (name, options) in enumerate(variants.items()):
            paths[name] = work / f"v{i}.onnx"
            info[name] = quantize(options, paths[name])
        for name, figures in list(info.items()):
            if isinstance(figures, str):
                print(f"{name}: {figures}")
                del paths[name]
                continue
            print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in figures.items() if k != "precision"))
            per = [f"{k.split('/')[-2]}@{k.split('/')[-4]}={v}" for k, v in figures["precision"].items()]
            print("  per MatMul: " + ", ".join(per))
        base_bytes = weight_bytes(PATH)
        speed: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in paths}
        for threads in args.threads:
            sessions = {name: session(path, threads) for name, path in paths.items()}
            decode: dict[str, list[float]] = {name: [] for name in paths}
            prefill: dict[str, list[float]] = {name: [] for name in paths}
            names = list(paths)
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
                for name in order:
                    decode[name].append(decode_ms(sessions[name], signature, args.prompt, args.decode_tokens))
                    prefill[name].append(prefill_ms(sessions[name], signature, args.prompt))
            for name in names:
                d, p = statistics.median(decode[name]), statistics.median(prefill[name])
                d0, p0 = statistics.median(decode["fp32"]), statistics.median(prefill["fp32"])
                speed[name][threads] = (d0 / d, p0 / p)
                print(
                    f"threads {threads} {name:9s} decode {d:.3f} ms/token ({d0 / d:.2f}x fp32), prefill@{args.prompt} "
                    f"{p:.3f} ms ({p0 / p:.2f}x), weight bytes {weight_bytes(paths[name])} "
                    f"({weight_bytes(paths[name]) / base_bytes:.3f}x)"
                )
        print(markdown(info, speed, {name: weight_bytes(path) / base_bytes for name, path in paths.items()}))
    return 0


def markdown(
    info: dict[str, dict[str, Any] | str], speed: dict[str, dict[int, tuple[float, float]]], size: dict[str, float]
) -> str:
    rows = [
        "| variant | block / level / head | token table | top-1 (flipped of 1,024) | full int4 top-1 | max logit "
        "diff | perplexity fp32 -> int4 | int4 share of MatMul weights | weights | decode vs fp32 (threads) | "
        "prefill vs fp32 (threads) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, f in info.items():
        if isinstance(f, str):
            rows.append(f"| {name} | {f} |" + " |" * 9)
            continue
        ratios = speed[name]
        rows.append(
            f"| {name} | {f['block']} / {f['level']} / {f['head']} | {f['tables']} | {100 * f['top1']:.2f}% "
            f"({f['flipped']}) | {100 * f['full_top1']:.2f}% ({f['full_flipped']}) | {f['max_logit_diff']:.3g} | "
            f"{f['ppl'][0]:.3f} -> {f['ppl'][1]:.3f} ({100 * (f['ppl'][1] / f['ppl'][0] - 1):+.2f}%) | "
            f"{100 * f['int4_share']:.1f}% | {size[name]:.2f}x | "
            + " / ".join(f"{v[0]:.2f}x ({t})" for t, v in ratios.items())
            + " | "
            + " / ".join(f"{v[1]:.2f}x ({t})" for t, v in ratios.items())
            + " |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
