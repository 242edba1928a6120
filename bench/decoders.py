"""Decoder benchmark: the uploaded fp32 decoder against onnxforge's ``int4`` and ``fast`` presets (and the
``quantize_int4`` pass alone), side by side, on ORT's CPU EP at its default level (what users run).

Run ``python -m bench.decoders [--models NAME ...] [--qwen05] [--threads 1 2] [--decode-tokens 32]
[--prompts 32 128] [--rounds 3] [--presets NAME ...] [--preset-variants fast int4 ...] [--reuse] [--no-write]``.

Models: the committed corpus decoders with a cache (``tests/models/decoders/<family>_past_ts.onnx``, tiny,
random weights), the trained tiny Llama, and with ``--qwen05`` a decoder shaped like Qwen2.5-0.5B (24
layers, hidden 896, 14/2 heads, intermediate 4864, vocabulary 151936, tied embeddings, random weights; built
by ``tests.models.build_decoders --qwen05`` into ``bench/out/decoders/``, never committed, never in CI).
Per model, thread count and variant:

* prefill: latency of one call on an empty cache at each ``--prompts`` length (batch 1);
* decode: ``--decode-tokens`` greedy steps after a prefill of the first prompt length, each feeding the
  previous step's presents (the cache grows by one per step): mean latency per token and tokens/s;
* weight bytes: the initializers' bytes.

Variants: ``fp32`` (the upload); ``int4 pass``: the ``quantize_int4`` pass with its defaults, its samples the
prefill and decode feeds, the greedy-token gate off (meaningless on random weights); for the models in
``--presets`` (default: the corpus Llama and qwen05), the ``fast`` and ``int4`` presets' artifacts from the
engine in-process (``workers.pipeline.run_pipeline``), as a user sends the job: no samples, default options;
the passes are whatever the presets list when the script runs. They are timed interleaved: every round runs
each variant once, in an order that rotates per round; medians over rounds. The rows go into bench/README.md
between the ``decoders-table`` markers, replacing the rows of the models this run measured and keeping the
others.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402
import onnx_ir as ir  # noqa: E402
import onnxruntime as ort  # noqa: E402

from bench._report import README, machine_line, write_blocks  # noqa: E402
from core.recipe import read_recipe  # noqa: E402
from passes._infra import PassContext  # noqa: E402
from passes.precision import _quantization as q  # noqa: E402
from passes.precision.quantize_int4 import QuantizeInt4  # noqa: E402
from tests.models.build_decoders import OUT, Signature, build_qwen05, decoder_feeds, presents_as_past  # noqa: E402
from workers.benchmark import host_info  # noqa: E402
from workers.sessions import make_session  # noqa: E402

START, END = "<!-- decoders-table:start -->", "<!-- decoders-table:end -->"
HEADING = "## Decoders: fp32 against int4 (issue 19)"
CORPUS = ("llama", "qwen2", "phi3", "mistral", "gpt2", "trained_llama")
QWEN_DIR = REPO / "bench" / "out" / "decoders"
ARTIFACTS = REPO / "bench" / "out" / "decoders-artifacts"  # --reuse: kept between runs (qwen05: minutes each)
NOTE = (
    "Tiny decoders (hidden 32-64, 2 layers): per-op overhead and the shared machine's load dominate, so these rows "
    "check the harness and the int4 pass end to end, not int4's gain; the Qwen2.5-0.5B-shaped rows (`qwen05`) "
    "measure it."
)


def model_path(name: str) -> Path:
    return build_qwen05(QWEN_DIR) if name == "qwen05" else OUT / f"{name}_past_ts.onnx"


def session(path: Path, threads: int, *, optimize: bool = True) -> ort.InferenceSession:
    """The session users get (ORT's default level; a ``tune_session`` recipe in the model applied as
    ``core.runtime`` applies it), at ``threads`` intra-op threads: the comparison's variable, not the recipe's."""
    recipe = read_recipe(path)
    if recipe:
        options = {k: v for k, v in (recipe.get("session_options") or {}).items() if not k.endswith("_num_threads")}
        recipe = {**recipe, "session_options": options}
    return make_session(path, intra_op_threads=threads, optimize=optimize, recipe=recipe)


def prefill_ms(sess: ort.InferenceSession, signature: Signature, prompt: int) -> float:
    feeds = decoder_feeds(signature, 1, prompt, 0, seed=prompt)
    t0 = time.perf_counter()
    sess.run(None, feeds)
    return (time.perf_counter() - t0) * 1e3


def decode_ms(sess: ort.InferenceSession, signature: Signature, prompt: int, tokens: int) -> float:
    """Mean latency per generated token over ``tokens`` greedy steps after a prefill of ``prompt``."""
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(names, decoder_feeds(signature, 1, prompt, 0, seed=1)), strict=True))
    t0 = time.perf_counter()
    for step in range(tokens):
        nxt = out["logits"][:, -1:].argmax(-1).astype(np.int64)
        feeds = decoder_feeds(signature, 1, 1, prompt + step, tokens=nxt, past_values=presents_as_past(out))
        out = dict(zip(names, sess.run(names, feeds), strict=True))
    return (time.perf_counter() - t0) * 1e3 / tokens


def make_int4(
    path: Path,
    signature: Signature,
    prompts: list[int],
    work: Path,
    extra: dict[str, Any] | None = None,
    *,
    reuse: bool = False,
    preset_passes: bool = False,
) -> tuple[Path, dict[str, Any]]:
    """The int4 pass on ``path`` (``preset_passes``: the ``int4`` preset's passes in order, each applied where it
    changes the model, without the pipeline's per-pass verification and timing), its artifact and figures."""
    out = work / f"{path.stem}.{'int4_passes' if preset_passes else 'int4'}.onnx"
    saved = out.with_suffix(".json")
    if reuse and out.exists() and saved.exists() and json.loads(saved.read_text())["options"] == (extra or {}):
        return out, {**json.loads(saved.read_text())["info"], "reused": True}
    samples = [decoder_feeds(signature, 1, prompts[0], 0, seed=3), decoder_feeds(signature, 1, 1, prompts[0], seed=4)]
    # In memory: the pass hands tensors to ORT's quantizer, which resolves external-data paths from the cwd.
    model = ir.external_data.load_to_model(ir.load(path))
    t0 = time.perf_counter()
    # Random weights and random tokens: near-tied logits make the greedy-token gate meaningless here (it is
    # tested on the trained decoder); the loop keeps float, as the "float_kept" column says.
    options = {"max_samples": 2, "min_top1_agreement": None, "sensitive_as": "float", **(extra or {})}
    ctx = PassContext(samples=samples)
    applied = []
    if preset_passes:
        from passes.registry import PRESETS, build_passes

        specs = list(PRESETS["int4"].specs)
        for before in build_passes(specs[: [s.name for s in specs].index("quantize_int4")]):
            step = before(model, ctx)
            if step.modified:
                model, applied = step.model, [*applied, before.name]
    result = QuantizeInt4(options)(model, ctx)
    seconds = time.perf_counter() - t0
    if not result.modified:
        raise RuntimeError(f"quantize_int4 refused {path.name}: {[m.reason for m in result.non_matches]}")
    proto = ir.serde.serialize_model(result.model)
    q.save_proto(proto, out, q.tensor_bytes(proto) > q.EXTERNAL_DATA_BYTES)
    notes = result.notes
    info = {
        "seconds": seconds,
        "applied_before": applied,
        "block": notes["block_size"]["chosen"],
        "level": notes["accuracy_level"]["chosen"],
        "head": notes.get("lm_head_decision", "float").split(":")[0],
        "float_kept": result.counts.get("nodes_excluded_for_accuracy", 0),
        "tables": tables_summary(notes.get("embeddings", {})),
    }
    saved.write_text(json.dumps({"options": extra or {}, "info": info}))
    return out, info


def tables_summary(entry: dict[str, Any]) -> str:
    """The token tables' fate in a few words: ``int8 (shared with the lm_head)``, ``float``..."""
    decision = entry.get("decision", "float")
    if not entry.get("tables") or decision.startswith(("float", "none")):
        return decision.split(":")[0]
    return ", ".join(
        f"int{t['bits']}" + (" (shared with the lm_head)" if t["shared_with"] else "") for t in entry["tables"]
    )


def preset_artifact(
    src: Path, preset: str, root: Path, reuse: bool = False, job: dict[str, Any] | None = None
) -> tuple[Path, dict[str, Any]]:
    """The artifact of ``preset`` (a ``PRESET_VARIANTS`` entry) from ``run_pipeline``, in-process, as the CLI
    and the service call it: no samples, the passes' default options (plus ``job``'s keys), the server's
    default pipeline settings. The passes are whatever the preset lists when the script runs."""
    return job_artifact(src, preset, {**(job or {}), **job_of(preset)}, root, reuse)


def job_artifact(
    src: Path, label: str, config: dict[str, Any], root: Path, reuse: bool = False
) -> tuple[Path, dict[str, Any]]:
    """The artifact of a job with ``config`` (the API's JSON) through ``run_pipeline``, in-process, into
    ``root/<src stem>.<label>``; with ``reuse``, the one already there."""
    from core.config import JobConfig
    from core.settings import get_settings
    from workers.pipeline import PipelineRequest, run_pipeline

    out = root / f"{src.stem}.{label.replace(' ', '_')}"
    model = out / "model.onnx"
    if reuse and model.exists():
        return model, {"job_s": float("nan"), "reused": True, "ops": contrib_ops(model)}
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    result = run_pipeline(
        PipelineRequest(
            model_path=src, output_dir=out, config=JobConfig.parse(config), settings=get_settings().pipeline
        )
    )
    passes = result.report.get("passes", [])
    return Path(result.model_path), {
        "job_s": time.perf_counter() - t0,
        "used_original": result.used_original,
        "applied": [p["name"] for p in passes if p.get("status") == "applied"],
        "ops": contrib_ops(Path(result.model_path)),
    }


PRESET_VARIANTS = ("fast", "int4", "int4 gate off")


def job_of(variant: str) -> dict[str, Any]:
    """The job config of a preset variant. ``int4 gate off``: the int4 preset's passes as the registry lists
    them now, with quantize_int4's greedy-token gate off and the preset's tolerance. On random weights the
    logits are near-tied, so greedy tokens flip at any precision and the gate refuses int4 outright (the
    trained decoder is where it is measured); this is what such a user would send."""
    if variant != "int4 gate off":
        return {"preset": variant}
    from passes.registry import PRESETS

    preset = PRESETS["int4"]
    passes = []
    for spec in preset.specs:
        name, options = (spec, {}) if isinstance(spec, str) else (spec.name, dict(spec.options))
        if name == "quantize_int4":
            options["min_top1_agreement"] = None
        passes.append({"name": name, "options": options})
    return {"passes": passes, "tolerance": preset.tolerance.model_dump()}


def contrib_ops(path: Path) -> dict[str, int]:
    """How many nodes of each ORT-only op a model has (what the fusions and int4 left in the graph): the
    com.microsoft ops and those ORT registers in the ONNX domain (SimplifiedLayerNormalization)."""
    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.domain not in ("", "ai.onnx") or not onnx.defs.has(node.op_type):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def describe(preset: str, info: dict[str, Any]) -> str:
    ops = ", ".join(f"{k} {v}" for k, v in sorted(info["ops"].items())) or "none"
    state = "reused" if info.get("reused") else f"job {info['job_s']:.0f}s"
    gate = ", the upload handed back (gate)" if info.get("used_original") else ""
    return f"`{preset}` preset: {state}{gate}; ORT ops {ops}"


def weight_bytes(path: Path) -> int:
    return q.tensor_bytes(onnx.load(str(path), load_external_data=True))


def measure(variants: dict[str, Path], signature: Signature, args: argparse.Namespace, threads: int) -> dict:
    sessions = {name: session(path, threads) for name, path in variants.items()}
    for sess in sessions.values():  # warm-up: allocations and kernel selection outside the timings
        prefill_ms(sess, signature, args.prompts[0])
        decode_ms(sess, signature, args.prompts[0], 2)
    timings: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    order = list(variants)
    for rnd in range(args.rounds):
        for name in order[rnd % len(order) :] + order[: rnd % len(order)]:
            sess = sessions[name]
            for prompt in args.prompts:
                timings[name].setdefault(f"prefill{prompt}", []).append(prefill_ms(sess, signature, prompt))
            timings[name].setdefault("decode", []).append(
                decode_ms(sess, signature, args.prompts[0], args.decode_tokens)
            )
    return {name: {k: statistics.median(v) for k, v in t.items()} for name, t in timings.items()}


LABELS = {
    "fp32": "fp32 (upload)",
    "int4 pass": "int4 pass (gate off)",
    "fast": "`fast` preset",
    "int4": "`int4` preset",
    "int4 gate off": "`int4` passes, greedy gate off",
    "int4 passes": "`int4` preset's passes, no ledger",
}


def run(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Table rows and one run note per model."""
    rows: list[str] = []
    notes: list[str] = []
    env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("ONNXFORGE_PIPELINE__")]
    command = " ".join([*env, "python -m bench.decoders", shlex.join(sys.argv[1:])])
    QWEN_DIR.parent.mkdir(parents=True, exist_ok=True)  # the 2 GB qwen05 artifacts: on the repo's disk, not /tmp
    with tempfile.TemporaryDirectory(prefix="onnxforge-bench-decoders-", dir=QWEN_DIR.parent) as tmp:
        work = ARTIFACTS if args.reuse else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in args.models:
            path = model_path(name)
            signature = Signature.of(path)
            variants = {"fp32": path}
            details = []
            if not args.no_int4_pass:
                int4, info = make_int4(path, signature, args.prompts, work, args.int4_options, reuse=args.reuse)
                variants["int4 pass"] = int4
                given = f" {json.dumps(args.int4_options)}" if args.int4_options else ""
                details.append(
                    f"int4 pass{given}: block {info.get('block', '?')}, accuracy_level {info['level']}, lm_head "
                    f"{info['head']}, token tables {info.get('tables', 'float')}, {info['float_kept']} MatMul(s) kept "
                    "float, " + ("reused" if info.get("reused") else f"{info['seconds']:.1f}s")
                )
            if name in args.presets and args.int4_passes:
                int4, info = make_int4(
                    path, signature, args.prompts, work, args.int4_options, reuse=args.reuse, preset_passes=True
                )
                variants["int4 passes"] = int4
                given = f" {json.dumps(args.int4_options)}" if args.int4_options else ""
                details.append(
                    f"int4 preset's passes{given}: applied {', '.join(info.get('applied_before', []))} before it; "
                    f"block {info['block']}, accuracy_level {info['level']}, lm_head {info['head']}, token tables "
                    f"{info['tables']}, " + ("reused" if info.get("reused") else f"{info['seconds']:.1f}s")
                )
            if name in args.presets:
                for preset in args.preset_variants:
                    variants[preset], preset_info = preset_artifact(path, preset, work, args.reuse, job=args.job)
                    details.append(describe(preset, preset_info))
            print(f"{name}: " + "; ".join(details), flush=True)
            sizes = {v: weight_bytes(p) for v, p in variants.items()}
            for threads in args.threads:
                medians = measure(variants, signature, args, threads)
                base = medians["fp32"]
                for variant, m in medians.items():
                    prefill = " / ".join(f"{p}: {m[f'prefill{p}']:.1f}" for p in args.prompts)
                    ratio = " / ".join(f"{base[f'prefill{p}'] / m[f'prefill{p}']:.2f}x" for p in args.prompts)
                    rows.append(
                        f"| {name} | {threads} | {LABELS[variant]} | {prefill} | {ratio} | {m['decode']:.2f} | "
                        f"{1e3 / m['decode']:.1f} | {base['decode'] / m['decode']:.2f}x | "
                        f"{sizes[variant] / 1e6:.1f} MB ({sizes[variant] / sizes['fp32']:.2f}x) |"
                    )
                    print(rows[-1], flush=True)
            load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
            notes.append(
                f"* {name}: `{command.strip()}` at {time.strftime('%Y-%m-%d %H:%M %Z')}, load average {load}; "
                f"decode {args.decode_tokens} tokens after {args.prompts[0]}, {args.rounds} rounds. "
                + "; ".join(details)
                + "."
            )
    return rows, notes


def merge(rows: list[str], notes: list[str], models: list[str], old_block: str) -> str:
    """The block: this run's rows and notes, plus the earlier ones of the models this run did not measure."""

    def model_of(line: str) -> str:
        return line.split("|")[1].strip() if line.startswith("|") else line[2:].split(":", maxsplit=1)[0]

    old = old_block.splitlines()
    # Rows of another column layout (an older version of this script) are stale: dropped.
    kept_rows = [
        r for r in old if r.startswith("| ") and r.count("|") == 10 and model_of(r) not in ("model", "---", *models)
    ]
    kept_notes = [n for n in old if n.startswith("* ") and model_of(n) not in models]
    header = [
        HEADING,
        "",
        "`python -m bench.decoders` (batch 1; ORT default level; intra-op threads as in the table, inter-op 1; "
        "decode: greedy tokens after a prompt, cache growing; medians of interleaved rounds; ratios against the "
        "upload in the same run). Each model's command, time and load average are in the notes below the table.",
        "",
        machine_line(host_info(target="cpu", intra_op_threads=0)),
        "",
        NOTE,
        "",
        "| model | threads | variant | prefill ms (prompt: ms) | prefill vs fp32 | decode ms/token | tokens/s | "
        "decode vs fp32 | weights |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = {m: i for i, m in enumerate([*CORPUS, "qwen05"])}
    all_rows = sorted([*kept_rows, *rows], key=lambda r: order.get(model_of(r), len(order)))
    all_notes = sorted([*kept_notes, *notes], key=lambda n: order.get(model_of(n), len(order)))
    return "\n".join([*header, *all_rows, "", *all_notes])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decoders", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CORPUS), choices=[*CORPUS, "qwen05"])
    parser.add_argument("--qwen05", action="store_true", help="add the Qwen2.5-0.5B-shaped decoder")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--prompts", nargs="+", type=int, default=[32, 128])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--presets",
        nargs="*",
        default=["llama", "qwen05"],
        help="models whose fast and int4 preset artifacts (a pipeline job each, minutes) join the table",
    )
    parser.add_argument("--preset-variants", nargs="+", default=list(PRESET_VARIANTS), choices=PRESET_VARIANTS)
    parser.add_argument("--no-int4-pass", action="store_true", help="leave out the quantize_int4 pass alone")
    parser.add_argument(
        "--int4-passes",
        action="store_true",
        help="for the --presets models, add the int4 preset's passes run in order in-process (the fusions, then "
        "quantize_int4 with the pass's options), without the pipeline's per-pass verification and timing",
    )
    parser.add_argument(
        "--int4-options",
        type=json.loads,
        default={},
        help="JSON options of the int4 pass over the script's own; qwen05: its 'auto' block size, accuracy level "
        "and lm_head copy the model through one serialized proto, which fails over protobuf's 2 GB",
    )
    parser.add_argument(
        "--job",
        type=json.loads,
        default={},
        help="JSON job config keys for the preset jobs, e.g. '{\"benchmark\": false}' (this script measures)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help=f"keep the int4 pass's and the presets' artifacts in {ARTIFACTS.relative_to(REPO)} and reuse them "
        "(the int4 pass's when its options match)",
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.qwen05 and "qwen05" not in args.models:
        args.models.append("qwen05")
    rows, notes = run(args)
    text = README.read_text(encoding="utf-8")
    old = text.split(START, 1)[1].split(END, 1)[0] if START in text and END in text else ""
    table = merge(rows, notes, args.models, old)
    print(table)
    if not args.no_write:
        write_blocks({(START, END): table}, heading="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
