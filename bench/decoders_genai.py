"""Decoders side by side with onnxruntime-genai's model builder (issue 19): the builder starts from Hugging
Face weights, onnxforge from the ONNX file a team already has; both from the same seeded weights.

Run ``python -m bench.decoders_genai [--families llama qwen2 phi3 mistral] [--dynamo llama] [--threads 1 2]
[--prompts 128 512] [--decode-tokens 32] [--rounds 3] [--copies 3] [--reuse-presets] [--job JSON] [--no-write]``. Needs
the ``bench`` extra (``onnxruntime-genai``, which depends on the same ``onnxruntime`` CPU build as the service) and the
``dev`` extra (torch, transformers).

Per family (a transformers config at a moderate size: 4 layers, hidden 512, 8 heads / 2 KV heads,
intermediate 1536, vocabulary 32000; seeded random weights perturbed as in ``tests/models/build_decoders``):

1. ``save_pretrained`` into ``bench/out/decoders_genai/<family>/hf`` with a word-level tokenizer of the same
   vocabulary (the builder refuses a folder without one; no hub is reached, ``HF_HUB_OFFLINE=1``);
2. the same model exported with a KV cache by ``torch.onnx.export`` (TorchScript, and dynamo for the
   families in ``--dynamo``), each checked against torch (``tests.models.build_decoders.verify``);
3. ``python -m onnxruntime_genai.models.builder -i hf -o ... -p fp32|int4 -e cpu`` with its defaults;
4. onnxforge's ``fast`` and ``int4`` presets on each export through the engine in-process
   (``workers.pipeline.run_pipeline``), as a user sends a job: no samples, the passes' default options, the
   server's default pipeline settings (``--job`` adds job config keys, e.g. the job's own benchmarks off); a
   session recipe in the artifact is applied as ``core.runtime`` applies it (its thread count excepted: the
   row's count is forced).

Variants are fed by role (``core.inputs.graph.analyze``: token ids, attention mask, position ids, past
key/values; the builder's graph has no position ids), with the same token ids: a prompt of the first
``--prompts`` length, then ``--decode-tokens`` fixed tokens (teacher forcing, so every variant decodes the
same sequence whatever its logits), the presents of each call fed back as the next call's past.

* prefill: one call on an empty cache at each ``--prompts`` length (batch 1), ms and tokens/s;
* decode: mean ms per token over the steps (cache growing from the first prompt length), tokens/s;
* accuracy: against the TorchScript export under ``ORT_DISABLE_ALL`` over the prompt and decode positions:
  max |logit difference| and greedy top-1 agreement.

Timing is interleaved: each round runs every variant once, in an order rotated per round; medians over
``--rounds``. Each variant runs as ``--copies`` sessions, loaded round-robin in a rotated order after one
session never timed, round ``r`` using copy ``r mod --copies`` (``bench._copies``: sessions of one file in one
process decode 10-15% apart on the shared host, so one session per variant would let its memory placement pass
for the graph's cost; give ``--rounds`` a multiple of ``--copies`` to use each alike). All sessions of one
thread count and family live in one process at once (llama's 10 variants x 3 copies: about 4.5 GB of weights), freed
before the next. ``results.json`` keeps every round's figures beside the medians. The table goes into
bench/README.md between the ``decoders-genai-table`` markers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402

from bench._copies import load_copies, pick, rotated  # noqa: E402
from bench._report import machine_line, unmarked, write_blocks  # noqa: E402
from bench.decoders import contrib_ops, describe, job_artifact, preset_artifact, session  # noqa: E402
from core.inputs.graph import analyze  # noqa: E402
from passes.precision import _quantization as q  # noqa: E402
from tests.models import build_decoders as bd  # noqa: E402
from workers.benchmark import host_info  # noqa: E402

START, END = "<!-- decoders-genai-table:start -->", "<!-- decoders-genai-table:end -->"
OUT = REPO / "bench" / "out" / "decoders_genai"
_SIZE = {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 2, "intermediate": 1536, "vocab": 32000}
_SIZE["max_positions"] = 2048
FAMILIES: dict[str, bd.Family] = {
    name: replace(bd.FAMILIES[name], **_SIZE) for name in ("llama", "qwen2", "phi3", "mistral")
}
# Mistral's window stays longer than every sequence here, so all variants compute full causal attention.
FAMILIES["mistral"] = replace(FAMILIES["mistral"], extra=(("sliding_window", 4096),))
# The builder reads a Phi-3 whose position table differs from original_max_position_embeddings (4096 by
# default) as LongRoPE and fails without its factors; this one has no rope scaling, so make them equal.
FAMILIES["phi3"] = replace(
    FAMILIES["phi3"], extra=(*FAMILIES["phi3"].extra, ("original_max_position_embeddings", _SIZE["max_positions"]))
)


# onnxforge's variants: the two presets as a user sends them, and the int4 preset's passes with the options the
# builder uses (block 32, accuracy_level 4, every MatMul int4 with the lm_head, embeddings float, nothing kept
# out of int4 for accuracy) and the greedy-token and cosine gates off, so int4 speed is compared like for like.
PRESETS = ("fast", "int4")
MATCHED = "int4 matched"
MATCHED_INT4 = {
    "block_size": 32,
    "accuracy_level": 4,
    "lm_head": "int4",
    "min_top1_agreement": None,
    "min_cosine": -1.0,
    "max_exclusions": 0,
}
# RTN int4 on random weights moves logits to a cosine near 0.97 (the builder's too): the job's tolerance must
# let that through, as a user asking for the builder's int4 would set it.
MATCHED_TOLERANCE = {"atol": 10.0, "rtol": 1.0, "min_cosine": 0.9, "max_mismatch_ratio": 1.0}


def matched_job() -> dict[str, Any]:
    from passes.precision.quantize_int4 import QuantizeInt4Options
    from passes.registry import PRESETS as REGISTRY

    matched = dict(MATCHED_INT4)
    if "embeddings" in QuantizeInt4Options.model_fields:  # the builder's int4 keeps the token table float
        matched["embeddings"] = "float"

    passes: list[Any] = []
    for spec in REGISTRY["int4"].specs:
        name, options = (spec, {}) if isinstance(spec, str) else (spec.name, dict(spec.options))
        if name == "quantize_int4":
            options.update(matched)
        passes.append({"name": name, "options": options})
    return {"passes": passes, "tolerance": MATCHED_TOLERANCE}


def matched_artifact(src: Path, root: Path, reuse: bool, job: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """``MATCHED``'s artifact through the engine as a job, like ``bench.decoders.preset_artifact``."""
    return job_artifact(src, MATCHED, {**job, **matched_job()}, root, reuse)


