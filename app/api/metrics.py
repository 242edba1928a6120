"""``GET /metrics``: Prometheus text format (app/metrics.py says where each metric comes from).

No API key: scrapers rarely carry one, and nothing tenant-specific is exposed (counts and durations only).
``metrics.allow_from`` restricts it to client addresses or networks (403 METRICS_FORBIDDEN otherwise); behind
a proxy the client address is the proxy's unless uvicorn trusts its forwarded headers. Not served at all
when ``metrics.enabled`` is false.
"""

from __future__ import annotations

import ipaddress

from fastapi import APIRouter, Request, Response

from app.deps import SettingsDep
from app.errors import problem
from app.metrics import CONTENT_TYPE, ServiceMetrics
from app.schemas import problem_responses

router = APIRouter(tags=["metrics"])


def _allowed(host: str | None, allow_from: list[str]) -> bool:
    if not allow_from:
        return True
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in ipaddress.ip_network(entry, strict=False) for entry in allow_from)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {}}}, **problem_responses(403)},
    summary="Prometheus metrics",
)
def get_metrics(request: Request, settings: SettingsDep) -> Response:
    """Jobs by state, queue depth, job and pass duration histograms, upload bytes and cache hits."""
    client = request.client.host if request.client else None
    if not _allowed(client, settings.metrics.allow_from):
        return problem(403, "METRICS_FORBIDDEN", "this address may not read /metrics (metrics.allow_from)")
    metrics: ServiceMetrics = request.app.state.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE)
