"""HTTP routers, one per resource: jobs (/v1/jobs), passes (/v1/passes), health (/healthz, /readyz).

Everything under /v1 authenticates (a bearer token mapped to a tenant, app/auth.py); health checks, /docs
and /openapi.json stay open.
"""

from fastapi import APIRouter, Depends

from app.api import health, jobs, passes
from app.deps import get_tenant
from app.schemas import problem_responses

v1 = APIRouter(dependencies=[Depends(get_tenant)], responses=problem_responses(401))
v1.include_router(jobs.router)
v1.include_router(passes.router)

router = APIRouter()
router.include_router(health.router)
router.include_router(v1)