# ---------------------------------------------------------------------------------------------- building


def hf_folder(family: bd.Family, root: Path) -> Path:
    """The seeded model as Hugging Face weights, with a tokenizer of its vocabulary (ids ``t0``..)."""
    folder = root / "hf"
    if (folder / "tokenizer.json").exists():
        return folder
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bd.causal_lm(family).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(family.vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.save_pretrained(folder)
    return folder


def export(family: bd.Family, exporter: str, root: Path) -> Path:
    """The export with a KV cache from the same weights as ``hf_folder`` (``causal_lm`` is seeded)."""
    path = root / f"{family.name}_past_{exporter}.onnx"
    if path.exists():
        return path
    module = bd.wrap(bd.causal_lm(family), "past")
    proto = bd.export(module, family, "past", exporter, path)
    bd.save(proto, path)
    bd.verify(module, family, "past", path, bd.PAST_CHECKS)
    return path


def genai_builder(hf: Path, precision: str, root: Path) -> tuple[Path, float]:
    out = root / f"genai_{precision}"
    path = out / "model.onnx"
    if path.exists():
        return path, float("nan")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out)]
    cmd += ["-p", precision, "-e", "cpu", "-c", str(root / "genai_cache")]
    t0 = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=False)
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(f"model builder {precision} failed: {proc.stderr.strip()[-2000:]}")
    return path, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ feeding


