"""The job report: a versioned JSON document (schema in docs/report.md) and a self-contained HTML page.

``SCHEMA`` below is the machine-readable list of documented keys; ``validate_report`` checks a report
against it and the tests check that docs/report.md documents every key, so code and docs cannot drift.

The HTML page works offline: no CDN, no script, no external stylesheet; the charts are inline SVG drawn
here. Everything that comes from the model (node names, op types, input names, reasons quoting them) is
hostile input and goes through ``html.escape``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from workers.report_decoder import DECODER_SCHEMA, decoder_problems, render_decoder
from workers.report_parts import COLORS as _COLORS
from workers.report_parts import escape as _E
from workers.report_parts import fmt as _fmt
from workers.report_parts import table as _table

SCHEMA_VERSION = "1.0"

# Documented keys, by object. Keep in step with docs/report.md (a test checks it).
SCHEMA: dict[str, tuple[str, ...]] = {
    "report": (
        "schema_version",
        "job_id",
        "versions",
        "host",
        "source",
        "config",
        "preset",
        "tolerance",
        "input_sets",
        "baseline",
        "passes",
        "verification",
        "bisection",
        "benchmark",
        "decision",
        "op_histogram",
        "summary",
        "candidates",
        "session",
        "artifact",
        "duration_s",
        "timings",
        "decoder",
    ),
    "versions": ("onnxforge", "onnx", "onnxruntime", "onnx_ir", "numpy"),
    "source": ("file_name", "sha256", "size_bytes", "external_data"),
    "input_set": ("name", "origin", "shapes", "inputs"),
    "baseline": ("p50_ms", "timed_by", "input_sets"),
    "pass": (
        "name",
        "options",
        "status",
        "modified",
        "reason",
        "counts",
        "non_matches",
        "notes",
        "nodes_before",
        "nodes_after",
        "op_histogram_delta",
        "verification",
        "latency",
        "latency_ms_p50_before",
        "latency_ms_p50_after",
        "duration_s",
    ),
    "verification": ("ok", "reason", "outputs", "upload_at_default_level"),
    "decision": ("result", "used_original", "reason", "failed_pass", "gate"),
    "op_histogram": ("before", "after"),
    "summary": (
        "nodes_before",
        "nodes_after",
        "p50_ms_before",
        "p50_ms_after",
        "speedup",
        "passes_applied",
        "passes_rolled_back",
        "passes_no_change",
        "passes_failed",
    ),
    "artifact": ("file_name", "sha256", "size_bytes", "external_data", "side_files", "metadata_props"),
    "candidate": ("name", "passes", "p50_ms", "speedup", "verification", "status", "reason"),
    "session": ("session_options", "session_config", "provider_options", "warmup"),
    "timings": (
        "load_s",
        "inputs_s",
        "baseline_s",
        "passes_s",
        "finalize_s",
        "gate_s",
        "artifact_s",
        "decoder_s",
        "report_s",
        "total_s",
        "passes",
        "sessions",
    ),
    "pass_timing": ("name", "load_s", "transform_s", "write_s", "verify_s", "benchmark_s", "total_s"),
    "sessions": ("built", "reused"),
    **DECODER_SCHEMA,
}
# Keys added in a minor version: a report written before them is still valid without them.
OPTIONAL: dict[str, frozenset[str]] = {
    "report": frozenset({"timings", "decoder"}),
    "timings": frozenset({"decoder_s"}),
    "baseline": frozenset({"timed_by"}),  # reports from before the gate's timing of the upload was reused
    "input_set": frozenset({"inputs"}),  # present when the inputs' roles are known
    "verification": frozenset({"upload_at_default_level"}),  # reports from before it was measured
}

PASS_STATUSES = ("applied", "rolled_back", "no_change", "failed")


@dataclasses.dataclass
class PassRecord:
    """One line of the per-pass ledger."""

    name: str
    options: dict[str, Any]
    status: str = "no_change"  # applied | rolled_back | no_change | failed
    modified: bool = False
    reason: str | None = None
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    non_matches: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)
    nodes_before: int = 0
    nodes_after: int = 0
    op_histogram_delta: dict[str, int] = dataclasses.field(default_factory=dict)
    verification: dict[str, Any] | None = None
    latency: dict[str, Any] | None = None
    latency_ms_p50_before: float | None = None
    latency_ms_p50_after: float | None = None
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def validate_report(report: Mapping[str, Any]) -> list[str]:
    """Problems with a report against ``SCHEMA`` (missing or undocumented keys); empty when it conforms."""
    problems: list[str] = []

    def check(obj: Any, kind: str, where: str) -> None:
        if obj is None:
            return
        if not isinstance(obj, Mapping):
            problems.append(f"{where}: expected an object, got {type(obj).__name__}")
            return
        want = set(SCHEMA[kind])
        for key in sorted(want - set(obj) - OPTIONAL.get(kind, frozenset())):
            problems.append(f"{where}: missing key {key!r}")
        for key in sorted(set(obj) - want):
            problems.append(f"{where}: undocumented key {key!r}")

    check(report, "report", "report")
    if report.get("schema_version") != SCHEMA_VERSION:
        problems.append(f"report: schema_version {report.get('schema_version')!r} != {SCHEMA_VERSION!r}")
    for kind in (
        "versions",
        "source",
        "baseline",
        "verification",
        "decision",
        "op_histogram",
        "summary",
        "artifact",
        "session",
    ):
        check(report.get(kind), kind, kind)
    timings = report.get("timings")
    check(timings, "timings", "timings")
    if isinstance(timings, Mapping):
        check(timings.get("sessions"), "sessions", "timings.sessions")
        for i, item in enumerate(timings.get("passes") or []):
            check(item, "pass_timing", f"timings.passes[{i}]")
    problems.extend(decoder_problems(report.get("decoder"), check))
    for i, item in enumerate(report.get("candidates") or []):
        check(item, "candidate", f"candidates[{i}]")
    for i, item in enumerate(report.get("input_sets") or []):
        check(item, "input_set", f"input_sets[{i}]")
    for i, record in enumerate(report.get("passes") or []):
        check(record, "pass", f"passes[{i}]")
        if isinstance(record, Mapping) and record.get("status") not in PASS_STATUSES:
            problems.append(f"passes[{i}]: status {record.get('status')!r} not in {PASS_STATUSES}")
    decision = report.get("decision") or {}
    if decision.get("result") not in ("optimized", "original", "failed"):
        problems.append(f"decision: result {decision.get('result')!r} not optimized|original|failed")
    return problems


def _set_why(provenance: Mapping[str, Any]) -> str:
    """A pass-declared set's line in the Inputs table: who asked for it, whether its reference ran it, and what
    an input change did to it; empty for the job's own sets (their roles are in report.json)."""
    if provenance.get("source") != "pass":
        return ""
    reference = provenance.get("reference")
    who = "the original" if reference == "original" else reference
    ran = "ran it" if provenance.get("accepted") else f"refused it ({provenance.get('error')}): not verified on"
    parts = [f"declared by {provenance.get('pass')}", f"{who} {ran}"]
    if provenance.get("carried_from"):
        parts.append(f"carried from {provenance['carried_from']!r}")
    change = provenance.get("after_input_change")
    if change:
        parts.append(f"at {change.get('by')}'s input change: {change.get('why')}")
    return "; ".join(parts)


