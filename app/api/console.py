"""The web console: ``GET /`` redirects to ``/console/``, which serves the plain HTML/CSS/JS in app/static/.

Nothing is built at run time and nothing is loaded from elsewhere: the files are served as they are, from
a fixed list (no path from the URL ever reaches the filesystem). The pages need no key to load; every call
they make to ``/v1`` carries the key the user typed in (kept in sessionStorage), or none in open mode.

The console's CSP lets only its own files run and connect. Styles may be inline because the report page
shows the server-rendered report.html (inline styles, no script) in a sandboxed ``srcdoc`` iframe, which
inherits this policy; the iframe also carries report.html's own, stricter policy (app/static/console.js).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse, RedirectResponse

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

# URL name -> (file under app/static, media type). Anything else under /console/ answers 404.
_FILES: dict[str, tuple[str, str]] = {
    "": ("index.html", "text/html; charset=utf-8"),
    "index.html": ("index.html", "text/html; charset=utf-8"),
    "console.css": ("console.css", "text/css; charset=utf-8"),
    "console.js": ("console.js", "text/javascript; charset=utf-8"),
    "favicon.svg": ("favicon.svg", "image/svg+xml"),
}

CONSOLE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; frame-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


@router.get("/")
def root() -> RedirectResponse:
    return RedirectResponse("/console/", status_code=307)


@router.get("/console")
def console_no_slash() -> RedirectResponse:
    return RedirectResponse("/console/", status_code=307)


@router.get("/console/")
def console_index() -> FileResponse:
    return console_file("")


@router.get("/console/{name}")
def console_file(name: str) -> FileResponse:
    entry = _FILES.get(name)
    if entry is None:
        raise HTTPException(status_code=404, detail="not found")
    filename, media_type = entry
    return FileResponse(STATIC_DIR / filename, media_type=media_type, headers=CONSOLE_HEADERS)
