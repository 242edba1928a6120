"""The FastAPI application factory: ``uvicorn app.main:create_app --factory``.

The lifespan builds the job store (creating its table), the blob store and the dispatcher, and wires them
into one ``JobService`` on ``app.state``; routes reach them through app/deps.py. The API keys are loaded
here, before the server starts, so a bad keys file or a production server without keys fails at once.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.api import console, router
from app.api import metrics as metrics_api
from app.auth import Authenticator
from app.errors import PROBLEM_MEDIA_TYPE, install_error_handlers
from app.metrics import ServiceMetrics
from app.middleware import RequestContextMiddleware
from app.schemas import Problem
from app.services.jobs import Dispatcher, JobService
from core.errors import InvalidConfigError
from core.objectstore import open_blob_store
from core.settings import Settings, get_settings
from core.store import JobStore
from core.tracing import configure_tracing, tracer_provider

log = logging.getLogger("onnxforge.api")

# Temp files older than this in blobs/tmp belong to writers that died; a live upload is never this old.
_STALE_TMP_SECONDS = 24 * 3600


def create_app(settings: Settings | None = None, dispatcher: Dispatcher | None = None) -> FastAPI:
    """Build the API. ``dispatcher`` overrides core.broker.Dispatcher (tests pass a recorder).

    Raises InvalidConfigError when the API keys cannot be loaded or are required and missing (app/auth.py).
    """
    settings = settings or get_settings()
    auth = Authenticator.from_settings(settings)
    try:  # a bad webhook secrets file fails here, before the server starts
        settings.webhooks.tenant_secrets()
    except ValueError as exc:
        raise InvalidConfigError(str(exc), code="WEBHOOK_SECRETS_INVALID") from None
    metrics = ServiceMetrics(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = JobStore(settings.database_url, settings.database.schema_name)
        owned: Any = None
        try:
            await anyio.to_thread.run_sync(partial(store.prepare, auto_migrate=settings.database.auto_migrate))
            blobs = open_blob_store(settings.storage)  # local disk or S3 (core/objectstore.py)
            blobs.sweep_tmp(_STALE_TMP_SECONDS)
            active = dispatcher
            if active is None:
                from core.broker import Dispatcher as CeleryDispatcher  # deferred: pulls in Celery

                active = owned = CeleryDispatcher(settings)
            app.state.settings = settings
            app.state.store = store
            app.state.blobs = blobs
            app.state.jobs = JobService(store, blobs, active, settings, metrics=metrics)
            # The pass registry (onnx-ir, onnxscript: seconds of imports) is needed by the first job's config
            # check; loading it now, beside start-up, keeps that time out of the first upload.
            threading.Thread(target=importlib.import_module, args=("passes.registry",), daemon=True).start()
            metrics.bind(store)
            log.info(
                "onnxforge API ready (database %s, data %s)",
                store.url.get_backend_name(),
                settings.storage.data_dir,
            )
            yield
        finally:
            metrics.bind(None)
            metrics.close()
            if owned is not None:
                owned.close()
            store.close()

    app = FastAPI(
        title="onnxforge",
        version="0.1.0",
        summary="Optimize ONNX models with verified, measured graph passes.",
        lifespan=lifespan,
        # No 307 from /v1/jobs/x/ to /v1/jobs/x: an id that decodes to "../" would be redirected instead
        # of refused, and a redirected POST re-sends the whole upload. The documented paths are exact.
        redirect_slashes=False,
    )
    app.state.settings = settings
    app.state.auth = auth
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware)  # X-Request-ID, and request_id/team on every log line
    if configure_tracing(settings, process="api"):
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor  # deferred: the otel extra

        # A server span per request; the job's Celery message carries its context to the worker.
        FastAPIInstrumentor.instrument_app(
            app, tracer_provider=tracer_provider(), excluded_urls="healthz,readyz,metrics"
        )
    app.include_router(router)
    app.include_router(console.router)  # GET / -> /console/: the web console (app/static)
    if settings.metrics.enabled:
        app.include_router(metrics_api.router)  # GET /metrics: Prometheus, no API key (app/metrics.py)
    app.openapi = partial(_openapi, app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with every error response documented as what it is: a problem document."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title,
        version=app.version,
        summary=app.summary,
        description=app.description,
        routes=app.routes,
    )
    problem_ref = {"$ref": "#/components/schemas/Problem"}
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            for status, response in operation.get("responses", {}).items():
                if status.isdigit() and int(status) >= 400:
                    response["content"] = {PROBLEM_MEDIA_TYPE: {"schema": problem_ref}}
                    response["description"] = response.get("description") or "Problem"
    components = schema.get("components", {}).get("schemas", {})
    if "Problem" not in components:
        components["Problem"] = Problem.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    app.openapi_schema = schema
    return schema
