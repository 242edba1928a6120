"""Schemathesis against the live API's /openapi.json (checklist (b) "Schemathesis"): every operation, no
5xx, responses conform to the documented schemas. The multipart ``POST /v1/jobs`` (parsed by hand, its body
documented through ``openapi_extra``) is fuzzed like the rest; generated bodies are small (KBs).

The API runs in embedded mode with no workers (``worker.embedded_workers=0``): jobs stay queued. The
operations are driven through Hypothesis directly (schemathesis's pytest ``from_fixture`` loader does not
work with this pytest), one bounded run per operation, failures collected and reported together.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from bench.reliability import Stack, workspace

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = 25
CHECKS = [not_a_server_error, response_schema_conformance]


@pytest.fixture(scope="module")
def live_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with workspace(parent=Path(tmp_path_factory.mktemp("schemathesis"))) as tmp:
        stack = Stack(tmp, worker__embedded_workers=0, api__max_upload_bytes=1 << 20)
        try:
            stack.start_api()
            yield stack
        finally:
            stack.close()


def test_every_operation_answers_without_5xx_and_conforms_to_its_schema(live_api: Stack):
    schema = schemathesis.openapi.from_url(f"{live_api.url}/openapi.json")
    calls: Counter[str] = Counter()
    failures: dict[str, str] = {}
    started = time.monotonic()
    labels = []
    for result in schema.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck),
        )
        def run(case: schemathesis.Case) -> None:
            response = case.call(base_url=live_api.url, timeout=15)
            calls[f"{case.operation.label} {response.status_code}"] += 1
            case.validate_response(response, checks=CHECKS)

        try:
            run()
        except (Exception, BaseExceptionGroup) as exc:  # collect every failure, report them together
            failures[operation.label] = f"{type(exc).__name__}: {str(exc)[:1500]}"
    print(f"{len(labels)} operations in {time.monotonic() - started:.1f} s: {dict(calls)}")
    assert "POST /v1/jobs" in labels
    assert sum(v for k, v in calls.items() if k.startswith("POST /v1/jobs ")) >= 10
    assert live_api.api is not None and live_api.api.alive
    assert not failures, "\n\n".join(f"{label}: {text}" for label, text in failures.items())
