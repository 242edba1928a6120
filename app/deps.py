"""Dependencies of the routes, as ``Annotated`` aliases. Everything comes from ``app.state`` (set up by
create_app and its lifespan in app/main.py), so a test's ``create_app(settings, dispatcher=...)`` is honoured.

``TenantDep`` authenticates: the bearer token's tenant, or ``default`` in open mode (app/auth.py). Every
/v1 router depends on it (app/api/__init__.py), so no /v1 route can be reached without it."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.auth import Authenticator
from app.services.jobs import JobService
from core.logs import bind
from core.settings import Settings
from core.storage import BlobStore
from core.store import JobStore

# Documents the scheme in OpenAPI (the Authorize button of /docs); app/auth.py decides, not FastAPI.
_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="ApiKey",
    description="An API key issued by the operator, sent as `Authorization: Bearer <key>`. Not needed in "
    "open mode (no keys configured, loopback only).",
)


def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_job_service(request: Request) -> JobService:
    service: JobService = request.app.state.jobs
    return service


def get_store(request: Request) -> JobStore:
    store: JobStore = request.app.state.store
    return store


def get_blobs(request: Request) -> BlobStore:
    blobs: BlobStore = request.app.state.blobs
    return blobs


def get_tenant(request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> str:
    """The caller's tenant, from the bearer token; raises AuthenticationError (401) without a valid one."""
    auth: Authenticator = request.app.state.auth
    server = request.scope.get("server")
    tenant = auth.authenticate(
        credentials.credentials if credentials is not None else None,
        local_host=server[0] if server else None,
    )
    bind(team=tenant)  # every later line of this request, the access line included, names the team
    return tenant


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
JobServiceDep = Annotated[JobService, Depends(get_job_service)]
StoreDep = Annotated[JobStore, Depends(get_store)]
BlobsDep = Annotated[BlobStore, Depends(get_blobs)]
TenantDep = Annotated[str, Depends(get_tenant)]
