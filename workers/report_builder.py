"""The report builder: one job's ``report.json`` document (schema in docs/report.md and ``workers.report``),
assembled from the stages' results. ``workers.report`` validates, writes and renders it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from core.config import JobConfig, Tolerance
from core.inputs import InputSet
from core.recipe import read_recipe
from core.version import __version__
from passes._infra import op_histogram
from workers import artifacts, output_adapters
from workers.benchmark import host_info
from workers.gate import GateResult
from workers.ledger import Ledger, Outcome
from workers.report import SCHEMA_VERSION
from workers.verify import VerificationResult


def _input_set_entry(input_set: InputSet, origin: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": input_set.name, "origin": origin, "shapes": input_set.shapes()}
    if input_set.provenance:  # which inputs were used and why (core.inputs), and the guesses the model refused
        entry["inputs"] = input_set.provenance
    return entry


def _session_entry(recipe: dict[str, Any] | None) -> dict[str, Any] | None:
    if recipe is None:
        return None
    keys = ("session_options", "session_config", "provider_options")
    return {**{k: recipe.get(k) or {} for k in keys}, "warmup": recipe.get("warmup") or []}


def _versions() -> dict[str, str]:
    import numpy as np
    import onnxruntime as ort  # deferred for start-up cost, as everywhere in the engine

    return {
        "onnxforge": __version__,
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "onnx_ir": ir.__version__,
        "numpy": np.__version__,
    }


def build_report(
    *,
    job_id: str | None,
    config: JobConfig,
    preset: str | None,
    tolerance: Tolerance,
    intra_op_threads: int,
    source: Path,
    source_sha: str,
    source_external: list[str],
    hist_before: Counter[str],
    original_sets: list[InputSet],
    origin: str,
    baseline: dict[str, Any],
    ledger: Ledger,
    candidates: list[dict[str, Any]] | None,
    outcome: Outcome,
    verification: VerificationResult,
    gate: GateResult,
    final_path: Path,
    output_dir: Path,
    external: list[Path],
    side: list[Path],
    duration_s: float,
    timings: dict[str, Any] | None = None,
    decoder: dict[str, Any] | None = None,
    upload_drift: dict[str, Any] | None = None,
) -> dict[str, Any]:
    decision, benchmark, rebase = gate.decision, gate.benchmark, ledger.rebase
    # the graph alone (weights stay on disk); a ZipMap put back on the artifact is counted, not parsed (no map
    # type in onnx-ir: workers/output_adapters.py)
    final_proto, zipmaps = output_adapters.detach(onnx.load(str(final_path), load_external_data=False))
    final_ir = ir.serde.deserialize_model(final_proto)
    hist_after = output_adapters.count_zipmaps(op_histogram(final_ir), zipmaps)
    statuses = Counter(r.status for r in ledger.records)
    if benchmark is not None:
        p50_before, p50_after = benchmark["p50_ms_original"], benchmark["p50_ms_optimized"]
        speedup = benchmark["speedup"]
    else:
        # After an input change the upload's latency (tensors in) compares with nothing: the stage right
        # after the change (raw input in) is the baseline.
        p50_before = rebase.p50_ms if rebase is not None else baseline["p50_ms"]
        p50_after = ledger.records[ledger.kept[-1][0]].latency_ms_p50_after if ledger.kept else baseline["p50_ms"]
        speedup = p50_before / p50_after if p50_after else None
    if decision["used_original"]:
        p50_after, speedup = p50_before, 1.0
    raw_origin = "samples" if ledger.setup.raw_sets else "generated"
    return {
        "schema_version": SCHEMA_VERSION,
        "job_id": job_id,
        "versions": _versions(),
        "host": host_info(target=config.target, intra_op_threads=intra_op_threads),
        "source": {
            "file_name": source.name,
            "sha256": source_sha,
            "size_bytes": source.stat().st_size,
            "external_data": source_external,
        },
        "config": config.model_dump(mode="json"),
        "preset": preset,
        "tolerance": tolerance.model_dump(mode="json"),
        "input_sets": [_input_set_entry(s, origin) for s in original_sets]
        # the sets passes declared, against the original: who asked, why, whether the original ran them
        + [_input_set_entry(s, "pass") for s in ledger.pass_sets if s.provenance["reference"] == "original"]
        # after an input change: the raw inputs the later passes and the gate used (the pass's own)
        + ([_input_set_entry(s, raw_origin) for s in ledger.input_sets] if rebase is not None else [])
        # and the declared sets carried over it, or declared after it, against the model it made
        + [_input_set_entry(s, "pass") for s in ledger.pass_sets if s.provenance["reference"] != "original"],
        "baseline": baseline,
        "passes": [r.to_dict() for r in ledger.records],
        "verification": {**verification.to_dict(), "upload_at_default_level": upload_drift},
        "bisection": outcome.bisection,
        "benchmark": benchmark,
        "decision": decision,
        "op_histogram": {"before": dict(sorted(hist_before.items())), "after": dict(sorted(hist_after.items()))},
        "summary": {
            "nodes_before": sum(hist_before.values()),
            "nodes_after": sum(hist_after.values()),
            "p50_ms_before": p50_before,
            "p50_ms_after": p50_after,
            "speedup": speedup,
            "passes_applied": statuses.get("applied", 0),
            "passes_rolled_back": statuses.get("rolled_back", 0),
            "passes_no_change": statuses.get("no_change", 0),
            "passes_failed": statuses.get("failed", 0),
        },
        "candidates": candidates,
        "session": None if decision["used_original"] else _session_entry(read_recipe(final_path)),
        "artifact": None
        if decision["result"] == "failed"
        else {
            "file_name": final_path.name,
            "sha256": artifacts.sha256_file(final_path),
            "size_bytes": final_path.stat().st_size,
            "external_data": [p.relative_to(output_dir).as_posix() for p in external],
            "side_files": [p.name for p in side],
            "metadata_props": {k: v for k, v in final_ir.metadata_props.items() if k.startswith(artifacts.META_PREFIX)},
        },
        "duration_s": duration_s,
        **({"timings": timings} if timings is not None else {}),
        **({"decoder": decoder} if decoder is not None else {}),
    }
