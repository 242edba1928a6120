"""Request context: an id for every request, in the response's ``X-Request-ID`` and on every log line.

A pure ASGI middleware (not ``BaseHTTPMiddleware``), so the context it opens is the one uvicorn's access
log line is written in: the line for a request carries its id, and the team that authentication bound.
A client's own ``X-Request-ID`` is kept when it is a plain token (letters, digits, ``._-``, at most 128),
so a pipeline can follow one request across its own logs and ours; anything else is replaced.
"""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.logs import log_context

HEADER = "x-request-id"
_TOKEN = re.compile(r"[A-Za-z0-9._-]{1,128}")


def request_id(scope: Scope) -> str:
    for name, value in scope.get("headers") or ():
        if name == HEADER.encode():
            candidate = value.decode("latin-1")
            if _TOKEN.fullmatch(candidate):
                return candidate
    return uuid.uuid4().hex


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER.encode()]
                message = {**message, "headers": [*headers, (HEADER.encode(), rid.encode())]}
            await send(message)

        with log_context(request_id=rid):
            await self.app(scope, receive, send_with_id)
