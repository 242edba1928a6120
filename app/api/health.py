"""``/healthz`` (the process is alive; touches nothing) and ``/readyz`` (database, broker and storage)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from app.deps import JobServiceDep
from app.errors import RETRY_AFTER_SECONDS, problem
from app.schemas import Health, problem_responses

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness")
async def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses=problem_responses(503), summary="Readiness")
def readyz(
    service: JobServiceDep,
    ignore: Annotated[
        list[Literal["database", "broker", "storage"]] | None,
        Query(
            description="Dependencies whose failure does not make this replica unready; all are still checked and "
            "reported. `?ignore=broker` keeps status, reports and downloads served while the broker restarts "
            "(submissions answer 503 BROKER_UNAVAILABLE meanwhile): the Kubernetes readiness probe uses it."
        ),
    ] = None,
) -> Health | JSONResponse:
    """200 when the database, the broker and blob storage all answer (less those ignored); else 503 naming what
    failed."""
    checks = service.readiness()
    failed = sorted(name for name, state in checks.items() if state != "ok" and name not in (ignore or []))
    if failed:
        return problem(
            503,
            "NOT_READY",
            f"not ready: {', '.join(failed)} unavailable",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            checks=checks,
        )
    return Health(status="ready", checks=checks)
