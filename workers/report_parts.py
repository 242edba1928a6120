"""What the report's HTML sections share: escaping, number formatting, tables and the colours of the models.
Kept apart so that ``workers.report`` and ``workers.report_decoder`` draw alike without importing each other."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

escape = html.escape
COLORS = {
    "applied": "#2e7d32",
    "rolled_back": "#c62828",
    "no_change": "#9e9e9e",
    "failed": "#ef6c00",
    "baseline": "#1565c0",
    "original": "#1565c0",
    "optimized": "#2e7d32",
}


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Cells must already be escaped HTML."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
