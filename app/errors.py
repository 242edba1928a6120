"""The one place where errors become HTTP: RFC 9457 problem documents (``application/problem+json``).

Domain code raises ``OnnxforgeError`` subclasses that know nothing of HTTP; ``ErrorKind`` maps to a status
here. Every body has ``type``, ``title``, ``status``, ``detail`` and the stable ``code`` clients switch
on, plus ``pass`` when the error happened in a pass. Unexpected exceptions become a bare 500 with code
INTERNAL_ERROR: logged in full here, never leaked to the client. A missing or invalid API key is 401
UNAUTHENTICATED with ``WWW-Authenticate: Bearer``.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from app.auth import AuthenticationError
from core.errors import ErrorKind, OnnxforgeError

log = logging.getLogger("onnxforge.api")

PROBLEM_MEDIA_TYPE = "application/problem+json"
RETRY_AFTER_SECONDS = 5

STATUS_BY_KIND: dict[ErrorKind, int] = {
    ErrorKind.INVALID_INPUT: 422,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.CONFLICT: 409,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.RATE_LIMITED: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
}


class ProblemResponse(JSONResponse):
    media_type = PROBLEM_MEDIA_TYPE


def problem(
    status: int,
    code: str,
    detail: str,
    *,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> ProblemResponse:
    body: dict[str, Any] = {
        "type": "about:blank",
        "title": HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
        "code": code,
    }
    body.update({k: v for k, v in extra.items() if v is not None})
    return ProblemResponse(body, status_code=status, headers=headers)


def _retry_headers(status: int, error: OnnxforgeError | None = None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if status in (429, 503):
        retry = (error.detail.get("retry_after") if error else None) or RETRY_AFTER_SECONDS
        headers["Retry-After"] = str(int(retry))
    if status == 413:
        # The body may not have been read to the end: do not keep the connection for another request.
        headers["Connection"] = "close"
    return headers


async def _onnxforge_error(request: Request, exc: Exception) -> ProblemResponse:
    assert isinstance(exc, OnnxforgeError)
    status = STATUS_BY_KIND.get(exc.kind, 500)
    if status >= 500 and exc.kind is ErrorKind.INTERNAL:
        log.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
    context = {k: v for k, v in exc.detail.items() if k != "retry_after"}
    return problem(
        status,
        exc.code,
        exc.message,
        headers=_retry_headers(status, exc),
        **{"pass": exc.pass_name, "passes_before": exc.passes_before or None, "context": context or None},
    )


async def _authentication_error(request: Request, exc: Exception) -> ProblemResponse:
    assert isinstance(exc, AuthenticationError)
    client = request.client.host if request.client else "?"
    log.info("401 %s %s from %s: %s", request.method, request.url.path, client, exc.message)  # never the token
    return problem(401, exc.code, exc.message, headers={"WWW-Authenticate": exc.challenge})


async def _validation_error(request: Request, exc: Exception) -> ProblemResponse:
    assert isinstance(exc, RequestValidationError)
    # Echo where and what, never the offending input itself.
    errors = [{"loc": list(err.get("loc", ())), "msg": err.get("msg", "")} for err in exc.errors()]
    where = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors)
    return problem(422, "REQUEST_INVALID", f"invalid request: {where}", errors=errors)


async def _http_error(request: Request, exc: Exception) -> ProblemResponse:
    assert isinstance(exc, StarletteHTTPException)
    codes = {401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}
    detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    headers = dict(exc.headers or {})
    headers.update(_retry_headers(exc.status_code))
    return problem(exc.status_code, codes.get(exc.status_code, f"HTTP_{exc.status_code}"), detail, headers=headers)


async def _client_disconnect(request: Request, exc: Exception) -> ProblemResponse:
    # The client went away mid-upload; its partial files are already deleted. Nobody reads this answer.
    log.info("client disconnected during %s %s", request.method, request.url.path)
    return problem(400, "CLIENT_DISCONNECTED", "the client disconnected before the request body ended")


async def _unexpected_error(request: Request, exc: Exception) -> ProblemResponse:
    log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return problem(500, "INTERNAL_ERROR", "internal server error; the incident was logged")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(AuthenticationError, _authentication_error)  # found before OnnxforgeError (MRO)
    app.add_exception_handler(OnnxforgeError, _onnxforge_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_disconnect)
    app.add_exception_handler(Exception, _unexpected_error)
