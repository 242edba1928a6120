"""Response bodies of the HTTP API (and the problem document), as pydantic models with ``extra="forbid"``.

The request body of ``POST /v1/jobs`` is multipart and parsed by hand (app/services/uploads.py); its
schema is in ``MULTIPART_JOB_BODY`` so OpenAPI still documents it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.store import Job

JobState = Literal["queued", "running", "succeeded", "failed", "canceled"]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Problem(_Out):
    """An RFC 9457 problem document. ``code`` is stable; switch on it, not on ``detail``."""

    type: str = Field("about:blank", description="Problem type URI.")
    title: str = Field(description="The HTTP status phrase.")
    status: int = Field(description="The HTTP status code.")
    detail: str = Field(description="What went wrong, for a person.")
    code: str = Field(description="Stable machine-readable error code, e.g. JOB_NOT_FOUND.")
    pass_: str | None = Field(None, alias="pass", description="The pass the error happened in, if any.")
    passes_before: list[str] | None = Field(None, description="Passes that ran before the failing one.")
    context: dict[str, Any] | None = Field(None, description="Facts about the error, e.g. close_matches.")
    errors: list[dict[str, Any]] | None = Field(None, description="Per-field errors of an invalid request.")
    checks: dict[str, str] | None = Field(None, description="Readiness: each dependency and its state.")


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries documenting problem documents for the given statuses."""
    return {
        status: {"model": Problem, "description": "Problem document (application/problem+json)"} for status in statuses
    }


class ModelInfo(_Out):
    sha256: str = Field(description="SHA-256 of the uploaded file.")
    filename: str = Field(description="The client's file name (metadata only; never used as a path).")
    size: int = Field(description="Size of the upload in bytes.")
    format: Literal["onnx", "zip", "tar"] = Field(description="onnx, or an archive with external data.")


class JobError(_Out):
    code: str = Field(description="Stable error code, e.g. VERIFICATION_FAILED or WORKER_LOST.")
    message: str = Field(description="What went wrong.")
    pass_: str | None = Field(None, alias="pass", description="The pass that failed, if any.")


class Durations(_Out):
    queued_seconds: float | None = Field(None, description="From submission to the start of the last attempt.")
    run_seconds: float | None = Field(None, description="From the start of the last attempt to the end.")
    total_seconds: float | None = Field(None, description="From submission to the end.")


class JobLinks(_Out):
    self_: str = Field(alias="self", description="This job.")
    report: str | None = Field(None, description="JSON report (succeeded jobs, until retention removes it).")
    report_html: str | None = Field(None, description="HTML report (succeeded jobs, until retention removes it).")
    artifact: str | None = Field(None, description="Optimized model (succeeded jobs, until retention removes it).")


class WebhookStatus(_Out):
    state: Literal["pending", "delivered", "failed"] = Field(
        description="pending until delivered, or failed after webhooks.max_attempts."
    )
    attempts: int = Field(description="Deliveries tried so far.")
    last_error: str | None = Field(None, description="Why the last attempt failed, if it did.")


class JobOut(_Out):
    id: str = Field(description="Server-generated job id (UUID).")
    state: JobState
    stage: str | None = Field(None, description="Pipeline stage while running, e.g. passes or benchmark.")
    progress: float = Field(description="0..1, while running.")
    queue: Literal["cpu", "gpu"] = Field(description="Worker queue the job runs on.")
    attempts: int = Field(description="Deliveries to a worker so far.")
    cancel_requested: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    durations: Durations
    config: dict[str, Any] = Field(description="The job configuration, defaults filled in.")
    model: ModelInfo
    samples_sha256: str | None = Field(None, description="SHA-256 of the uploaded samples.npz, if any.")
    error: JobError | None = Field(None, description="Set when the job failed.")
    summary: dict[str, Any] | None = Field(None, description="Headline numbers of a finished job.")
    timings: dict[str, Any] | None = Field(None, description="Seconds spent per stage.")
    cached_from: str | None = Field(
        None,
        description="Set when the result came from the cache: the earlier job whose artifact and reports these are.",
    )
    hardware_class: str | None = Field(
        None, description="Class of the worker hardware and tools that produced the result (for the result cache)."
    )
    webhook: WebhookStatus | None = Field(None, description="Delivery of the callback_url notice, if one was named.")
    links: JobLinks

    @classmethod
    def from_job(cls, job: Job) -> JobOut:
        base = f"/v1/jobs/{job.id}"
        done = job.state == "succeeded"
        end = job.finished_at
        return cls(
            id=job.id,
            state=job.state,  # type: ignore[arg-type]
            stage=job.stage,
            progress=job.progress,
            queue=job.queue,  # type: ignore[arg-type]
            attempts=job.attempts,
            cancel_requested=job.cancel_requested,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            durations=Durations(
                queued_seconds=_seconds(job.created_at, job.started_at),
                run_seconds=_seconds(job.started_at, end),
                total_seconds=_seconds(job.created_at, end),
            ),
            config=job.config,
            model=ModelInfo(
                sha256=job.model_sha256,
                filename=job.model_filename,
                size=job.model_size,
                format=job.model_format,  # type: ignore[arg-type]
            ),
            samples_sha256=job.samples_sha256,
            error=(
                JobError(code=job.error_code, message=job.error_message or "", pass_=job.error_pass)
                if job.error_code
                else None
            ),
            summary=job.summary,
            timings=job.timings,
            cached_from=job.cached_from,
            hardware_class=job.hardware_class,
            webhook=(
                WebhookStatus(
                    state=job.webhook_state,  # type: ignore[arg-type]
                    attempts=job.webhook_attempts or 0,
                    last_error=job.webhook_error,
                )
                if job.webhook_state
                else None
            ),
            links=JobLinks(
                self_=base,
                report=f"{base}/report" if done and job.reports_expired_at is None else None,
                report_html=f"{base}/report.html" if done and job.reports_expired_at is None else None,
                artifact=f"{base}/artifact" if done and job.artifact_expired_at is None else None,
            ),
        )


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start).total_seconds(), 3)