def write_report(report: Mapping[str, Any], output_dir: Path) -> tuple[Path, Path]:
    """Write report.json and report.html into ``output_dir``; return their paths."""
    json_path = output_dir / "report.json"
    html_path = output_dir / "report.html"
    json_path.write_text(json.dumps(report, indent=2, default=_json_default) + "\n", encoding="utf-8")
    html_path.write_text(render_html(report), encoding="utf-8")
    return json_path, html_path


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


# ------------------------------------------------------------------------------------------------ html

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em;color:#222;max-width:1200px}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}td,th{border:1px solid #ccc;padding:.3em .6em;
vertical-align:top;text-align:left}th{background:#f4f4f4}.num{text-align:right;font-variant-numeric:tabular-nums}
.applied{color:#2e7d32}.rolled_back{color:#c62828}.failed{color:#ef6c00}.no_change{color:#757575}
.ok{color:#2e7d32}.bad{color:#c62828}.box{padding:.6em 1em;border-radius:4px;background:#f7f7f7}
svg text{font-size:11px;font-family:inherit}ul{margin:0;padding-left:1.2em}code{font-size:.9em}
"""


def _svg_bars(labels: Sequence[str], values: Sequence[float | None], colors: Sequence[str], unit: str) -> str:
    """Vertical bars with a value on each, labels rotated underneath."""
    n = max(len(labels), 1)
    width, height, left, bottom, top = max(360, 60 * n + 80), 300, 60, 110, 20
    plot_h = height - bottom - top
    vmax = max((v for v in values if v is not None), default=1.0) or 1.0
    bar_w = (width - left - 20) / n
    parts = [
        f'<svg role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#999"/>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{width - 10}" y2="{top + plot_h}" stroke="#999"/>',
        f'<text x="4" y="{top + 10}">{_E(unit)}</text>',
    ]
    for tick in (0.0, 0.5, 1.0):
        y = top + plot_h * (1 - tick)
        parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{vmax * tick:.3g}</text>')
    for i, (label, value, color) in enumerate(zip(labels, values, colors, strict=True)):
        x = left + i * bar_w + bar_w * 0.15
        cx = left + i * bar_w + bar_w / 2
        if value is not None:
            h = plot_h * value / vmax
            parts.append(
                f'<rect x="{x:.1f}" y="{top + plot_h - h:.1f}" width="{bar_w * 0.7:.1f}" height="{h:.1f}" '
                f'fill="{color}"><title>{_E(label)}: {value:.4g} {_E(unit)}</title></rect>'
            )
            parts.append(f'<text x="{cx:.1f}" y="{top + plot_h - h - 3:.1f}" text-anchor="middle">{value:.3g}</text>')
        ly = top + plot_h + 12
        parts.append(
            f'<text x="{cx:.1f}" y="{ly}" text-anchor="end" transform="rotate(-35 {cx:.1f} {ly})">'
            f"{_E(label[:28])}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _svg_boxes(groups: Sequence[tuple[str, Mapping[str, Any], Mapping[str, Any]]]) -> str:
    """Box plots (whiskers min..p99, box p25..p75, line at p50) of original vs optimized per input set."""
    if not groups:
        return "<p>No benchmark.</p>"
    width, height, left, top, bottom = max(420, 160 * len(groups) + 80), 300, 60, 20, 60
    plot_h = height - top - bottom
    vmax = max(max(a["p99_ms"], b["p99_ms"]) for _, a, b in groups) * 1.05 or 1.0
    group_w = (width - left - 20) / len(groups)

    def y(v: float) -> float:
        return top + plot_h * (1 - v / vmax)

    parts = [
        f'<svg role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#999"/>',
        f'<text x="4" y="{top + 10}">ms</text>',
    ]
    for tick in (0.0, 0.5, 1.0):
        parts.append(f'<text x="{left - 4}" y="{y(vmax * tick) + 4:.1f}" text-anchor="end">{vmax * tick:.3g}</text>')
    for g, (name, a, b) in enumerate(groups):
        for j, (label, stats) in enumerate((("original", a), ("optimized", b))):
            cx = left + g * group_w + group_w * (0.3 + 0.4 * j)
            color = _COLORS[label]
            w = group_w * 0.25
            parts.append(
                f'<line x1="{cx:.1f}" y1="{y(stats["min_ms"]):.1f}" x2="{cx:.1f}" '
                f'y2="{y(stats["p99_ms"]):.1f}" stroke="{color}"/>'
                f'<rect x="{cx - w / 2:.1f}" y="{y(stats["p75_ms"]):.1f}" width="{w:.1f}" '
                f'height="{max(1.0, y(stats["p25_ms"]) - y(stats["p75_ms"])):.1f}" fill="{color}" '
                'fill-opacity="0.3" '
                f'stroke="{color}"><title>{label}: p50 {stats["p50_ms"]:.4g} ms, p99 {stats["p99_ms"]:.4g} ms'
                f"</title></rect>"
                f'<line x1="{cx - w / 2:.1f}" y1="{y(stats["p50_ms"]):.1f}" x2="{cx + w / 2:.1f}" '
                f'y2="{y(stats["p50_ms"]):.1f}" stroke="{color}" stroke-width="2"/>'
                f'<text x="{cx:.1f}" y="{top + plot_h + 14}" text-anchor="middle">{label[:4]}</text>'
            )
        gx = left + g * group_w + group_w / 2
        parts.append(f'<text x="{gx:.1f}" y="{top + plot_h + 30}" text-anchor="middle">{_E(name[:40])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _svg_op_histogram(before: Mapping[str, int], after: Mapping[str, int]) -> str:
    """Horizontal paired bars: node count per op type before (blue) and after (green)."""
    ops = sorted(set(before) | set(after), key=lambda o: (-max(before.get(o, 0), after.get(o, 0)), o))[:40]
    if not ops:
        return "<p>Empty graph.</p>"
    row, left, width = 22, 180, 640
    height = row * len(ops) + 40
    vmax = max(max(before.get(o, 0), after.get(o, 0)) for o in ops) or 1
    scale = (width - left - 60) / vmax
    blue, green = _COLORS["original"], _COLORS["optimized"]
    parts = [
        f'<svg role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        f'<rect x="{left}" y="4" width="10" height="10" fill="{_COLORS["original"]}"/>'
        f'<text x="{left + 14}" y="13">before</text>'
        f'<rect x="{left + 70}" y="4" width="10" height="10" fill="{_COLORS["optimized"]}"/>'
        f'<text x="{left + 84}" y="13">after</text>',
    ]
    for i, op in enumerate(ops):
        y0 = 24 + i * row
        b, a = before.get(op, 0), after.get(op, 0)
        parts.append(
            f'<text x="{left - 6}" y="{y0 + 13}" text-anchor="end">{_E(op[:30])}</text>'
            f'<rect x="{left}" y="{y0 + 2}" width="{b * scale:.1f}" height="8" fill="{blue}">'
            f"<title>{_E(op)} before: {b}</title></rect>"
            f'<rect x="{left}" y="{y0 + 10}" width="{a * scale:.1f}" height="8" fill="{green}">'
            f"<title>{_E(op)} after: {a}</title></rect>"
            f'<text x="{left + max(a, b) * scale + 4:.1f}" y="{y0 + 15}">{b} → {a}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _kv(mapping: Mapping[str, Any] | None) -> str:
    if not mapping:
        return "-"
    return "<br>".join(f"{_E(str(k))}: {_E(_fmt(v))}" for k, v in mapping.items())


def _pass_rows(passes: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    rows = []
    for p in passes:
        non_matches = p.get("non_matches") or []
        shown = "".join(
            f"<li>{_E(str(m.get('reason')))}"
            + (f" (<code>{_E(str(m.get('node')))}</code>)" if m.get("node") else "")
            + "</li>"
            for m in non_matches[:10]
        )
        if len(non_matches) > 10:
            shown += f"<li>… {len(non_matches) - 10} more (see report.json)</li>"
        delta = ", ".join(f"{_E(k)} {v:+d}" for k, v in (p.get("op_histogram_delta") or {}).items()) or "-"
        verification = p.get("verification") or {}
        numerics = (
            f"max abs {_fmt(verification.get('max_abs'))}<br>cos {_fmt(verification.get('min_cosine'), 6)}"
            if verification
            else "-"
        )
        status = str(p.get("status"))
        rows.append(
            [
                f"<b>{_E(str(p.get('name')))}</b><br><code>{_E(json.dumps(p.get('options') or {}))}</code>",
                f'<span class="{_E(status)}">{_E(status)}</span>',
                _E(str(p.get("reason") or "")),
                f'<span class="num">{p.get("nodes_before")} → {p.get("nodes_after")}</span><br>{delta}',
                _kv(p.get("counts")),
                numerics,
                f'<span class="num">{_E(_fmt(p.get("latency_ms_p50_before")))} → '
                f"{_E(_fmt(p.get('latency_ms_p50_after')))}</span>",
                f'<span class="num">{_fmt(p.get("duration_s"), 3)}</span>',
                f"<ul>{shown}</ul>" if shown else "-",
            ]
        )
    return rows


def _latency_by_pass(report: Mapping[str, Any]) -> str:
    baseline = (report.get("baseline") or {}).get("p50_ms")
    labels, values, colors = ["original"], [baseline], [_COLORS["baseline"]]
    current = baseline
    for p in report.get("passes") or []:
        # Chain each applied pass's paired speedup onto the baseline: the raw p50s come from separate
        # measurements minutes apart, so plotting them would show machine drift as a pass's effect.
        speedup = (p.get("latency") or {}).get("speedup")
        if p.get("status") == "applied" and current is not None and speedup:
            current = current / speedup
        elif p.get("status") == "applied" and p.get("latency_ms_p50_after") is not None:
            current = p["latency_ms_p50_after"]
        labels.append(str(p.get("name")))
        values.append(current)
        colors.append(_COLORS.get(str(p.get("status")), "#9e9e9e"))
    return _svg_bars(labels, values, colors, "p50 ms")


def _timings_section(timings: Mapping[str, Any] | None) -> str:
    """Where the job's wall time went: each stage, then each pass's steps."""
    if not timings:
        return "<p>Not recorded (a report from before timings were added).</p>"
    stages = [k for k in SCHEMA["timings"] if k.endswith("_s")]
    sessions = timings.get("sessions") or {}
    rows = [[_E(k.removesuffix("_s")), f'<span class="num">{_fmt(timings.get(k), 3)}</span>'] for k in stages]
    steps = [k for k in SCHEMA["pass_timing"] if k != "name"]
    pass_rows = [
        [f"<b>{_E(str(t.get('name')))}</b>"] + [f'<span class="num">{_fmt(t.get(k), 3)}</span>' for k in steps]
        for t in timings.get("passes") or []
    ]
    return (
        _table(["stage", "seconds"], rows) + f"<p>Benchmark sessions built {_E(_fmt(sessions.get('built')))}, reused "
        f"{_E(_fmt(sessions.get('reused')))}.</p>"
        + _table(["pass", *(k.removesuffix("_s") + " s" for k in steps)], pass_rows)
    )


def render_html(report: Mapping[str, Any]) -> str:
    summary = report.get("summary") or {}
    decision = report.get("decision") or {}
    benchmark = report.get("benchmark") or {}
    verification = report.get("verification") or {}
    histogram = report.get("op_histogram") or {}
    title = f"onnxforge report {report.get('job_id') or ''}".strip()
    result = str(decision.get("result"))
    sections = [
        f"<h1>{_E(title)}</h1>",
        f'<div class="box"><b>Decision: <span class="{"ok" if result == "optimized" else "bad"}">{_E(result)}'
        f"</span></b> — {_E(str(decision.get('reason') or ''))}</div>",
        "<h2>Summary</h2>",
        _table(["key", "value"], [[_E(k), _E(_fmt(v))] for k, v in summary.items()]),
        "<h2>Latency after each pass (quick ledger, p50)</h2>",
        "<p>Bars: the original's p50 times the paired speedup of every pass applied so far; colour is the pass "
        "status "
        '(<span class="applied">applied</span>, <span class="rolled_back">rolled back</span>, '
        '<span class="no_change">no change</span>, <span class="failed">failed</span>).</p>',
        _latency_by_pass(report),
        "<h2>Passes</h2>",
        _table(
            ["pass", "status", "reason", "nodes", "counts", "numerics", "p50 ms", "time s", "non-matches"],
            _pass_rows(report.get("passes") or []),
        ),
        "<h2>Benchmark: original vs optimized</h2>",
    ]
    shapes = benchmark.get("shapes") or []
    if shapes:
        sections.append(_svg_boxes([(s["input_set"], s["original"], s["optimized"]) for s in shapes]))
        rows = []
        for s in shapes:
            for label in ("original", "optimized"):
                st = s[label]
                rows.append(
                    [_E(s["input_set"]), label]
                    + [f'<span class="num">{_fmt(st[k])}</span>' for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")]
                    + [
                        f"{_fmt(st['cv'], 3)}{' (noisy)' if st['noisy'] else ''}",
                        _fmt(st["throughput_per_s"]),
                        _fmt(st["peak_rss_delta_mb"], 3),
                        _fmt(s["speedup"], 3),
                        _fmt(s["margin"], 3),
                        _fmt(s["slower"]),
                    ]
                )
        sections.append(
            _table(
                [
                    "input set",
                    "model",
                    "p50",
                    "p90",
                    "p99",
                    "mean",
                    "cv",
                    "runs/s",
                    "peak RSS Δ MiB",
                    "speedup",
                    "noise margin",
                    "slower",
                ],
                rows,
            )
        )
    else:
        sections.append("<p>Not benchmarked (config.benchmark is false, or nothing changed).</p>")
    sections.append("<h2>Decoder: prefill and decode</h2>")
    sections.append(render_decoder(report.get("decoder")))
    sections.append("<h2>Op histogram before vs after</h2>")
    sections.append(_svg_op_histogram(histogram.get("before") or {}, histogram.get("after") or {}))
    sections.append("<h2>Verification of the returned model</h2>")
    sections.append(
        f'<p class="{"ok" if verification.get("ok") else "bad"}">'
        f"{_E('within tolerance' if verification.get('ok') else str(verification.get('reason')))}</p>"
    )
    if drift := verification.get("upload_at_default_level"):
        within = {True: "within tolerance", False: f"beyond tolerance: {drift.get('reason')}"}
        sections.append(
            "<p>The uploaded model as users run it (ORT's default level) against the reference: max abs "
            f"{_fmt(drift.get('max_abs'))}, {_E(within.get(drift.get('ok'), str(drift.get('reason'))))}</p>"
        )
    out_rows = [
        [_E(str(o.get(k))) for k in ("input_set", "name")]
        + [f'<span class="num">{_fmt(o.get(k))}</span>' for k in ("max_abs", "max_rel")]
        + [
            _fmt(o.get("cosine"), 8),
            str(o.get("mismatches")),
            f"{o.get('nan_ref')}/{o.get('nan_got')}",
            f"{o.get('inf_ref')}/{o.get('inf_got')}",
            _E(str(o.get("reason") or "ok")),
        ]
        for o in verification.get("outputs") or []
    ]
    sections.append(
        _table(
            [
                "input set",
                "output",
                "max abs",
                "max rel",
                "cosine",
                "mismatches",
                "NaN ref/got",
                "Inf ref/got",
                "status",
            ],
            out_rows,
        )
    )
    sections.append("<h2>Time by stage</h2>")
    sections.append(_timings_section(report.get("timings")))
    sections.append("<h2>Inputs</h2>")
    sections.append(
        _table(
            ["input set", "origin", "shapes", "why"],
            [
                [_E(s["name"]), _E(s["origin"]), _E(json.dumps(s["shapes"])), _E(_set_why(s.get("inputs") or {}))]
                for s in report.get("input_sets") or []
            ],
        )
    )
    sections.append("<h2>Provenance</h2>")
    source = report.get("source") or {}
    sections.append(
        _table(
            ["key", "value"],
            [
                ["source sha256", _E(str(source.get("sha256")))],
                ["preset", _E(str(report.get("preset")))],
                ["tolerance", _E(json.dumps(report.get("tolerance")))],
                ["config", f"<code>{_E(json.dumps(report.get('config'), sort_keys=True))}</code>"],
                ["versions", _kv(report.get("versions"))],
                ["host", _kv(report.get("host"))],
            ],
        )
    )
    body = "\n".join(sections)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_E(title)}</title><style>{_CSS}</style></head>\n<body>\n{body}\n</body></html>\n"
    )
