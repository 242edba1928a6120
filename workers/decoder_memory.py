"""Peak RSS of one decoder session, alone in a child process: ``python -m workers.decoder_memory SPEC``.

Two sessions in one process share an allocator and a high-water mark, so the parent's RSS cannot tell
which model grew it. The child imports only numpy and ``workers.sessions`` (onnxruntime when the session is
built), reads the feeds the parent wrote (``feeds.npz``: the longest prefill, the decode prompt, then one
entry per decode step), and reports, in MiB: ``baseline_rss_mb`` (VmRSS with onnxruntime imported, before
the session),
``loaded_rss_mb`` and ``load_peak_rss_mb`` (VmRSS and VmHWM once the session is built: parsing the model and
placing its weights), ``run_peak_rss_mb`` (VmHWM reset after the load, read after the longest prefill and
the decode, the cache fed back; null where the kernel cannot reset it), ``peak_rss_mb`` (the larger peak)
and ``session_peak_mb`` (``peak_rss_mb - baseline_rss_mb``: what this model costs the process). A load peak
above the run peak says the load, not inference, sets the process's peak.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from workers.sessions import make_session

METHOD = (
    "one child process per model: VmRSS before its session, VmHWM once built (the load), then VmHWM reset "
    "and read after the longest prefill and the decode (the runs)"
)
MIN_TIMEOUT_S = 10.0  # a child that cannot even start a session in this long reports nothing useful


def measure_memory(
    paths: Sequence[Path],
    recipes: Sequence[Mapping[str, Any] | None],
    cache: Mapping[str, str],
    feeds: Sequence[Mapping[str, np.ndarray]],
    *,
    target: str,
    threads: int,
    deadline: float,
    notes: list[str],
) -> dict[str, Any]:
    """The ``memory`` entry of the decoder section: one child per model, both at once (each process has its
    own high-water mark, and nothing is timed any more), stopped at ``deadline`` (at least MIN_TIMEOUT_S).
    ``feeds``: the longest prefill, the decode prompt, then each step's inputs other than the cache."""
    out: dict[str, Any] = {"method": METHOD, "reason": None, "original": None, "optimized": None}
    if deadline - time.perf_counter() <= 0:
        out["reason"] = "the time budget was spent before the memory children could start"
        notes.append(out["reason"])
        return out
    with tempfile.TemporaryDirectory(prefix="decoder-memory-") as tmp:
        arrays = {f"{i}/{k}": v for i, feed in enumerate(feeds) for k, v in feed.items()}
        np.savez(Path(tmp) / "feeds.npz", **arrays)  # type: ignore[arg-type]
        children: dict[str, subprocess.Popen[str]] = {}
        for label, path, recipe in zip(("original", "optimized"), paths, recipes, strict=True):
            spec = Path(tmp) / f"{label}.json"
            spec.write_text(
                json.dumps(
                    {
                        "model": str(path),
                        "feeds": str(Path(tmp) / "feeds.npz"),
                        "count": len(feeds),
                        "cache": dict(cache),
                        "target": target,
                        "threads": threads,
                        "recipe": recipe,
                    }
                ),
                encoding="utf-8",
            )
            children[label] = subprocess.Popen(
                [sys.executable, "-m", "workers.decoder_memory", str(spec)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=Path(__file__).resolve().parents[1],  # where ``workers`` imports from in a checkout
            )
        problems = []
        for label, child in children.items():
            try:
                stdout, stderr = child.communicate(timeout=max(MIN_TIMEOUT_S, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.communicate()
                problems.append(f"the {label} model's memory child ran past the time budget and was stopped")
                continue
            try:
                out[label] = json.loads(stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                problems.append(f"the {label} model's memory child failed: {stderr.strip()[-300:]}")
        if problems:
            out["reason"] = "; ".join(problems)
            notes.extend(problems)
    return out


def _status_mb() -> dict[str, float]:
    """VmRSS and VmHWM of this process in MiB (Linux); psutil's RSS for both elsewhere."""
    try:
        text = Path("/proc/self/status").read_text(encoding="utf-8")
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}
    except (OSError, KeyError, ValueError):
        import psutil  # deferred: Linux never needs it

        rss = psutil.Process().memory_info().rss / (1 << 20)
        return {"VmRSS": rss, "VmHWM": rss}


def _reset_peak() -> bool:
    """Linux >= 4.0 resets VmHWM to the current RSS when ``5`` is written to clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _child(spec_path: str) -> dict[str, Any]:
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    feeds: list[dict[str, np.ndarray]] = [{} for _ in range(spec["count"])]
    with np.load(spec["feeds"]) as archive:
        for key in archive.files:
            index, name = key.split("/", 1)
            feeds[int(index)][name] = archive[key]
    import onnxruntime  # noqa: F401  # before the baseline: the library is not the model's cost

    baseline = _status_mb()["VmRSS"]
    session = make_session(
        Path(spec["model"]),
        target=spec["target"],
        intra_op_threads=spec["threads"],
        optimize=True,
        recipe=spec["recipe"],
    )
    loaded = _status_mb()
    reset = _reset_peak()
    names = [o.name for o in session.get_outputs()]
    session.run(None, feeds[0])
    cache: dict[str, np.ndarray] = {}
    for feed in feeds[1:]:
        by_name = dict(zip(names, session.run(None, {**feed, **cache}), strict=True))
        cache = {past: by_name[present] for past, present in spec["cache"].items()}
    run_peak = _status_mb()["VmHWM"]
    peak = max(run_peak, loaded["VmHWM"])
    return {
        "baseline_rss_mb": baseline,
        "loaded_rss_mb": loaded["VmRSS"],
        "load_peak_rss_mb": loaded["VmHWM"],
        "run_peak_rss_mb": run_peak if reset else None,
        "peak_rss_mb": peak,
        "session_peak_mb": peak - baseline,
    }


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))
