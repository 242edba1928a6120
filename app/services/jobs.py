"""Job use cases behind the routes: submit (validate, store, enqueue), read, list, cancel, downloads.

No FastAPI here: routes translate HTTP to these calls, and errors are ``OnnxforgeError`` subclasses that
app/errors.py maps to status codes. Every call takes the caller's ``tenant``; another tenant's job is
reported as not found (security.md T13).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

from app.services import cache
from app.services.uploads import Upload, UploadSlots
from core.config import JobConfig
from core.errors import ConflictError, InvalidInputError, NotFoundError, OnnxforgeError, UnavailableError
from core.logs import bind
from core.quotas import Quota
from core.retention import drop_unreferenced
from core.settings import Settings
from core.storage import BlobStore
from core.store import STATES, Intake, Job, JobStore
from core.store_retention import job_blobs
from core.tracing import set_attributes
from core.webhooks import check_destination

if TYPE_CHECKING:
    from app.metrics import ServiceMetrics

log = logging.getLogger("onnxforge.api")

GPU_TARGETS = frozenset({"cuda", "tensorrt"})
_SAFE_STEM = re.compile(r"[^A-Za-z0-9._-]+")


class Dispatcher(Protocol):
    """What the API needs of core/broker.py's Dispatcher."""

    def enqueue(self, job_id: str, queue: str, priority: int | None = None) -> None: ...

    def ping(self) -> None: ...


_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")


def check_idempotency_key(key: str | None) -> str | None:
    """The Idempotency-Key header's value, or None without one; 422 when it is not 1-255 visible ASCII."""
    if key is None:
        return None
    if not _IDEMPOTENCY_KEY.fullmatch(key):
        raise InvalidInputError(
            "Idempotency-Key must be 1 to 255 visible ASCII characters (a UUID is a good choice)",
            code="IDEMPOTENCY_KEY_INVALID",
        )
    return key


def check_no_query(names: Iterator[str]) -> None:
    """422 for query parameters on a submission: the job's options travel in its config (the ``config`` field
    or the ``Onnxforge-Config`` header). Ignored, ``?preset=fast`` ran the default passes without a word."""
    unknown = sorted(set(names))
    if unknown:
        raise InvalidInputError(
            f"unknown query parameter(s) {', '.join(unknown)}: a submission takes its options as JSON in the "
            '\'config\' form field or the Onnxforge-Config header, e.g. {"preset": "fast"}',
            code="UNKNOWN_QUERY_PARAMETER",
        )