@dataclass(frozen=True)
class Roles:
    """Which graph input plays which part, and which output feeds each past input on the next call."""

    ids: str
    mask: str | None
    positions: str | None
    past: tuple[tuple[str, str], ...]  # (past input, the present output that feeds it next call)
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, path: Path, kv_heads: int, head_dim: int) -> Roles:
        model = onnx.load(str(path), load_external_data=False)
        roles = analyze(model).roles
        by_role: dict[str, list[str]] = {}
        for name, role in roles.items():
            by_role.setdefault(role.role, []).append(name)
        outputs = {_layer_kind(o.name): o.name for o in model.graph.output if _layer_kind(o.name)}
        past = tuple((name, outputs[_layer_kind(name)]) for name in by_role.get("past_key_values", []))
        return cls(
            by_role["token_ids"][0],
            (by_role.get("attention_mask") or [None])[0],
            (by_role.get("position_ids") or [None])[0],
            past,
            kv_heads,
            head_dim,
        )

    def feeds(self, tokens: np.ndarray, start: int, cache: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        seq = tokens.shape[1]
        feeds = {self.ids: tokens}
        if self.mask:
            feeds[self.mask] = np.ones((1, start + seq), dtype=np.int64)
        if self.positions:
            feeds[self.positions] = np.arange(start, start + seq, dtype=np.int64)[None, :]
        for name, _ in self.past:
            empty = np.zeros((1, self.kv_heads, 0, self.head_dim), dtype=np.float32)
            feeds[name] = cache[name] if cache is not None else empty
        return feeds

    def next_cache(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: outputs[present] for name, present in self.past}


def _layer_kind(name: str) -> tuple[int, str] | None:
    """(layer, key|value) of a cache tensor's name: ``past_key_values.3.key``, ``present.3.value``, ..."""
    match = re.search(r"(\d+)\D*?(key|value)", name)
    return (int(match.group(1)), match.group(2)) if match else None


@dataclass
class Variant:
    key: str
    path: Path
    roles: Roles
    session: Any = None


def _run(v: Variant, tokens: np.ndarray, start: int, cache: dict | None) -> dict[str, np.ndarray]:
    names = [o.name for o in v.session.get_outputs()]
    return dict(zip(names, v.session.run(names, v.roles.feeds(tokens, start, cache)), strict=True))


def prefill_ms(v: Variant, tokens: np.ndarray) -> float:
    t0 = time.perf_counter()
    _run(v, tokens, 0, None)
    return (time.perf_counter() - t0) * 1e3


def decode(v: Variant, prompt: np.ndarray, steps: np.ndarray, keep: bool = False) -> tuple[float, np.ndarray | None]:
    """Mean ms per token over ``steps`` teacher-forced tokens after ``prompt``; with ``keep``, the logits of
    every prompt and decode position ([positions, vocab])."""
    out = _run(v, prompt, 0, None)
    logits = [out["logits"][0]] if keep else []
    elapsed = 0.0
    for i in range(steps.shape[1]):
        cache = v.roles.next_cache(out)
        t0 = time.perf_counter()
        out = _run(v, steps[:, i : i + 1], prompt.shape[1] + i, cache)
        elapsed += time.perf_counter() - t0
        if keep:
            logits.append(out["logits"][0])
    return elapsed * 1e3 / steps.shape[1], (np.concatenate(logits) if keep else None)


# ------------------------------------------------------------------------------------------------ running


def build_family(name: str, args: argparse.Namespace) -> tuple[list[Variant], list[str]]:
    family = FAMILIES[name]
    root = OUT / name
    root.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    hf = hf_folder(family, root)
    exporters = ["ts", "dynamo"] if name in args.dynamo else ["ts"]
    sources: dict[str, Path] = {}
    for exporter in exporters:
        sources[exporter] = export(family, exporter, root)
    made: dict[str, Path] = {}
    for exporter, src in sources.items():
        made[f"{exporter}"] = src
        for preset in (*PRESETS, MATCHED):
            reuse = args.reuse_presets or preset in args.reuse
            if preset == MATCHED:
                path, info = matched_artifact(src, root, reuse, args.job)
            else:
                path, info = preset_artifact(src, preset, root, reuse, job=args.job)
            made[f"{exporter}:{preset}"] = path
            note = describe(preset, info).replace("preset:", "job:" if preset == MATCHED else "preset:")
            if preset != "fast" and "applied" in info and "quantize_int4" not in info["applied"]:
                note += " (quantize_int4 not applied: the job's report says why)"
            notes.append(f"{exporter} export, {note}")
            print(f"{name}: {notes[-1]}", flush=True)
    for precision in ("fp32", "int4"):
        path, seconds = genai_builder(hf, precision, root)
        made[f"genai:{precision}"] = path
        print(f"{name} builder {precision}: {path} ({seconds:.0f}s)", flush=True)
    for key in ("genai:fp32", "genai:int4"):
        ops = ", ".join(f"{k} {v}" for k, v in sorted(contrib_ops(made[key]).items()))
        nodes = len(onnx.load(str(made[key]), load_external_data=False).graph.node)
        notes.append(f"builder {key.split(':')[1]}: {nodes} nodes; ORT ops {ops}")
    variants = [Variant(k, p, Roles.of(p, family.kv_heads, family.head_dim)) for k, p in made.items()]
    return variants, notes


def measure(
    family: bd.Family, variants: list[Variant], args: argparse.Namespace
) -> tuple[dict[int, dict[str, dict]], dict[int, dict[str, dict[str, list[float]]]]]:
    """Per thread count, each variant's medians and accuracy, and every round's figures (the run's spread)."""
    rng = np.random.default_rng(0)
    prompts = {p: rng.integers(0, family.vocab, size=(1, p), dtype=np.int64) for p in args.prompts}
    steps = rng.integers(0, family.vocab, size=(1, args.decode_tokens), dtype=np.int64)
    first = prompts[args.prompts[0]]
    reference = Variant("ref", variants[0].path, variants[0].roles, session(variants[0].path, 2, optimize=False))
    _, ref_logits = decode(reference, first, steps, keep=True)
    del reference
    accuracy = {}
    results: dict[int, dict[str, dict]] = {}
    rounds: dict[int, dict[str, dict[str, list[float]]]] = {}
    for threads in args.threads:
        # ``--copies`` sessions per variant, used in turn, after one never timed (bench._copies says why).
        ballast, copies = load_copies(variants, args.copies, lambda v, t=threads: session(v.path, t))
        for v, copies_of in zip(variants, copies, strict=True):
            for sess in copies_of:
                v.session = sess
                decode(v, first, steps[:, :2])  # warm-up outside the timings
            if threads == args.threads[0]:  # every copy runs the same graph: one answers for accuracy
                _, logits = decode(v, first, steps, keep=True)
                assert logits is not None and ref_logits is not None
                accuracy[v.key] = {
                    "max_abs": float(np.max(np.abs(logits - ref_logits))),
                    "top1": float(np.mean(logits.argmax(-1) == ref_logits.argmax(-1))),
                }
        timings: dict[str, dict[str, list[float]]] = {v.key: {} for v in variants}
        for rnd in range(args.rounds):
            for k in rotated(range(len(variants)), rnd):
                v = variants[k]
                v.session = pick(copies[k], rnd)
                for p, tokens in prompts.items():
                    timings[v.key].setdefault(f"prefill{p}", []).append(prefill_ms(v, tokens))
                timings[v.key].setdefault("decode", []).append(decode(v, first, steps)[0])
        results[threads] = {
            k: {m: statistics.median(x) for m, x in t.items()} | accuracy[k] for k, t in timings.items()
        }
        rounds[threads] = timings
        for k, m in results[threads].items():
            print(f"{threads} threads {k}: {m}", flush=True)
        for v in variants:
            v.session = None
        del ballast, copies
        gc.collect()  # the next thread count's sessions load into the memory these leave
    return results, rounds


LABEL = {"ts": "export (TorchScript), ORT default", "dynamo": "export (dynamo), ORT default"}


def _label(key: str) -> str:
    if key in LABEL:
        return LABEL[key]
    source, what = key.split(":")
    if source == "genai":
        return f"**builder {what}**"
    what = "`int4` passes, builder's options, gates off," if what == MATCHED else f"`{what}`"
    return f"onnxforge {what} of the {'TorchScript' if source == 'ts' else 'dynamo'} export"


def rows_for(
    name: str, results: dict[int, dict[str, dict]], sizes: dict[str, int], args: argparse.Namespace
) -> list[str]:
    rows = []
    for threads, medians in results.items():
        base = medians["ts"]
        for key, m in medians.items():
            prefill = " / ".join(f"{p * 1e3 / m[f'prefill{p}']:.0f}" for p in args.prompts)
            ratio_p = base[f"prefill{args.prompts[0]}"] / m[f"prefill{args.prompts[0]}"]
            rows.append(
                f"| {name} | {threads} | {_label(key)} | {prefill} | {ratio_p:.2f}x | {m['decode']:.2f} | "
                f"{1e3 / m['decode']:.0f} | {base['decode'] / m['decode']:.2f}x | {m['max_abs']:.1e} / "
                f"{m['top1'] * 100:.0f}% | {sizes[key] / 1e6:.0f} MB |"
            )
    return rows


def run_family(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build, measure and save one family's results (``results.json``), so families can run one at a time."""
    variants, notes = build_family(name, args)
    sizes = {v.key: q.tensor_bytes(onnx.load(str(v.path), load_external_data=True)) for v in variants}
    results, rounds = measure(FAMILIES[name], variants, args)
    saved = {
        "family": name,
        "command": "python -m bench.decoders_genai " + shlex.join(sys.argv[1:]),
        "written": time.strftime("%Y-%m-%d %H:%M %Z"),
        "load": " / ".join(f"{x:.1f}" for x in os.getloadavg()),
        "prompts": args.prompts,
        "decode_tokens": args.decode_tokens,
        "rounds": args.rounds,
        "copies": args.copies,
        "results": {str(t): r for t, r in results.items()},
        "per_round_ms": {str(t): r for t, r in rounds.items()},
        "sizes": sizes,
        "notes": notes,
    }
    (OUT / name / "results.json").write_text(json.dumps(saved, indent=1))
    return saved


def render() -> str:
    """The README block from every family's saved results (each family says when and how it was run)."""
    saved = {
        n: json.loads((OUT / n / "results.json").read_text()) for n in FAMILIES if (OUT / n / "results.json").exists()
    }
    kept_rows, kept_notes = _published(set(FAMILIES) - set(saved))
    rows: list[str] = []
    notes: list[str] = []
    for name in FAMILIES:
        if name not in saved:  # not run on this checkout: its published rows stay, with their own note
            rows += kept_rows.get(name, [])
            notes += kept_notes.get(name, [])
            continue
        s = saved[name]
        args = argparse.Namespace(prompts=s["prompts"])
        results = {int(t): r for t, r in s["results"].items()}
        rows += rows_for(s["family"], results, s["sizes"], args)
        notes.append(
            f"* {s['family']}: `{s['command'].strip()}` at {s['written']}, load average {s['load']}; "
            f"decode {s['decode_tokens']} tokens, {s['rounds']} rounds, {s.get('copies', 1)} session(s) per "
            "variant. " + "; ".join(s["notes"]) + "."
        )
    saved_list = list(saved.values())
    size = FAMILIES["llama"]
    prompts = " / ".join(str(p) for p in (saved_list[0]["prompts"] if saved_list else [128, 512]))
    header = [
        "## Decoders vs onnxruntime-genai's model builder (issue 19)",
        "",
        f"`python -m bench.decoders_genai`: {size.layers} layers, hidden {size.hidden}, {size.heads} heads / "
        f"{size.kv_heads} KV heads, intermediate {size.intermediate}, vocabulary {size.vocab}, seeded random "
        "weights; batch 1; decode: teacher-forced tokens after a prompt of the first prefill length (the cache "
        "growing from it); medians of interleaved rounds, each variant's sessions used in turn; intra-op threads "
        "as in the table, inter-op 1; ratios against the TorchScript export under ORT's default level, from the "
        "same run. Accuracy against that export under `ORT_DISABLE_ALL` over the prompt and decode positions "
        "(first thread count).",
        "",
        machine_line(host_info(target="cpu", intra_op_threads=0)),
        "",
        f"| family | threads | variant | prefill tokens/s ({prompts}) | prefill vs export | decode ms/token | "
        "decode tokens/s | decode vs export | max abs logit diff / top-1 | weights |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    return "\n".join([*header, *rows, "", "How each family was run and what each variant is:", "", *notes])


def _published(families: set[str]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The table rows and run notes bench/README.md holds for ``families``: a checkout whose ``bench/out`` lacks
    a family's results (a fresh clone, or one family re-run) keeps what was published for it."""
    from bench._report import README

    text = README.read_text(encoding="utf-8") if README.exists() else ""
    block = text.split(START, 1)[1].split(END, 1)[0] if START in text and END in text else ""
    rows: dict[str, list[str]] = {}
    notes: dict[str, list[str]] = {}
    for line in block.splitlines():
        for name in families:
            if line.startswith(f"| {name} |"):
                rows.setdefault(name, []).append(line)
            elif line.startswith(f"* {name}:"):
                notes.setdefault(name, []).append(line)
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decoders_genai", description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--dynamo", nargs="*", default=["llama"], help="families also exported by dynamo")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--prompts", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--copies", type=int, default=3, help="sessions per variant, loaded round-robin, one per round in turn"
    )
    parser.add_argument("--reuse-presets", action="store_true", help="keep preset artifacts already built")
    parser.add_argument(
        "--reuse", nargs="*", default=[], choices=[*PRESETS, MATCHED], help="keep these variants' artifacts"
    )
    parser.add_argument("--build-only", action="store_true", help="build every artifact, measure nothing")
    parser.add_argument(
        "--job",
        type=json.loads,
        default={},
        help="JSON job config keys for the preset jobs, e.g. '{\"benchmark\": false}' (this script measures)",
    )
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--render-only", action="store_true", help="write the table from the saved results only")
    args = parser.parse_args(argv)
    for name in [] if args.render_only else args.families:
        if args.build_only:
            build_family(name, args)
            continue
        run_family(name, args)
    if args.build_only:
        return 0
    table = render()
    print(unmarked(table, START, END))
    if not args.no_write:
        write_blocks({(START, END): table}, heading="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
