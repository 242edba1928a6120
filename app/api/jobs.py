"""``/v1/jobs``: submit a model, follow the job, cancel it, download the optimized model and reports."""

from __future__ import annotations

from functools import partial
from typing import Annotated
from urllib.parse import urlencode

import anyio
from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, StreamingResponse

from app.deps import JobServiceDep, SettingsDep, TenantDep
from app.schemas import MULTIPART_JOB_BODY, JobList, JobOut, JobState, problem_responses
from app.services.jobs import Download, check_idempotency_key, check_no_query
from app.services.uploads import UploadLimits, receive_upload

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

# Served reports are generated from hostile models' names and metadata: nothing may execute or load.
REPORT_HTML_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:",
    "X-Content-Type-Options": "nosniff",
}


@router.post(
    "",
    status_code=202,
    response_model=JobOut,
    openapi_extra=MULTIPART_JOB_BODY,
    responses={
        200: {"description": "An earlier submission with the same Idempotency-Key: its job, unchanged."},
        **problem_responses(404, 413, 422, 429, 503),
    },
    summary="Submit a model for optimization",
)
async def create_job(
    request: Request,
    response: Response,
    *,
    service: JobServiceDep,
    settings: SettingsDep,
    tenant: TenantDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            description="Any unique string (a UUID) naming this submission: sent again with the same model, "
            "samples and config, it answers 200 with the job it created the first time instead of a new job; "
            "sent with a different request, 422 IDEMPOTENCY_KEY_REUSED. Kept as long as the job is.",
        ),
    ] = None,
) -> JobOut:
    """Upload an ONNX model (multipart field ``model``), optional ``samples`` (.npz) and ``config`` (JSON);
    or, faster, the model alone as ``application/octet-stream`` with the config in ``Onnxforge-Config``.

    The body is streamed into the blob store and hashed; the job is queued and this answers 202 with the job and its
    ``Location``. Poll that URL until the job is ``succeeded``, ``failed`` or ``canceled``. A tenant with
    ``api.max_concurrent_uploads_per_tenant`` uploads in progress gets 429 TOO_MANY_UPLOADS; one at its
    quota of jobs in flight or bytes per day gets 429 QUOTA_CONCURRENT_JOBS or QUOTA_BYTES_PER_DAY, with
    Retry-After. A repeated ``Idempotency-Key`` answers 200 with the first job and
    ``Idempotent-Replayed: true``. Query parameters are refused (422 UNKNOWN_QUERY_PARAMETER): options go in the
    config.
    """
    check_no_query(iter(request.query_params.keys()))
    key = check_idempotency_key(idempotency_key)
    await anyio.to_thread.run_sync(service.admit, tenant)
    upload = await receive_upload(
        service.blobs,
        headers=request.headers,
        chunks=request.stream(),
        limits=UploadLimits.from_settings(settings.api),
        slot=service.upload_slots.hold(tenant),
    )
    with upload:  # deletes the temp files if anything below fails before they are committed
        submitted = await anyio.to_thread.run_sync(partial(service.submit, tenant, upload, key))
    response.headers["Location"] = f"/v1/jobs/{submitted.job.id}"
    if not submitted.created:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
    return JobOut.from_job(submitted.job)


@router.get("", response_model=JobList, responses=problem_responses(422), summary="List jobs, newest first")
def list_jobs(
    service: JobServiceDep,
    tenant: TenantDep,
    limit: Annotated[int, Query(ge=1, description="Page size (at most api.page_size_max).")] = 20,
    offset: Annotated[int, Query(ge=0, description="Jobs to skip.")] = 0,
    state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
) -> JobList:
    jobs, total = service.list(tenant, limit=limit, offset=offset, state=state)
    next_link = None
    if offset + len(jobs) < total:
        query = {"limit": limit, "offset": offset + limit, **({"state": state} if state else {})}
        next_link = f"/v1/jobs?{urlencode(query)}"
    return JobList(jobs=[JobOut.from_job(j) for j in jobs], total=total, limit=limit, offset=offset, next=next_link)