def request_fingerprint(upload: Upload, config: JobConfig) -> str:
    """SHA-256 of what a submission asks for: the model, samples, file name and effective config."""
    request = {
        "model": upload.model.sha256,
        "filename": upload.model.filename,
        "samples": upload.samples.sha256 if upload.samples else None,
        "config": config.model_dump(mode="json"),
    }
    return hashlib.sha256(json.dumps(request, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Submitted:
    job: Job
    created: bool  # False: an earlier submission with the same Idempotency-Key, answered again


@dataclasses.dataclass(frozen=True)
class Download:
    """One of: a local file, a URL to redirect to (object storage, presigned), or the bytes to stream."""

    filename: str
    media_type: str
    path: Path | None = None
    url: str | None = None
    chunks: Iterator[bytes] | None = None


def validate_config(raw: bytes | str | None) -> JobConfig:
    """Parse the config and check every preset, pass name and pass option against the registry.

    Unknown names raise UnknownPassError (422) naming close matches; bad options raise
    InvalidPassOptionsError, so nothing wrong reaches a worker.
    """
    config = JobConfig.parse(raw)
    from passes import registry  # deferred: pulls in onnx-ir, which the API needs only here

    if config.preset is not None:
        registry.get_preset(config.preset)
    specs = config.pass_specs()
    if specs:
        registry.build_passes(specs)
    return config


def artifact_filename(model_filename: str, artifact_format: str) -> str:
    """``<stem>.optimized.onnx`` (or ``.zip``) from the client's name, reduced to safe characters."""
    stem = PurePosixPath(model_filename.replace("\\", "/")).name
    for suffix in (".onnx", ".zip", ".tar"):
        if stem.lower().endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    stem = _SAFE_STEM.sub("_", stem).strip("._") or "model"
    return f"{stem[:100]}.optimized.{'zip' if artifact_format == 'zip' else 'onnx'}"


class JobService:
    def __init__(
        self,
        store: JobStore,
        blobs: BlobStore,
        dispatcher: Dispatcher,
        settings: Settings,
        *,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.dispatcher = dispatcher
        self.settings = settings
        self.metrics = metrics
        self.upload_slots = UploadSlots(settings.api.max_concurrent_uploads_per_tenant)
        # Tenants that may name a callback_url (create_app has already refused a bad secrets file).
        self.webhook_tenants = (
            frozenset(settings.webhooks.tenant_secrets()) if settings.webhooks.allowed_hosts else frozenset()
        )

    def quota(self, tenant: str) -> Quota:
        return Quota.for_team(self.settings.quotas, tenant)

    def admit(self, tenant: str) -> None:
        """Before an upload is read: 429 QUOTA_* when the tenant is already at a quota (core/quotas.py)."""
        quota = self.quota(tenant)
        if quota.max_concurrent_jobs or quota.max_bytes_per_day:
            self.store.check_quota(tenant, quota)

    def submit(self, tenant: str, upload: Upload, idempotency_key: str | None = None) -> Submitted:
        """Validate the config, commit the upload's blobs, then answer from the result cache or record the
        job and enqueue it.

        ``idempotency_key``: a tenant's second submission with the same key answers the first job
        (``created`` False) when it asks for the same thing, and 422 IDEMPOTENCY_KEY_REUSED otherwise. The
        tenant's quota is checked again, exactly, when the job is recorded, and its job gets the fair-share
        priority of its jobs in flight (core/quotas.py).

        A ``callback_url`` is checked against the operator's webhook policy first (422
        CALLBACK_URL_INVALID / CALLBACK_URL_NOT_ALLOWED, core/webhooks.py). A cache hit
        (app/services/cache.py) is a new job, already succeeded, sharing the earlier job's results; nothing
        is enqueued. When the broker refuses the job, the row is deleted again and BROKER_UNAVAILABLE
        raised, so a client that gets an error never has a job it does not know about.
        """
        with upload:
            config = validate_config(upload.config)
            if config.callback_url is not None:
                check_destination(
                    config.callback_url, self.settings.webhooks, has_secret=tenant in self.webhook_tenants
                )
            upload.commit()
        if self.metrics is not None:
            self.metrics.upload_bytes.labels("model").inc(upload.model.size)
            if upload.samples is not None:
                self.metrics.upload_bytes.labels("samples").inc(upload.samples.size)
        fingerprint = request_fingerprint(upload, config)
        if idempotency_key is not None:
            earlier = self.store.find_idempotent(tenant, idempotency_key)
            if earlier is not None:
                return self._replay(earlier, fingerprint)
        intake = Intake(
            upload_bytes=upload.model.size + (upload.samples.size if upload.samples else 0),
            idempotency_key=idempotency_key,
            request_sha256=fingerprint,
        )
        try:
            return Submitted(self._record(tenant, upload, config, intake), created=True)
        except ConflictError as exc:
            if exc.code != "IDEMPOTENCY_KEY_IN_USE" or idempotency_key is None:
                raise
            earlier = self.store.find_idempotent(tenant, idempotency_key)  # the concurrent twin that won
            if earlier is None:
                raise
            return self._replay(earlier, fingerprint)

    def _replay(self, earlier: Job, fingerprint: str) -> Submitted:
        if earlier.request_sha256 != fingerprint:
            raise InvalidInputError(
                f"this Idempotency-Key was used for job {earlier.id} with another model, samples or config; "
                "use a new key for a new job",
                code="IDEMPOTENCY_KEY_REUSED",
                detail={"job_id": earlier.id},
            )
        log.info("job %s answered again for its Idempotency-Key", earlier.id)
        return Submitted(earlier, created=False)

    def _record(self, tenant: str, upload: Upload, config: JobConfig, intake: Intake) -> Job:
        queue = "gpu" if config.target in GPU_TARGETS else "cpu"
        samples_sha256 = upload.samples.sha256 if upload.samples else None
        key = None
        if self.settings.cache.enabled:
            key = cache.cache_key(
                model_sha256=upload.model.sha256,
                samples_sha256=samples_sha256,
                config=config,
                queue=queue,
                settings=self.settings,
            )
            if config.use_cache:
                hit = self._from_cache(tenant, key, queue, upload, config, intake=intake)
                if hit is not None:
                    return hit
        quota = self.quota(tenant)
        in_flight = self.store.check_quota(tenant, quota, intake.upload_bytes)
        job = self.store.create(
            tenant=tenant,
            model_sha256=upload.model.sha256,
            model_filename=upload.model.filename,
            model_format=upload.model.format,
            model_size=upload.model.size,
            samples_sha256=samples_sha256,
            config=config.model_dump(mode="json"),
            queue=queue,
            cache_key=key,
            webhook=config.callback_url is not None,
            intake=intake,
            quota=quota,
        )
        try:
            self.dispatcher.enqueue(job.id, queue, quota.fair_priority(in_flight))
        except BaseException as exc:
            self.store.delete(job.id)
            if isinstance(exc, UnavailableError):
                raise UnavailableError(
                    f"the job queue is unavailable, nothing was submitted; retry later ({exc.message})",
                    code="BROKER_UNAVAILABLE",
                ) from exc
            raise
        bind(job_id=job.id)  # the request's later lines, its access line included, name the job
        set_attributes(job_id=job.id)  # and so does its span, when tracing is on
        log.info("job %s queued on %s (tenant %s, model %s)", job.id, queue, tenant, job.model_sha256[:12])
        return job

    def _from_cache(
        self, tenant: str, key: str, queue: str, upload: Upload, config: JobConfig, *, intake: Intake
    ) -> Job | None:
        earlier = cache.lookup(self.store, key, tenant=tenant, queue=queue, settings=self.settings)
        shas = (earlier.artifact_sha256, earlier.report_sha256, earlier.report_html_sha256) if earlier else ()
        usable = earlier is not None and all(sha is not None and self.blobs.exists(sha) for sha in shas)
        if self.metrics is not None:
            self.metrics.cache_lookups.labels("hit" if usable else "miss").inc()
        if not usable or earlier is None:
            return None
        job = self.store.create_cached(
            earlier,
            tenant=tenant,
            model_filename=upload.model.filename,
            config=config.model_dump(mode="json"),
            webhook=config.callback_url is not None,
            intake=intake,
        )
        if self.metrics is not None:
            self.metrics.cache_hits.inc()
        log.info("job %s answered from the cache (job %s, tenant %s)", job.id, earlier.id, tenant)
        return job

    def get(self, tenant: str, job_id: str) -> Job:
        return self.store.get(job_id, tenant)

    def list(self, tenant: str, *, limit: int, offset: int, state: str | None) -> tuple[list[Job], int]:
        page_max = self.settings.api.page_size_max
        if not 1 <= limit <= page_max:
            raise InvalidInputError(f"limit must be between 1 and {page_max}", code="PAGINATION_INVALID")
        if offset < 0:
            raise InvalidInputError("offset must not be negative", code="PAGINATION_INVALID")
        if state is not None and state not in STATES:
            raise InvalidInputError(f"state must be one of {', '.join(STATES)}", code="PAGINATION_INVALID")
        return self.store.list(tenant, limit=limit, offset=offset, state=state)

    def cancel(self, tenant: str, job_id: str) -> Job:
        return self.store.request_cancel(job_id, tenant)

    def delete(self, tenant: str, job_id: str) -> tuple[Job, bool]:
        """Delete a job: a queued or finished one at once, row and files (True); a running one is canceled
        first and goes when its worker stops (False). Files another job still names stay; files younger
        than retention.blob_grace_seconds are left to the next purge (core/retention.py)."""
        job, deleted = self.store.remove(job_id, tenant)
        if deleted:
            grace = self.settings.retention.blob_grace_seconds
            stats = drop_unreferenced(self.store, self.blobs, job_blobs(job), grace_seconds=grace)
            log.info("job %s deleted (%d files, %d bytes freed)", job.id, stats.blobs_deleted, stats.bytes_freed)
        else:
            log.info("job %s: cancel requested; deleted once its worker stops", job.id)
        return job, deleted

    def _succeeded(self, tenant: str, job_id: str) -> Job:
        job = self.store.get(job_id, tenant)
        if job.state != "succeeded":
            raise ConflictError(
                f"job {job_id} is {job.state}; results exist only once it has succeeded",
                code="JOB_NOT_SUCCEEDED",
                detail={"state": job.state},
            )
        return job

    def artifact(self, tenant: str, job_id: str) -> Download:
        job = self._succeeded(tenant, job_id)
        if job.artifact_expired_at is not None:
            raise NotFoundError(
                f"job {job_id}'s optimized model was deleted by the retention policy", code="ARTIFACT_EXPIRED"
            )
        assert job.artifact_sha256 is not None and job.artifact_format is not None
        filename = artifact_filename(job.model_filename, job.artifact_format)
        media_type = "application/zip" if job.artifact_format == "zip" else "application/octet-stream"
        # Object storage: the client downloads the (possibly multi-GB) model from the store, not through us.
        url = self.blobs.presigned_url(job.artifact_sha256, filename=filename, media_type=media_type)
        if url is not None:
            return Download(filename, media_type, url=url)
        return Download(filename, media_type, path=self.blobs.path(job.artifact_sha256))

    def report(self, tenant: str, job_id: str, *, html: bool) -> Download:
        job = self._succeeded(tenant, job_id)
        if job.reports_expired_at is not None:
            raise NotFoundError(f"job {job_id}'s reports were deleted by the retention policy", code="REPORT_EXPIRED")
        sha = job.report_html_sha256 if html else job.report_sha256
        assert sha is not None
        filename = "report.html" if html else "report.json"
        media_type = "text/html; charset=utf-8" if html else "application/json"
        # Reports are served by the API wherever they are stored, so their security headers apply.
        path = self.blobs.local_path(sha)
        if path is not None:
            return Download(filename, media_type, path=path)
        return Download(filename, media_type, chunks=self.blobs.read_chunks(sha))

    def readiness(self) -> dict[str, str]:
        """Each dependency and ``ok`` or why it failed; never raises."""
        checks: dict[str, str] = {}
        probes: dict[str, Any] = {
            "database": self.store.ping,
            "broker": self.dispatcher.ping,
            "storage": self.blobs.ping,
        }
        for name, probe in probes.items():
            try:
                probe()
                checks[name] = "ok"
            except OnnxforgeError as exc:
                checks[name] = f"{exc.code}: {exc.message}"
            except Exception as exc:
                log.warning("readiness probe %s failed", name, exc_info=exc)
                checks[name] = f"error: {type(exc).__name__}"
        return checks
