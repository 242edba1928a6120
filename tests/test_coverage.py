"""The committed tiny corpus under ``fast`` (issue 17 item 3): what docs/coverage.md says fires keeps firing.

Each committed export (``tests/models/corpus/``, built by ``python -m tests.models.corpus --committed``; torch
never runs here) goes through the pipeline as ``onnxforge optimize --preset fast`` runs it, with no samples.
The job must complete and be exact, and every fusion group must reach at least the count that the tiny
table of docs/coverage.md (``python -m bench.coverage``) records for that model and exporter, so coverage
cannot silently regress; a new fusion raises the count, and regenerating the doc records it.

Two settings differ from a user's job, both for a deterministic and short test on a shared 2-core machine:
``rollback_slower=false`` (a job option: a fusion is kept whatever a noisy latency says; the doc measures
with the default), and the operator's benchmark budget (a few runs instead of 10 s per shape). Fusions are
counted in the model the ledger produced, i.e. before the final speed gate, which may hand back the upload.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.config import JobConfig
from core.settings import PipelineSettings
from tests.models import corpus
from workers.pipeline import PipelineRequest, run_pipeline

DOC = Path(__file__).resolve().parent.parent / "docs" / "coverage.md"
GROUPS = {  # the doc's columns and the ops (report histogram keys) that count as each
    "attention": (
        "com.microsoft::Attention",
        "com.microsoft::MultiHeadAttention",
        "com.microsoft::GroupQueryAttention",
    ),
    "skip_norm": ("com.microsoft::SkipLayerNormalization", "com.microsoft::SkipSimplifiedLayerNormalization"),
    "gelu": (
        "com.microsoft::Gelu",
        "com.microsoft::BiasGelu",
        "com.microsoft::FastGelu",
        "com.microsoft::QuickGelu",
        "com.microsoft::GemmFastGelu",
        "Gelu",
    ),
}
COLUMNS = {"attention": 5, "skip_norm": 6, "gelu": 7}  # cell index in a table row of the doc


def _sidecar(arch: str, exporter: str) -> dict[str, Any]:
    return json.loads(corpus.committed_path(arch, exporter).with_suffix(".json").read_text())


PAIRS = [(a, e) for a in corpus.COMMITTED for e in corpus.EXPORTERS]
BUILT = [pair for pair in PAIRS if _sidecar(*pair)["ok"]]


def _doc_rows() -> dict[tuple[str, str], dict[str, int]]:
    """Found counts per (arch, exporter) from the tiny table of docs/coverage.md."""
    text = DOC.read_text()
    start = text.index("## tiny")
    end = text.find("\n## ", start + 1)
    rows: dict[tuple[str, str], dict[str, int]] = {}
    for line in text[start : end if end > 0 else None].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 13 or cells[1] not in corpus.EXPORTERS or not cells[2].startswith("ok"):
            continue
        found = {}
        for group, col in COLUMNS.items():
            match = re.match(r"(\d+)", cells[col])
            found[group] = int(match.group(1)) if match else 0
        rows[cells[0], cells[1]] = found
    return rows


def _ledger_fusions(report: dict[str, Any]) -> dict[str, int]:
    """Fused ops in the model the applied passes produced (before the gate's speed decision)."""
    total: Counter[str] = Counter()
    for record in report["passes"]:
        if record["status"] == "applied":
            total.update(record["op_histogram_delta"])
    return {group: sum(total[op] for op in ops) for group, ops in GROUPS.items()}


def test_corpus_committed_subset_matches_its_build_records_when_loaded_without_torch() -> None:
    import hashlib

    import onnxruntime as ort

    total = 0
    for arch, exporter in PAIRS:
        info, path = _sidecar(arch, exporter), corpus.committed_path(arch, exporter)
        if not info["ok"]:
            assert not path.exists(), f"{path.name} exists but its build record says: {info['error']}"
            continue
        data = path.read_bytes()
        assert hashlib.sha256(data).hexdigest() == info["sha256"], f"{path.name} is not the recorded build"
        assert info["max_abs_vs_torch"] <= 1e-3
        total += len(data)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feeds = corpus.feeds(arch, "tiny", 2, 11, seed=3, pad=True)
        outputs = session.run(None, feeds)
        assert [o.name for o in session.get_outputs()] == list(corpus.ARCHS[arch].outputs)
        assert all(np.isfinite(o).all() and o.shape[0] == 2 for o in outputs)
    assert len(BUILT) >= 15
    # 6.0 MB held the corpus until DeBERTa-v3 (0.44 MB, most of it the relative-position index graph per layer);
    # DeBERTa (v1) added 0.55 MB
    assert total < 7_500_000, f"the committed corpus is {total / 1e6:.1f} MB"


def test_coverage_doc_has_a_row_when_a_committed_export_exists() -> None:
    rows = _doc_rows()
    assert [pair for pair in BUILT if pair not in rows] == [], "regenerate docs/coverage.md: python -m bench.coverage"


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "exporter"), BUILT, ids=[f"{a}-{e}" for a, e in BUILT])
def test_fast_completes_exact_with_the_documented_fusions_when_sent_without_samples(
    arch: str, exporter: str, tmp_path: Path
) -> None:
    documented = _doc_rows().get((arch, exporter))
    assert documented is not None, "regenerate docs/coverage.md: python -m bench.coverage"
    result = run_pipeline(
        PipelineRequest(
            model_path=corpus.committed_path(arch, exporter),
            output_dir=tmp_path,
            config=JobConfig.parse({"preset": "fast", "rollback_slower": False}),
            settings=PipelineSettings(
                intra_op_threads=1,
                benchmark_warmup=1,
                benchmark_min_runs=3,
                benchmark_max_seconds=0.2,
                ledger_runs=3,
            ),
        )
    )
    report = result.report
    assert report["verification"]["ok"], report["verification"]["reason"]
    assert report["decision"]["result"] != "failed"
    assert all(p["status"] != "failed" for p in report["passes"]), [p["reason"] for p in report["passes"]]
    found = _ledger_fusions(report)
    regressed = {g: (found[g], n) for g, n in documented.items() if found[g] < n}
    assert regressed == {}, f"fused (now, documented): {regressed}"