@router.get("/{job_id}", response_model=JobOut, responses=problem_responses(404), summary="Get a job")
def get_job(job_id: str, service: JobServiceDep, tenant: TenantDep) -> JobOut:
    return JobOut.from_job(service.get(tenant, job_id))


@router.delete(
    "/{job_id}",
    status_code=204,
    responses={
        202: {"model": JobOut, "description": "The job was running: canceled, and deleted once its worker stops."},
        **problem_responses(404),
    },
    summary="Delete a job and its files",
)
def delete_job(job_id: str, service: JobServiceDep, tenant: TenantDep) -> Response:
    """A queued or finished job is deleted at once with its files (204): its model, samples, optimized model
    and reports, except files another job still uses. A running job is canceled first (202, with the job)
    and deleted when its worker stops; it is not found from then on. To stop a job but keep it, use
    ``POST /v1/jobs/{id}/cancel``."""
    job, deleted = service.delete(tenant, job_id)
    if deleted:
        return Response(status_code=204)
    return JSONResponse(JobOut.from_job(job).model_dump(mode="json", by_alias=True), status_code=202)


@router.post(
    "/{job_id}/cancel",
    status_code=202,
    response_model=JobOut,
    responses=problem_responses(404, 409),
    summary="Cancel a job, keeping it",
)
def cancel_job(job_id: str, service: JobServiceDep, tenant: TenantDep) -> JobOut:
    """A queued job is canceled at once; a running one stops at its worker's next heartbeat. A finished job
    answers 409 JOB_FINISHED."""
    return JobOut.from_job(service.cancel(tenant, job_id))


def _file(download: Download, headers: dict[str, str] | None = None, *, inline: bool = False) -> Response:
    if download.url is not None:  # object storage: a presigned URL, valid storage.s3_presign_seconds
        return RedirectResponse(download.url, status_code=307)
    if download.chunks is not None:
        disposition = "inline" if inline else "attachment"
        return StreamingResponse(
            download.chunks,
            media_type=download.media_type,
            headers={"Content-Disposition": f'{disposition}; filename="{download.filename}"', **(headers or {})},
        )
    assert download.path is not None
    return FileResponse(
        download.path,
        media_type=download.media_type,
        filename=download.filename,
        content_disposition_type="inline" if inline else "attachment",
        headers=headers,
    )


_FILE_RESPONSES = problem_responses(404, 409)


@router.get(
    "/{job_id}/artifact",
    response_class=FileResponse,
    responses={
        200: {"content": {"application/octet-stream": {}, "application/zip": {}}},
        307: {"description": "Object storage: download it from the presigned URL in Location."},
        **_FILE_RESPONSES,
    },
    summary="Download the optimized model",
)
def get_artifact(job_id: str, service: JobServiceDep, tenant: TenantDep) -> Response:
    """``<name>.optimized.onnx``, or ``.zip`` when the model has external data. With object storage
    (storage.backend=s3) this answers 307 to a presigned URL of the store."""
    return _file(service.artifact(tenant, job_id))


@router.get(
    "/{job_id}/report",
    response_class=FileResponse,
    responses={200: {"content": {"application/json": {}}}, **_FILE_RESPONSES},
    summary="The job's JSON report",
)
def get_report(job_id: str, service: JobServiceDep, tenant: TenantDep) -> Response:
    return _file(service.report(tenant, job_id, html=False), inline=True)


@router.get(
    "/{job_id}/report.html",
    response_class=FileResponse,
    responses={200: {"content": {"text/html": {}}}, **_FILE_RESPONSES},
    summary="The job's report as a self-contained HTML page",
)
def get_report_html(job_id: str, service: JobServiceDep, tenant: TenantDep) -> Response:
    return _file(service.report(tenant, job_id, html=True), REPORT_HTML_HEADERS, inline=True)