class JobList(_Out):
    jobs: list[JobOut]
    total: int = Field(description="Jobs matching the filter, on all pages.")
    limit: int
    offset: int
    next: str | None = Field(None, description="URL of the next page, if any.")


class PassInfo(_Out):
    name: str
    summary: str
    exact: bool = Field(description="True when the pass preserves the computed function exactly.")
    in_place: bool
    options_schema: dict[str, Any] = Field(description="JSON schema of the pass's options.")


class PresetInfo(_Out):
    name: str
    summary: str
    passes: list[str] = Field(description="Pass names in order (empty for auto, which tries other presets).")
    pass_specs: list[dict[str, Any]] = Field(description="The same passes with the options the preset sets.")
    candidates: list[str] = Field(description="Presets that auto tries, in order; empty for other presets.")
    tolerance: dict[str, Any]


class PassCatalogue(_Out):
    passes: list[PassInfo]
    presets: list[PresetInfo]


class Health(_Out):
    status: Literal["ok", "ready"]
    checks: dict[str, str] | None = None


MULTIPART_JOB_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "Streamed into the blob store, never held in memory. multipart/form-data: the fields "
        "model, samples and config (others are refused). application/octet-stream (faster, no samples): the "
        "model alone, with the config in the Onnxforge-Config header, the file name in Content-Disposition "
        "and optionally its Content-Digest.",
        "content": {
            "application/octet-stream": {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": "The model: an .onnx file, or a .zip/.tar holding one .onnx and its "
                    "external-data files.",
                }
            },
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["model"],
                    "properties": {
                        "model": {
                            "type": "string",
                            "format": "binary",
                            "description": "An .onnx file, or a .zip/.tar holding one .onnx and its "
                            "external-data files.",
                        },
                        "samples": {
                            "type": "string",
                            "format": "binary",
                            "description": "Optional .npz of representative inputs, by graph-input name.",
                        },
                        "config": {
                            "type": "string",
                            "description": "Optional JSON job configuration; see the JobConfig schema.",
                            "contentMediaType": "application/json",
                            "example": '{"preset": "safe", "target": "cpu"}',
                        },
                    },
                    "additionalProperties": False,
                },
                "encoding": {"config": {"contentType": "application/json"}},
            },
        },
    },
    "parameters": [
        {
            "name": "Onnxforge-Config",
            "in": "header",
            "required": False,
            "description": "application/octet-stream bodies only: the job configuration as JSON (ASCII); see "
            "the JobConfig schema. The multipart form sends it in its config field.",
            "schema": {"type": "string"},
            "example": '{"preset": "safe", "target": "cpu"}',
        },
        {
            "name": "Content-Digest",
            "in": "header",
            "required": False,
            "description": "application/octet-stream bodies only: the model's SHA-256 as RFC 9530 "
            "sha-256=:<base64>:. Other bytes answer 422 DIGEST_MISMATCH; with it the S3 store writes the "
            "model to its final key without a copy.",
            "schema": {"type": "string"},
        },
        {
            "name": "Content-Disposition",
            "in": "header",
            "required": False,
            "description": 'application/octet-stream bodies only: attachment; filename="model.onnx" names '
            "the model (metadata only; default model).",
            "schema": {"type": "string"},
        },
    ],
}
