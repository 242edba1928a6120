"""Dependencies of the routes, as ``Annotated`` aliases. Everything comes from ``app.state`` (set up by
the lifespan in app/main.py), so a test's ``create_app(settings, dispatcher=...)`` is honoured."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.services.jobs import JobService
from app.settings import Settings
from app.storage import BlobStore
from app.store import JobStore

DEFAULT_TENANT = "default"


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


def get_tenant() -> str:
    """The caller's tenant. Single-tenant for now; bearer tokens will resolve it here (security.md T13)."""
    return DEFAULT_TENANT


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
JobServiceDep = Annotated[JobService, Depends(get_job_service)]
StoreDep = Annotated[JobStore, Depends(get_store)]
BlobsDep = Annotated[BlobStore, Depends(get_blobs)]
TenantDep = Annotated[str, Depends(get_tenant)]
