"""What every bench script writes the same way: its marked blocks in bench/README.md and the machine line.

Each script owns the blocks between its own ``<!-- name:start -->`` / ``<!-- name:end -->`` markers and must
leave the rest of the file (other scripts' tables, the prose around them) exactly as it was.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parent / "README.md"


def write_blocks(blocks: Mapping[tuple[str, str], str], *, heading: str = "", readme: Path = README) -> None:
    """Replace each ``(start, end)`` marked block with ``start``, its text and ``end``; blocks whose markers are
    absent are appended (after ``heading`` when the file lacks its first line). One read, one write."""
    text = readme.read_text(encoding="utf-8") if readme.exists() else "# Benchmarks\n"
    missing = []
    for (start, end), body in blocks.items():
        block = f"{start}\n{body.strip(chr(10))}\n{end}"
        if start in text and end in text:
            before, rest = text.split(start, 1)
            _, after = rest.split(end, 1)
            text = before + block + after
        else:
            missing.append(block)
    if missing:
        lead = heading.rstrip("\n") + "\n\n" if heading and heading.splitlines()[0] not in text else ""
        text = text.rstrip("\n") + "\n\n" + lead + "\n\n".join(missing) + "\n"
    readme.write_text(text, encoding="utf-8")


def unmarked(block: str, start: str, end: str) -> str:
    """A block rendered with its markers, without them (scripts that print the block as it will appear)."""
    return block.removeprefix(start).removesuffix(end).strip("\n")


def machine_line(info: Mapping[str, Any], *, load: str = "") -> str:
    """One sentence naming what a figure was measured on (``workers.benchmark.host_info``'s dict)."""
    memory = f", {info['memory_total_mb'] // 1024} GiB" if "memory_total_mb" in info else ""
    tail = f" Load average (1, 5, 15 min): {load}." if load else ""
    return (
        f"Machine: {info['cpu_model']}, {info['cpus_available']} CPUs available (shared){memory}; "
        f"{info['platform']}; Python {info['python']}; onnxruntime {info['onnxruntime_version']} (CPU EP), "
        f"onnx {info['onnx_version']}.{tail} Written {time.strftime('%Y-%m-%d %H:%M %Z')}."
    )