def test_coverage_subset_run_keeps_the_doc_rows_when_no_saved_results() -> None:
    """``bench/out/coverage/<size>.json`` is not committed: a ``--only`` run on a fresh checkout reads the other
    rows back from the doc, and re-rendering them gives the doc's table, summary and findings unchanged."""
    from bench import coverage

    text = DOC.read_text()
    data = coverage.rows_from_doc("tiny", text)
    assert data is not None and data["commands"]
    rows = [data["rows"][k] for k in sorted(data["rows"], key=coverage._order)]
    assert {(r["arch"], r["exporter"]) for r in rows} >= set(_doc_rows())
    for part in (coverage._table(rows), coverage._summary(rows), coverage._findings(rows)):
        assert part in text
    assert coverage.rows_from_doc("bench", "# no bench section\n") is None


def test_coverage_render_keeps_the_section_of_a_size_without_saved_results(tmp_path, monkeypatch) -> None:
    """A run of one size (``--size bench``) renders the doc from that size's saved results: the other size's
    section, whose results are not committed, stays in the doc as it was instead of being dropped."""
    from bench import coverage

    text = DOC.read_text()
    tiny = coverage._doc_section("tiny", text)
    assert tiny is not None and tiny.startswith("## tiny ") and "| bert | ts_eager |" in tiny
    monkeypatch.setattr(coverage, "OUT", tmp_path)  # no saved results of any size
    monkeypatch.setattr(coverage, "DOC", tmp_path / "coverage.md")
    (tmp_path / "coverage.md").write_text(text)
    rendered = coverage.render()
    assert rendered.startswith(coverage.HEADER)
    assert tiny in rendered
    assert rendered.count("\n## tiny ") == 1
    assert coverage._doc_section("bench", "# no bench section\n") is None


# What a run of bench.coverage records about itself, for the read-back tests (another host than the doc's).
RUN = {
    "machine": {
        "cpu_model": "This CPU",
        "cpus_available": 2,
        "memory_total_mb": 8192,
        "platform": "Linux",
        "python": "3.11",
        "onnxruntime_version": "1",
        "onnx_version": "1",
    },
    "build_versions": {"torch": "t"},
    "max_seconds": 1.0,
    "min_blocks": 5,
    "written": "now",
}


def test_coverage_doc_names_the_host_of_rows_read_back_when_a_subset_ran_elsewhere() -> None:
    """Rows kept from the doc keep the host they were measured on: a subset run on another machine lists them
    apart ("Measured on ...") instead of claiming every row for its own host, and that reads back too."""
    from bench import coverage

    data = coverage.rows_from_doc("tiny", DOC.read_text())
    assert data is not None
    first = next(iter(data["rows"]))
    data["rows"][first]["machine"] = "Other CPU, 2 CPUs (shared with other work), 8 GiB; Linux; Python 3.11"
    data |= RUN
    for row in data["rows"].values():
        if row is not data["rows"][first]:
            row["machine"] = coverage._machine(data["machine"])
    text = coverage._section("tiny", data)
    assert f"Measured on Other CPU, 2 CPUs (shared with other work), 8 GiB; Linux; Python 3.11: {first}." in text
    back = coverage.rows_from_doc("tiny", "\n" + text)
    assert back is not None
    assert back["rows"][first]["machine"].startswith("Other CPU")
    assert {r["machine"] for k, r in back["rows"].items() if k != first} == {coverage._machine(data["machine"])}


def test_coverage_doc_names_the_settings_of_rows_re_timed_otherwise_when_a_subset_ran_longer() -> None:
    """A subset re-timed with other settings (longer, to confirm a cell) lists its rows apart ("Run with other
    settings (...)") instead of lending the whole table its seconds per shape, and that reads back too."""
    from bench import coverage

    data = coverage.rows_from_doc("tiny", DOC.read_text())
    assert data is not None
    timed = [k for k, r in data["rows"].items() if r.get("timing")]
    assert timed and all(data["rows"][k]["settings"].startswith("Jobs: ") for k in timed)
    first = timed[0]
    data |= RUN | {"job_benchmark_seconds": 1.0}
    for row in data["rows"].values():
        row["machine"] = coverage._machine(data["machine"])
        if row.get("timing"):
            row["settings"] = coverage._settings(data)
    longer = coverage._settings(data | {"max_seconds": 6.0, "min_blocks": 20})
    data["rows"][first]["settings"] = longer
    text = coverage._section("tiny", data)
    assert "Timing: 1 intra-op thread, 1 s per shape, at least 5 interleaved blocks. Written now." in text
    assert f"Run with other settings ({longer}): {first}." in text
    assert "6 s per shape, at least 20 interleaved blocks" in longer
    back = coverage.rows_from_doc("tiny", "\n" + text)
    assert back is not None
    assert back["rows"][first]["settings"] == longer
    assert {r["settings"] for k, r in back["rows"].items() if k != first and r.get("timing")} == {
        coverage._settings(data)
    }
    assert coverage._section("tiny", back | {k: data[k] for k in data if k != "rows"}) == text
