"""Fixtures of the deploy tests: every overlay rendered once per module, and the example Secret."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy._k8s import OVERLAYS
from tests.deploy._kustomize import SECRET_EXAMPLE, _load_yaml_docs, render


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    directory, extra = OVERLAYS[request.param]
    return request.param, render(directory, extra)


@pytest.fixture(scope="module")
def secret() -> dict[str, Any]:
    (doc,) = _load_yaml_docs(SECRET_EXAMPLE)
    return doc
