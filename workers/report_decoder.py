"""The report's ``decoder`` section (workers/decoder_benchmark.py): its documented keys, their check, and its
HTML: per-token decode latency against the past length for both models (inline SVG), then the table of
prefill, decode, weights and memory side by side. Everything is escaped; nothing is fetched."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from workers.report_parts import COLORS, escape, fmt, table

# Documented keys, by object (docs/report.md, section ``decoder``); merged into ``workers.report.SCHEMA``.
DECODER_SCHEMA: dict[str, tuple[str, ...]] = {
    "decoder": (
        "status",
        "reason",
        "notes",
        "time_budget_s",
        "duration_s",
        "prompt_lengths",
        "prefill",
        "decode",
        "weights",
        "memory",
    ),
    "decoder_prefill": (
        "prompt_length",
        "past_length",
        "original",
        "optimized",
        "speedup",
        "paired_ratio",
        "ci95",
        "stopped_by",
    ),
    "decoder_decode": (
        "prompt_length",
        "new_tokens",
        "blocks",
        "stopped_by",
        "original",
        "optimized",
        "speedup",
        "paired_ratio",
    ),
    "decoder_decode_model": ("ms_per_token", "tokens_per_s", "per_position_ms", "past_lengths"),
    "decoder_weights": ("original", "optimized", "ratio"),
    "decoder_weights_model": ("bytes", "external_bytes", "initializers"),
    "decoder_memory": ("method", "reason", "original", "optimized"),
    "decoder_memory_model": (
        "baseline_rss_mb",
        "loaded_rss_mb",
        "load_peak_rss_mb",
        "run_peak_rss_mb",
        "peak_rss_mb",
        "session_peak_mb",
    ),
}
STATUSES = ("measured", "skipped", "failed")
MODELS = ("original", "optimized")


def decoder_problems(section: Any, check: Callable[[Any, str, str], None]) -> list[str]:
    """Checks the section's objects with ``check`` (workers.report's key check); returns what only this
    section can get wrong."""
    if not isinstance(section, Mapping):
        return [] if section is None else [f"decoder: expected an object, got {type(section).__name__}"]
    check(section, "decoder", "decoder")
    for i, entry in enumerate(section.get("prefill") or []):
        check(entry, "decoder_prefill", f"decoder.prefill[{i}]")
    decode = section.get("decode")
    check(decode, "decoder_decode", "decoder.decode")
    for part, kind in (("weights", "decoder_weights"), ("memory", "decoder_memory")):
        check(section.get(part), kind, f"decoder.{part}")
    for label in MODELS:
        if isinstance(decode, Mapping):
            check(decode.get(label), "decoder_decode_model", f"decoder.decode.{label}")
        for part in ("weights", "memory"):
            entry = section.get(part)
            if isinstance(entry, Mapping):
                check(entry.get(label), f"decoder_{part}_model", f"decoder.{part}.{label}")
    if section.get("status") not in STATUSES:
        return [f"decoder: status {section.get('status')!r} not in {STATUSES}"]
    return []


# ------------------------------------------------------------------------------------------------ html


def _svg_series(series: Sequence[tuple[str, Sequence[int], Sequence[float]]]) -> str:
    """Lines of ms per token against the past length fed, one per model, with a dot per position."""
    points = [(x, y) for _, xs, ys in series for x, y in zip(xs, ys, strict=False)]
    if not points:
        return "<p>No decode series.</p>"
    width, height, left, right, top, bottom = 640, 280, 60, 20, 24, 40
    plot_w, plot_h = width - left - right, height - top - bottom
    x_lo, x_hi = min(p[0] for p in points), max(p[0] for p in points)
    y_hi = max(p[1] for p in points) * 1.1 or 1.0
    span = max(x_hi - x_lo, 1)

    def sx(x: float) -> float:
        return left + plot_w * (x - x_lo) / span

    def sy(y: float) -> float:
        return top + plot_h * (1 - y / y_hi)

    parts = [
        f'<svg role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#999"/>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#999"/>',
        f'<text x="4" y="{top - 8}">ms per token</text>',
        f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" text-anchor="middle">past length (cache positions)</text>',
    ]
    for tick in (0.0, 0.5, 1.0):
        parts.append(f'<text x="{left - 4}" y="{sy(y_hi * tick) + 4:.1f}" text-anchor="end">{y_hi * tick:.3g}</text>')
    for x in sorted({x_lo, (x_lo + x_hi) // 2, x_hi}):
        parts.append(f'<text x="{sx(x):.1f}" y="{top + plot_h + 14}" text-anchor="middle">{x}</text>')
    for i, (label, xs, ys) in enumerate(series):
        color = COLORS.get(label, "#555")
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys, strict=False))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>')
        parts.extend(
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2" fill="{color}"><title>{escape(label)}: past {x}, '
            f"{y:.4g} ms</title></circle>"
            for x, y in zip(xs, ys, strict=False)
        )
        lx = left + plot_w - 200 + 110 * i
        parts.append(
            f'<rect x="{lx}" y="{top - 18}" width="10" height="10" fill="{color}"/>'
            f'<text x="{lx + 14}" y="{top - 9}">{escape(label)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _num(value: Any, digits: int = 4) -> str:
    return f'<span class="num">{escape(fmt(value, digits))}</span>'


def _row(name: str, a: Any, b: Any, digits: int = 4) -> list[str]:
    ratio = b / a if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else None
    return [escape(name), _num(a, digits), _num(b, digits), _num(ratio, 3)]


def _mb(value: Any) -> float | None:
    return value / (1 << 20) if isinstance(value, (int, float)) else None


def _rows(section: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for entry in section.get("prefill") or []:
        a, b = entry.get("original") or {}, entry.get("optimized") or {}
        name = f"prefill ms, {entry.get('prompt_length')} tokens (past {entry.get('past_length')}), p50"
        rows.append(_row(name, a.get("p50_ms"), b.get("p50_ms")))
    decode = section.get("decode") or {}
    if decode:
        a, b = decode.get("original") or {}, decode.get("optimized") or {}
        rows.append(_row("decode ms per token", a.get("ms_per_token"), b.get("ms_per_token")))
        rows.append(_row("decode tokens/s", a.get("tokens_per_s"), b.get("tokens_per_s")))
    weights = section.get("weights") or {}
    if weights:
        a, b = weights.get("original") or {}, weights.get("optimized") or {}
        rows.append(_row("weights MiB", _mb(a.get("bytes")), _mb(b.get("bytes"))))
    memory = section.get("memory") or {}
    a, b = memory.get("original") or {}, memory.get("optimized") or {}
    for key, name in (
        ("peak_rss_mb", "peak RSS MiB (child process)"),
        ("session_peak_mb", "session peak MiB (above the process baseline)"),
        ("load_peak_rss_mb", "load peak RSS MiB"),
        ("run_peak_rss_mb", "run peak RSS MiB"),
    ):
        if a or b:
            rows.append(_row(name, a.get(key), b.get(key)))
    return rows


def render_decoder(section: Mapping[str, Any] | None) -> str:
    """The decoder section's HTML: a sentence when skipped or failed, else the chart and the table."""
    if not section:
        return "<p>Not recorded (a report from before decoder benchmarks were added).</p>"
    status = str(section.get("status"))
    notes = "".join(f"<li>{escape(str(n))}</li>" for n in section.get("notes") or [])
    if status != "measured":
        return f"<p>{escape(status)}: {escape(str(section.get('reason') or ''))}</p>" + (
            f"<ul>{notes}</ul>" if notes else ""
        )
    decode = section.get("decode") or {}
    parts = []
    if decode:
        series = [
            (
                label,
                (decode.get(label) or {}).get("past_lengths") or [],
                (decode.get(label) or {}).get("per_position_ms") or [],
            )
            for label in MODELS
        ]
        tokens, prompt, blocks = (escape(fmt(decode.get(k))) for k in ("new_tokens", "prompt_length", "blocks"))
        parts.append(
            f"<p>Decode: {tokens} tokens after a {prompt}-token prompt, each step's cache fed back; median over "
            f"{blocks} interleaved blocks ({escape(str(decode.get('stopped_by')))}); speedup "
            f"{escape(fmt(decode.get('speedup'), 3))}.</p>"
        )
        parts.append(_svg_series(series))
    parts.append(table(["figure", "original", "optimized", "optimized / original"], _rows(section)))
    memory = section.get("memory") or {}
    parts.append(f"<p>Memory: {escape(str(memory.get('method') or '-'))}.</p>")
    if notes:
        parts.append(f"<ul>{notes}</ul>")
    return "".join(parts)
