"""HTTP routers, one per resource: jobs (/v1/jobs), passes (/v1/passes), health (/healthz, /readyz)."""

from fastapi import APIRouter

from app.api import health, jobs, passes

router = APIRouter()
router.include_router(health.router)
router.include_router(jobs.router)
router.include_router(passes.router)
