"""workers/report.py: schema conformance, docs coverage, and the offline, escaped HTML page."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from core.config import JobConfig
from core.settings import PipelineSettings
from tests.workers.conftest import DropReluChain, FlipSign, Idle, resolver
from workers.pipeline import PipelineRequest, PipelineResult, run_pipeline
from workers.report import SCHEMA, SCHEMA_VERSION, render_html, validate_report

DOCS = Path(__file__).resolve().parents[2] / "docs" / "report.md"


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory, slow_mlp_path: Path) -> PipelineResult:
    settings = PipelineSettings(
        verify_shape_sets=2,
        benchmark_warmup=1,
        benchmark_min_runs=10,
        benchmark_max_seconds=0.1,
        ledger_runs=7,
    )
    request = PipelineRequest(
        model_path=slow_mlp_path,
        output_dir=tmp_path_factory.mktemp("report"),
        config=JobConfig(),
        settings=settings,
        job_id="job-<b>1</b>",
        pass_resolver=resolver(Idle(), FlipSign(), DropReluChain()),
    )
    return run_pipeline(request)


def test_validate_report_finds_no_problem_when_report_comes_from_the_pipeline(result: PipelineResult) -> None:
    on_disk = json.loads(result.report_json_path.read_text())
    assert on_disk["schema_version"] == SCHEMA_VERSION
    assert validate_report(on_disk) == []
    assert [p["status"] for p in on_disk["passes"]] == ["no_change", "rolled_back", "applied"]
    assert set(on_disk) == set(SCHEMA["report"])


def test_validate_report_lists_problems_when_keys_are_missing_or_undocumented(result: PipelineResult) -> None:
    broken: dict[str, Any] = copy.deepcopy(result.report)
    del broken["summary"]["speedup"]
    broken["passes"][0]["surprise"] = 1
    broken["passes"][1]["status"] = "maybe"
    problems = validate_report(broken)
    assert "summary: missing key 'speedup'" in problems
    assert "passes[0]: undocumented key 'surprise'" in problems
    assert any("passes[1]: status 'maybe'" in p for p in problems)


def test_docs_document_every_schema_key_when_schema_changes() -> None:
    text = DOCS.read_text(encoding="utf-8")
    documented = set(re.findall(r"`([a-z0-9_]+)`", text))
    missing = {f"{kind}.{key}" for kind, keys in SCHEMA.items() for key in keys if key not in documented}
    assert not missing, f"docs/report.md does not document: {sorted(missing)}"


def test_html_is_one_offline_file_with_svg_charts_when_rendered(result: PipelineResult) -> None:
    page = result.report_html_path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert page.count("<svg") >= 3  # latency by pass, distribution, op histogram
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.IGNORECASE)
    assert "<script" not in page.lower() and "<link" not in page.lower() and "@import" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # the hostile node name, escaped
    assert "&lt;b&gt;1&lt;/b&gt;" in page  # the job id too
    assert "test_flip_sign" in page and "broke tolerance" in page


def test_render_html_escapes_model_strings_when_op_types_and_inputs_are_hostile(
    result: PipelineResult,
) -> None:
    report = copy.deepcopy(result.report)
    evil = '"><img src=x onerror=alert(1)>'
    report["op_histogram"]["after"][evil] = 3
    report["input_sets"][0]["name"] = evil
    report["passes"][0]["op_histogram_delta"] = {evil: 1}
    report["verification"]["outputs"][0]["name"] = evil
    page = render_html(report)
    assert "<img" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
