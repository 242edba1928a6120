"""The console's routes on a live uvicorn server: redirect, a fixed file list, strict headers, no key needed.

The static files are also checked for what must never be in them: markup built from strings (``innerHTML``
and friends, where a hostile node name in a report would become HTML) and anything loaded from elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from app.api.console import STATIC_DIR
from core.keys import hash_key
from tests.api.conftest import Live, make_settings, serve

pytestmark = pytest.mark.integration

KEY = "ofk_console-routes-key-0123456789abcdefghijklmnopq"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    settings = make_settings(tmp_path_factory.mktemp("data"), auth={"keys": {"team-a": [hash_key(KEY)]}})
    with serve(settings) as server:
        yield server


def test_root_redirects_to_console_when_requested(keyed: Live):
    for path in ("/", "/console"):
        response = keyed.client.get(path)
        assert response.status_code == 307
        assert response.headers["location"] == "/console/"


@pytest.mark.parametrize(
    ("path", "media_type"),
    [
        ("/console/", "text/html"),
        ("/console/index.html", "text/html"),
        ("/console/console.js", "text/javascript"),
        ("/console/console.css", "text/css"),
        ("/console/favicon.svg", "image/svg+xml"),
    ],
)
def test_console_file_is_served_with_strict_headers_when_no_key_is_sent(keyed: Live, path: str, media_type: str):
    response = keyed.client.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith(media_type)
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-eval" not in csp and "script-src 'self' 'unsafe-inline'" not in csp
    assert response.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize(
    "path", ["/console/nope.js", "/console/..%2fmain.py", "/console/%2e%2e/api/console.py", "/console/static"]
)
def test_console_answers_404_when_file_is_not_in_its_list(keyed: Live, path: str):
    assert keyed.client.get(path).status_code == 404


def test_console_api_calls_still_need_the_key_when_keys_are_configured(keyed: Live):
    assert keyed.client.get("/v1/jobs").status_code == 401
    ok = httpx.get(f"{keyed.base_url}/v1/jobs", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert ok.status_code == 200


def test_console_routes_stay_out_of_openapi_when_schema_is_built(keyed: Live):
    paths = keyed.client.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if p == "/" or p.startswith("/console")]


def test_console_static_files_never_build_markup_from_strings_when_read():
    script = (STATIC_DIR / "console.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, f"console.js uses {sink}: API data must reach the page as text"


def test_console_static_files_load_nothing_from_elsewhere_when_read():
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), f"{path.name} loads a remote asset"
        assert "@import" not in text and "url(http" not in text, path.name
