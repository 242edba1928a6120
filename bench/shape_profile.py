"""Benchmark of ``shape_profile`` (issue 10 item 4): MiniLM with dynamic batch and sequence.

Run ``python -m bench.shape_profile [--pass-repeats N] [--repeats N] [--calls N] [--reuse] [--no-write]``.

1. **Profile.** The ``shape_profile`` pass runs on the bench MiniLM (``bench/models.py``, 6 layers, hidden
   384, inputs ``[batch, sequence]``) with no samples, so the trace sizes come from the defaults: batch
   1/2/4/8 weighted to 1, sequence log-uniform over 8..512 (the position table's 512). It measures every
   CPU candidate in fresh processes (``--pass-repeats`` rounds, interleaved) and writes the winner into the
   artifact's ``onnxforge.session``.
2. **Check.** On a *different* 40-call random-size trace (seed ``--seed + 1``), ORT's default session on
   the original model and ``core.runtime.load`` on the artifact (recipe and warm-up applied) each
   replay the trace in a fresh process (``python -m core.runtime --measure``), ``--repeats`` times,
   alternating which goes first. Reported: peak RSS of the process (``ru_maxrss``; the process holds
   numpy and onnxruntime and the trace, the same for both), trace time (sum of the 40 call latencies, the
   warm-up not included), the median of the per-round trace-time ratios, first-call latency and spikes.

Writes ``bench/out/shape_profile/`` (artifact, notes, raw runs; not committed), the plot
``bench/shape_profile.svg`` (latency per call with spikes marked; peak memory per setting) and the table
into ``bench/README.md`` between the ``shape-profile-table`` markers (``--no-write`` to skip both).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from bench._report import write_blocks
from bench.models import ensure_bench_model
from core.inputs import InputSynthesis
from passes._infra import PassContext
from passes.session.shape_profile import ShapeProfile, _dim_plan, _draw, _spikes, run_child

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "shape_profile"
SVG = ROOT / "bench" / "shape_profile.svg"
START, END = "<!-- shape-profile-table:start -->", "<!-- shape-profile-table:end -->"


def _trace(model: ir.Model, calls: int, seed: int, path: Path) -> list[dict[str, int]]:
    synthesis = InputSynthesis(model, seed=seed)
    dims = _dim_plan(synthesis, synthesis.free_dims(), ShapeProfile.Options(), [], synthesis.facts.max_positions)
    rng = np.random.default_rng(seed)
    trace = [_draw(dims, rng) for _ in range(calls)]
    feeds = [synthesis.feeds_for_sizes(sizes, rng) for sizes in trace]
    np.savez(path, **{f"{i}/{k}": v for i, feed in enumerate(feeds) for k, v in feed.items()})
    return trace


def _svg(notes: dict[str, Any], check: dict[str, Any]) -> str:
    """Two panels: latency per call of the check trace (default vs recipe, spikes ringed) and peak RSS per
    setting (the pass's candidates, then the check's default and recipe)."""
    w, h, pad = 760, 560, 56
    top_h = 250
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
    ]
    series = check["series"]
    calls = len(series[0]["latency_ms"])
    ymax = max(max(s["latency_ms"]) for s in series) * 1.05
    x0, y0, pw, ph = pad, 30, w - pad - 20, top_h - 50

    def px(i: int) -> float:
        return x0 + pw * (i + 0.5) / calls

    def py(v: float) -> float:
        return y0 + ph - ph * v / ymax

    out.append(f'<text x="{x0}" y="18" font-weight="bold">Latency per call, 40-call random-size trace '
               "(median of the runs; ringed: spikes)</text>")  # fmt: skip
    out.append(f'<line x1="{x0}" y1="{y0 + ph}" x2="{x0 + pw}" y2="{y0 + ph}" stroke="#333"/>')
    out.append(f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 + ph}" stroke="#333"/>')
    for k in range(5):
        v = ymax * k / 4
        out.append(f'<text x="{x0 - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
        out.append(f'<line x1="{x0}" y1="{py(v):.1f}" x2="{x0 + pw}" y2="{py(v):.1f}" stroke="#eee"/>')
    out.append(f'<text x="14" y="{y0 + ph / 2}" transform="rotate(-90 14 {y0 + ph / 2})">ms</text>')
    for i in range(0, calls, 5):
        out.append(f'<text x="{px(i):.1f}" y="{y0 + ph + 14}" text-anchor="middle">{i}</text>')
    out.append(f'<text x="{x0 + pw / 2}" y="{y0 + ph + 28}" text-anchor="middle">call</text>')
    colors = {"default": "#888", "recipe": "#c33"}
    for s in series:
        color = colors[s["name"]]
        points = " ".join(f"{px(i):.1f},{py(v):.1f}" for i, v in enumerate(s["latency_ms"]))
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for i in s["spikes"]:
            out.append(
                f'<circle cx="{px(i):.1f}" cy="{py(s["latency_ms"][i]):.1f}" r="5" fill="none" '
                f'stroke="{color}" stroke-width="2"/>'
            )
    for k, s in enumerate(series):
        lx = x0 + pw - 230 + k * 120
        out.append(f'<line x1="{lx}" y1="{y0 + 6}" x2="{lx + 20}" y2="{y0 + 6}" stroke="{colors[s["name"]]}" '
                   'stroke-width="2"/>')  # fmt: skip
        label = "ORT default" if s["name"] == "default" else f"recipe ({check['recipe_name']})"
        out.append(f'<text x="{lx + 24}" y="{y0 + 10}">{label}</text>')

    bars = [
        (c["name"], c["peak_rss_mb"], c["name"] == notes["chosen"]) for c in notes["candidates"] if "peak_rss_mb" in c
    ]
    bars += [("check: default", check["default"]["peak_rss_mb"], False)]
    bars += [("check: recipe", check["recipe"]["peak_rss_mb"], True)]
    by0 = top_h + 40
    out.append(f'<text x="{x0}" y="{by0 - 12}" font-weight="bold">Peak RSS per setting (MiB, median of the '
               "fresh-process runs; red: the recipe)</text>")  # fmt: skip
    label_w, bar_h = 190, 18
    vmax = max(b[1] for b in bars) * 1.1
    for k, (name, value, chosen) in enumerate(bars):
        y = by0 + k * (bar_h + 4)
        width = (w - label_w - pad - 60) * value / vmax
        out.append(f'<text x="{x0 + label_w - 6}" y="{y + 13}" text-anchor="end">{name}</text>')
        out.append(f'<rect x="{x0 + label_w}" y="{y}" width="{width:.1f}" height="{bar_h}" '
                   f'fill="{"#c33" if chosen else "#999"}"/>')  # fmt: skip
        out.append(f'<text x="{x0 + label_w + width + 4:.1f}" y="{y + 13}">{value:.0f}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _summary(runs: list[dict[str, Any]], elements: list[int]) -> dict[str, Any]:
    calls = len(runs[0]["latency_ms"])
    latency = [statistics.median(r["latency_ms"][i] for r in runs) for i in range(calls)]
    return {
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "peak_rss_mb_runs": [round(r["peak_rss_mb"], 1) for r in runs],
        "load_peak_rss_mb": statistics.median(r["load_peak_rss_mb"] for r in runs),
        "trace_s": statistics.median(r["trace_s"] for r in runs),
        "trace_s_runs": [round(r["trace_s"], 2) for r in runs],
        "load_s": statistics.median(r["load_s"] for r in runs),
        "first_call_ms": latency[0],
        "latency_ms": latency,
        "spikes": _spikes(latency, elements),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=40, help="calls of the check trace")
    ap.add_argument("--pass-calls", type=int, default=40, help="calls of the pass's own trace")
    ap.add_argument("--candidates", nargs="*", default=None, help="restrict the pass's candidates")
    ap.add_argument("--pass-repeats", type=int, default=2, help="rounds of the pass's candidate search")
    ap.add_argument("--repeats", type=int, default=5, help="rounds of the default-vs-recipe check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse", action="store_true", help="reuse the profiled artifact in bench/out")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    OUT.mkdir(parents=True, exist_ok=True)
    source = ensure_bench_model("minilm")
    artifact, notes_path = OUT / "minilm_profiled.onnx", OUT / "notes.json"
    model = ir.serde.deserialize_model(onnx.load(str(source)))
    if not (args.reuse and artifact.exists() and notes_path.exists()):
        started = time.perf_counter()
        options = {"calls": args.pass_calls, "repeats": args.pass_repeats, "seed": args.seed}
        if args.candidates is not None:
            options["candidates"] = args.candidates
        result = ShapeProfile(options)(model, PassContext())
        notes = dict(result.notes["shape_profile"], pass_s=time.perf_counter() - started)
        ir.save(model, artifact)
        notes_path.write_text(json.dumps(notes, indent=1))
        print(f"pass: {result.notes['decision']} ({notes['pass_s']:.0f} s)", flush=True)
    notes = json.loads(notes_path.read_text())
    recipe_text = ir.load(artifact).metadata_props.get("onnxforge.session")
    print(f"recipe: {recipe_text}", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-shape-profile-") as tmp:
        work = Path(tmp)
        trace = _trace(model, args.calls, args.seed + 1, work / "trace.npz")
        elements = [math.prod(t.values()) for t in trace]
        runs: dict[str, list[dict[str, Any]]] = {"default": [], "recipe": []}
        for round_ in range(args.repeats):
            for name in ("default", "recipe") if round_ % 2 == 0 else ("recipe", "default"):
                spec = {
                    "model": str(source if name == "default" else artifact),
                    "trace": str(work / "trace.npz"),
                    "calls": args.calls,
                    "recipe": None,
                    "from_metadata": name == "recipe",
                    "out": str(work / f"{name}-{round_}.json"),
                }
                result = run_child(spec, work / f"{name}-{round_}.spec.json")
                if "error" in result:
                    raise SystemExit(f"{name} run failed: {result['error']}")
                runs[name].append(result)
                print(
                    f"round {round_} {name:8s} peak {result['peak_rss_mb']:.1f} MiB  trace {result['trace_s']:.2f} s  "
                    f"load {result['load_s']:.2f} s",
                    flush=True,
                )
    default, recipe = _summary(runs["default"], elements), _summary(runs["recipe"], elements)
    ratios = [r["trace_s"] / d["trace_s"] for d, r in zip(runs["default"], runs["recipe"], strict=True)]
    best = {k: sum(min(r["latency_ms"][i] for r in v) for i in range(args.calls)) / 1000.0 for k, v in runs.items()}
    check = {
        "recipe_name": notes["chosen"],
        "recipe": recipe,
        "default": default,
        "time_ratio": statistics.median(ratios),
        "time_ratios": [round(x, 3) for x in ratios],
        "trace_s_best": best,
        "time_ratio_best": best["recipe"] / best["default"],
        "trace": trace,
        "series": [
            {"name": "default", "latency_ms": default["latency_ms"], "spikes": default["spikes"]},
            {"name": "recipe", "latency_ms": recipe["latency_ms"], "spikes": recipe["spikes"]},
        ],
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    (OUT / "check.json").write_text(json.dumps({"check": check, "runs": runs}, indent=1))
    table = _table(notes, check, args)
    print(table)
    if not args.no_write:
        SVG.write_text(_svg(notes, check))
        write_blocks({(START, END): table})
    return 0


def _table(notes: dict[str, Any], check: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"Command: `.venv/bin/python -m bench.shape_profile --pass-repeats {args.pass_repeats} "
        f"--pass-calls {args.pass_calls} --repeats {args.repeats}"
        + (f" --candidates {' '.join(args.candidates)}" if args.candidates is not None else "")
        + (" --reuse" if args.reuse else "")
        + f"`; {check['cpus']} shared vCPUs, load average at the end "
        f"{check['load_average'][0]:.1f} / {check['load_average'][1]:.1f} / {check['load_average'][2]:.1f}.",
        "",
        f"Candidates (the pass: {notes['calls']}-call trace, seed {args.seed}, {notes['repeats']} fresh-process runs "
        f"each, interleaved; margin {notes['margin']:.3f}):",
        "",
        "| setting | peak RSS MiB | trace s (median) | trace time vs default (median of rounds; fastest run) "
        "| first call ms | spikes | verdict |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for c in notes["candidates"]:
        if "peak_rss_mb" not in c:
            lines.append(f"| {c['name']} | | | | | | {c['reason']} |")
            continue
        mark = " **(chosen)**" if c["name"] == notes["chosen"] else ""
        lines.append(
            f"| {c['name']}{mark} | {c['peak_rss_mb']:.1f} | {c['trace_s']:.2f} | x{c['time_ratio']:.3f}; "
            f"x{c['time_ratio_best']:.3f} | "
            f"{c['first_call_ms']:.0f} | {c['spikes']} | {c['reason']} |"
        )
    d, r = check["default"], check["recipe"]
    lines += [
        "",
        f"Check (a different 40-call trace, seed {args.seed + 1}; {len(d['peak_rss_mb_runs'])} fresh-process runs "
        "each, alternating which goes first):",
        "",
        "| session | peak RSS MiB (median; runs) | peak after load MiB | trace s (median; runs) | load + warm-up s "
        "| first call ms | spikes |",
        "|---|---|---:|---|---:|---:|---:|",
        f"| ORT default | {d['peak_rss_mb']:.1f}; {d['peak_rss_mb_runs']} | {d['load_peak_rss_mb']:.1f} | "
        f"{d['trace_s']:.2f}; {d['trace_s_runs']} | "
        f"{d['load_s']:.2f} | {d['first_call_ms']:.0f} | {len(d['spikes'])} |",
        f"| `core.runtime.load` ({check['recipe_name']}) | {r['peak_rss_mb']:.1f}; {r['peak_rss_mb_runs']} | "
        f"{r['load_peak_rss_mb']:.1f} | "
        f"{r['trace_s']:.2f}; {r['trace_s_runs']} | {r['load_s']:.2f} | {r['first_call_ms']:.0f} | "
        f"{len(r['spikes'])} |",
        "",
        f"Peak RSS recipe / default: {r['peak_rss_mb'] / d['peak_rss_mb']:.3f} "
        f"({r['peak_rss_mb'] - d['peak_rss_mb']:+.1f} MiB). Trace time recipe / default: median of the per-round "
        f"ratios x{check['time_ratio']:.3f} (rounds: {check['time_ratios']}); fastest run (per call, the fastest of "
        f"the runs, summed: {check['trace_s_best']['recipe']:.2f} s vs {check['trace_s_best']['default']:.2f} s) "
        f"x{check['time_ratio_best']:.3f}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
