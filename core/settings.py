"""The one typed Settings object for API, workers, CLI and pipeline.

Every value can be set from the environment with the prefix ``ONNXFORGE_`` and ``__`` between a section and
its field, e.g. ``ONNXFORGE_BROKER__URL=redis://127.0.0.1:6379/0``. With nothing set, the service runs on
embedded defaults: SQLite for job state, a local directory for blobs and a filesystem message queue that
``onnxforge serve`` feeds to worker processes it starts itself.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.keys import check_key_mapping


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ApiSettings(_Section):
    host: str = Field("127.0.0.1", description="Address uvicorn binds to.")
    port: int = Field(8000, ge=0, le=65535, description="Port uvicorn binds to (0 picks a free one).")
    max_upload_bytes: int = Field(
        4 << 30, gt=0, description="Largest accepted upload (model or archive), in bytes; larger answers 413."
    )
    max_samples_bytes: int = Field(256 << 20, gt=0, description="Largest accepted samples.npz, in bytes.")
    max_config_bytes: int = Field(64 << 10, gt=0, description="Largest accepted config JSON, in bytes.")
    page_size_max: int = Field(200, gt=0, description="Largest page size accepted by GET /v1/jobs.")
    max_concurrent_uploads_per_tenant: int = Field(
        2,
        ge=1,
        description="Uploads one tenant may have in flight at once, counted per API process; more answer "
        "429 TOO_MANY_UPLOADS with Retry-After.",
    )


class AuthSettings(_Section):
    keys_file: Path | None = Field(
        None,
        description="JSON or TOML file mapping each tenant to a list of SHA-256 hashes of its API keys "
        '({"team-a": ["HASH", ...]}); read by the API at startup. `onnxforge keys new` makes a key and its hash.',
    )
    keys: dict[str, list[str]] = Field(
        default_factory=dict,
        description='The same tenant -> key-hash mapping as JSON, e.g. {"team-a": ["HASH"]}; merged with keys_file. '
        "Hashes only, never keys.",
    )
    open_mode: bool | None = Field(
        None,
        description="Serve /v1 without a token, every caller as tenant `default`. Unset: open only when no keys "
        "are configured and api.host is loopback. true is refused with a non-loopback host or with keys.",
    )

    @field_validator("keys_file", "open_mode", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # deploy/env.example writes unset values as `NAME=`; an empty keys_file must not become Path(".").
        return None if value == "" else value

    @field_validator("keys")
    @classmethod
    def _hashes_only(cls, keys: dict[str, list[str]]) -> dict[str, list[str]]:
        return check_key_mapping(keys, "auth.keys")

    @property
    def configured(self) -> bool:
        return self.keys_file is not None or any(self.keys.values())


def _none_if_empty(value: object) -> object:
    # deploy/env.example writes unset values as `NAME=`: an empty string means "not set", never "set to ''".
    return None if isinstance(value, str) and not value.strip() else value


class DatabaseSettings(_Section):
    url: str | None = Field(
        None,
        description="SQLAlchemy URL of the job store. Unset: SQLite at <storage.data_dir>/onnxforge.db. "
        "PostgreSQL: postgresql+psycopg://user@host/db.",
    )
    schema_name: str | None = Field(
        None, description="PostgreSQL schema holding the job table (created if missing). Unset: the default."
    )
    auto_migrate: bool = Field(
        True,
        description="API and workers upgrade the job table's schema at start (Alembic, core/migrations; "
        "serialised by a lock). false: they refuse to start on an old schema and `onnxforge migrate` runs "
        "as a deploy step.",
    )

    _empty_is_unset = field_validator("url", "schema_name", mode="before")(_none_if_empty)


class StorageSettings(_Section):
    data_dir: Path = Field(
        Path("var"),
        description="Root of local state: blobs/, work/, queue/ and the SQLite file. Shared by API and "
        "workers in distributed mode (a network volume).",
    )

    scratch_dir: Path | None = Field(
        None,
        description="Where a worker unpacks each job attempt (input, output, temp files): local disk of the worker, "
        "deleted when the attempt ends. Unset: <data_dir>/work, i.e. on the shared volume.",
    )

    backend: Literal["local", "s3"] = Field(
        "local",
        description="Where uploads, optimized models and reports live: local (blobs/ under data_dir, a shared "
        "volume in distributed mode) or s3 (an S3-compatible object store; data_dir then holds only the "
        "SQLite file and the embedded queue).",
    )
    s3_bucket: str | None = Field(None, description="Bucket of the s3 backend (must exist).")
    s3_prefix: str = Field("onnxforge/", description="Key prefix of every object, so deployments share a bucket.")
    s3_endpoint_url: str | None = Field(
        None, description="Endpoint of an S3-compatible server (MinIO, Ceph, ...). Unset: AWS S3."
    )
    s3_region: str | None = Field(None, description="Region of the bucket. Unset: boto3's default chain.")
    s3_access_key_id: str | None = Field(
        None, description="Access key. Unset: boto3's default chain (environment, instance or pod role)."
    )
    s3_secret_access_key: SecretStr | None = Field(None, description="Secret key, with s3_access_key_id.")
    s3_presign_seconds: int = Field(
        900, ge=1, le=7 * 24 * 3600, description="Lifetime of the presigned URL an artifact download redirects to."
    )
    s3_part_bytes: int = Field(
        16 << 20,
        ge=5 << 20,
        le=512 << 20,
        description="Multipart part size of uploads to the object store; one part per upload is held in memory.",
    )

    _empty_is_unset = field_validator(
        "scratch_dir",
        "s3_bucket",
        "s3_endpoint_url",
        "s3_region",
        "s3_access_key_id",
        "s3_secret_access_key",
        mode="before",
    )(_none_if_empty)

    @model_validator(mode="after")
    def _s3_needs_bucket(self) -> StorageSettings:
        if self.backend == "s3" and not self.s3_bucket:
            raise ValueError("storage.backend=s3 needs storage.s3_bucket")
        return self

    @property
    def blobs_dir(self) -> Path:
        return self.data_dir / "blobs"

    @property
    def work_dir(self) -> Path:
        """Per-job scratch: scratch_dir when set (local disk), else under the shared data_dir."""
        return self.scratch_dir if self.scratch_dir is not None else self.data_dir / "work"

    @property
    def queue_dir(self) -> Path:
        return self.data_dir / "queue"


class BrokerSettings(_Section):
    url: str | None = Field(
        None,
        description="Celery broker URL (redis://...). Unset: embedded mode, a filesystem queue under "
        "<storage.data_dir>/queue consumed by workers that `onnxforge serve` starts.",
    )
    key_prefix: str = Field(
        "onnxforge:",
        description="Prefix of every Redis key Celery writes, so several deployments share one Redis.",
    )
    visibility_timeout: int = Field(
        7200,
        gt=0,
        description="Seconds before Redis redelivers an unacknowledged task; above task_time_limit.",
    )
    connect_timeout: float = Field(2.0, gt=0, description="Seconds to wait for the broker when enqueueing.")

    _empty_is_unset = field_validator("url", mode="before")(_none_if_empty)


class WorkerSettings(_Section):
    queues: list[Literal["cpu", "gpu"]] = Field(["cpu"], description="Queues this worker consumes.")
    concurrency: int = Field(1, ge=1, description="Jobs run at once by one worker (one per GPU on GPU queues).")
    embedded_workers: int = Field(
        1, ge=0, description="Worker processes `onnxforge serve` starts in embedded mode (0: none)."
    )
    max_attempts: int = Field(3, ge=1, description="Deliveries of one job before it fails with WORKER_LOST.")
    lease_seconds: int = Field(120, ge=5, description="A running job whose lease is older is re-enqueued.")
    reconcile_interval_seconds: int = Field(30, ge=1, description="How often stale jobs are looked for.")
    task_time_limit: int = Field(3600, gt=0, description="Hard Celery time limit of one attempt, seconds.")
    child_memory_mb: int = Field(
        8192, ge=256, description="Address-space limit of the child process that runs one attempt, MiB."
    )
    child_cpu_seconds: int = Field(3000, ge=10, description="CPU-time limit of one attempt's child, seconds.")
    child_wall_seconds: int = Field(3300, ge=10, description="Wall-clock limit of one attempt's child, seconds.")
    child_file_mb: int = Field(8192, ge=16, description="Largest file the child may write, MiB.")
    gpu_mem_limit_mb: int = Field(
        0,
        ge=0,
        description="GPU memory one job's sessions may take on the CUDA EP (gpu_mem_limit, arena kSameAsRequested), "
        "MiB; 0: no limit beyond the GPU.",
    )


class PipelineSettings(_Section):
    default_preset: str = Field("safe", description="Preset used when a job names neither preset nor passes.")
    intra_op_threads: int = Field(
        0, ge=0, description="ONNX Runtime intra-op threads for verification and benchmarks (0: ORT decides)."
    )
    verify_shape_sets: int = Field(3, ge=1, description="Input shape sets generated to verify each model.")
    gate_serving_length: int = Field(
        256,
        ge=0,
        description="Tokens of the one-row set the gate times a `fast` artifact on when it ties with the upload on "
        "the generated sets (8-32 tokens), capped by the model's position table; kept only when faster there "
        "(0: no such set, the tie returns the upload).",
    )
    gate_serving_image_side: int = Field(
        224,
        ge=0,
        description="Pixels per side of the one image the gate times a `fast` artifact on when it ties with the "
        "upload, for an image model whose graph leaves the size free (the generated sets then hold 8-32 pixels); "
        "kept only when faster there (0: no such set).",
    )
    benchmark_warmup: int = Field(
        5,
        ge=0,
        description="Most untimed runs of each model per shape before it is benchmarked (fewer once a run is within "
        "10% of the one before it).",
    )
    benchmark_min_runs: int = Field(
        10,
        ge=1,
        description="Least timed runs per model and shape, unless benchmark_min_seconds pass first (never fewer than "
        "5 then).",
    )
    benchmark_min_seconds: float = Field(
        5.0,
        ge=0,
        description="Benchmark floor in time per shape, seconds: once at least 5 timed runs per model have taken "
        "this long, a settled answer may stop before benchmark_min_runs (0: benchmark_min_runs alone).",
    )
    benchmark_max_seconds: float = Field(
        10.0, gt=0, description="Benchmark time budget per model and shape, seconds (min_runs still apply)."
    )
    ledger_runs: int = Field(
        10,
        ge=1,
        description="Most timed runs of the quick latency after each pass (at least 5; fewer once the answer is "
        "settled or the time budget is spent).",
    )
    rollback_slower: bool = Field(
        True,
        description="Roll back a pass whose quick latency is slower than the model before it, beyond noise.",
    )
    constant_fold_max_bytes: int = Field(
        1 << 20, ge=0, description="Constant folding leaves any tensor larger than this many bytes unfolded."
    )


class CacheSettings(_Section):
    enabled: bool = Field(
        True,
        description="Answer a submission from an earlier succeeded job with the same model, samples, effective "
        "configuration, tool versions and hardware class: a new job, succeeded at once, marked cached.",
    )
    cross_tenant: bool = Field(
        False,
        description="Also reuse another tenant's result. The earlier job's report (its id, file name and timings) "
        "is then served to the other tenant: enable only where tenants trust each other.",
    )
    max_age_seconds: int = Field(
        30 * 24 * 3600, ge=0, description="Results older than this are not reused (0: no age limit)."
    )
    hardware_sample_jobs: int = Field(
        20,
        ge=1,
        description="A result is reused only if its worker's hardware class is among those of the last this many "
        "jobs that ran on the same queue, i.e. a class still serving it.",
    )


class TeamQuota(_Section):
    """One team's overrides of the quotas section; an unset field takes the section's value."""

    max_concurrent_jobs: int | None = Field(None, ge=0)
    max_bytes_per_day: int | None = Field(None, ge=0)
    priority: int | None = Field(None, ge=0, le=9)


class QuotasSettings(_Section):
    max_concurrent_jobs: int = Field(
        0,
        ge=0,
        description="Jobs one team may have queued or running at once; a further submission answers 429 "
        "QUOTA_CONCURRENT_JOBS with Retry-After (0: no limit).",
    )
    max_bytes_per_day: int = Field(
        0,
        ge=0,
        description="Bytes (model plus samples) one team may upload in any 24 hours; more answers 429 "
        "QUOTA_BYTES_PER_DAY with Retry-After, the seconds until enough of the window has passed (0: no limit).",
    )
    retry_after_seconds: int = Field(
        30, ge=1, description="Retry-After of a 429 QUOTA_CONCURRENT_JOBS: when a running job may have finished."
    )
    priority: int = Field(
        0,
        ge=0,
        le=9,
        description="Broker priority of a team's job, 0 (first) to 9 (last), plus one for each job the team already "
        "has queued or running, so a team with many jobs in flight yields the shared queues to teams with few "
        "(Redis broker; the embedded queue is first in, first out).",
    )
    teams: dict[str, TeamQuota] = Field(
        default_factory=dict,
        description='Per-team overrides as JSON, e.g. {"team-a": {"max_concurrent_jobs": 8, "priority": 2}}.',
    )


class TeamRetention(_Section):
    """One team's overrides of the retention section; an unset field takes the section's value."""

    uploads_days: float | None = Field(None, ge=0)
    artifacts_days: float | None = Field(None, ge=0)
    reports_days: float | None = Field(None, ge=0)
    jobs_days: float | None = Field(None, ge=0)


class RetentionSettings(_Section):
    uploads_days: float = Field(
        0, ge=0, description="Days after a job finished that `onnxforge purge` deletes its model and samples (0: keep)."
    )
    artifacts_days: float = Field(
        0, ge=0, description="Days after a job finished that its optimized model is deleted (0: keep)."
    )
    reports_days: float = Field(
        0, ge=0, description="Days after a job finished that its JSON and HTML reports are deleted (0: keep)."
    )
    jobs_days: float = Field(
        0, ge=0, description="Days after a job finished that its row and every file of it are deleted (0: keep)."
    )
    teams: dict[str, TeamRetention] = Field(
        default_factory=dict,
        description='Per-team overrides as JSON, e.g. {"team-a": {"artifacts_days": 30, "jobs_days": 90}}.',
    )
    blob_grace_seconds: int = Field(
        600,
        ge=0,
        description="A stored file written or re-uploaded within this many seconds is never deleted, so an upload "
        "in flight that shares it with a deleted job keeps it; the next purge collects it.",
    )


class MetricsSettings(_Section):
    enabled: bool = Field(True, description="Serve Prometheus metrics at GET /metrics (no API key).")
    allow_from: list[str] = Field(
        default_factory=list,
        description='Client addresses or networks allowed to read /metrics, e.g. ["127.0.0.1/32", "10.0.0.0/8"]; '
        "others get 403. Empty: anyone who reaches the API.",
    )
    window_seconds: int = Field(
        3600, ge=1, description="Job and pass duration histograms cover jobs finished within this many seconds."
    )
    window_max_jobs: int = Field(
        1000, ge=1, description="At most this many recently finished jobs are read per scrape for the histograms."
    )

    @field_validator("allow_from")
    @classmethod
    def _networks(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"metrics.allow_from: {entry!r} is not an IP address or network") from None
        return entries


class TracingSettings(_Section):
    enabled: bool = Field(
        False,
        description="OpenTelemetry traces across API -> queue -> worker (needs the otel extra); off: nothing of "
        "OpenTelemetry is imported.",
    )
    exporter: Literal["otlp", "file"] = Field(
        "otlp", description="otlp: OTLP over HTTP to otlp_endpoint; file: one JSON line per span appended to file."
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces; unset: the exporter's default "
        "and OTEL_EXPORTER_OTLP_* variables.",
    )
    file: Path | None = Field(None, description="exporter=file: the file every process appends its spans to.")
    service_name: str = Field(
        "onnxforge", description="service.name of the spans, suffixed -api or -worker by the process."
    )

    @model_validator(mode="after")
    def _file_named(self) -> TracingSettings:
        if self.enabled and self.exporter == "file" and self.file is None:
            raise ValueError("tracing.exporter=file needs tracing.file")
        return self


class WebhooksSettings(_Section):
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description='Host names (or IP literals) a job\'s callback_url may name; "*.example.com" matches '
        "subdomains. Empty: webhooks are off and a callback_url is refused.",
    )
    allow_http: bool = Field(False, description="Accept http:// callback URLs; otherwise https only.")
    allow_private: bool = Field(
        False,
        description="Deliver to private, loopback, link-local and other non-public addresses (refused otherwise, "
        "security.md T14). For tests and closed networks only.",
    )
    secrets: dict[str, SecretStr] = Field(
        default_factory=dict,
        description='Per-tenant HMAC secrets as JSON, {"team-a": "SECRET"}; merged with secrets_file. A tenant '
        "without a secret cannot name a callback_url.",
    )
    secrets_file: Path | None = Field(
        None, description="JSON file with the same tenant -> secret mapping; read at startup."
    )
    timeout_seconds: float = Field(5.0, gt=0, le=60, description="Connect and read timeout of one delivery.")
    max_attempts: int = Field(5, ge=1, le=20, description="Deliveries tried before a webhook is given up.")
    retry_base_seconds: float = Field(
        10.0, gt=0, description="Wait before the first retry; doubled before each further one."
    )
    poll_seconds: float = Field(1.0, gt=0, description="How often each worker looks for webhooks that are due.")

    @field_validator("secrets_file", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("allowed_hosts")
    @classmethod
    def _lower(cls, hosts: list[str]) -> list[str]:
        return [h.strip().lower().strip("[]") for h in hosts if h.strip()]

    def tenant_secrets(self) -> dict[str, str]:
        """secrets_file merged with secrets (the environment wins); raises ValueError on a bad file."""
        merged: dict[str, str] = {}
        if self.secrets_file is not None:
            import json

            try:
                data = json.loads(self.secrets_file.read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(f"webhooks.secrets_file {self.secrets_file}: cannot read it ({exc})") from None
            if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
                raise ValueError(f"webhooks.secrets_file {self.secrets_file}: expected {{tenant: secret}}")
            merged.update(data)
        merged.update({tenant: secret.get_secret_value() for tenant, secret in self.secrets.items()})
        short = sorted(tenant for tenant, secret in merged.items() if len(secret) < 16)
        if short:
            raise ValueError(f"webhook secrets must be at least 16 characters (tenants {', '.join(short)})")
        return merged


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="ONNXFORGE_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        # `ONNXFORGE_BROKER__URL=` (deploy/env.example's way of leaving a value unset) is the default, not
        # "": an empty broker URL made Celery fall back to its own amqp:// default and slipped past the
        # production guard below.
        env_ignore_empty=True,
    )

    environment: Literal["development", "production"] = Field(
        "development",
        description="production refuses the single-host embedded defaults: it needs broker.url and database.url.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    log_format: Literal["auto", "json", "text"] = Field(
        "auto",
        description="json: one JSON object per line; text: readable lines; auto: json in production, text "
        "otherwise. Every line carries request_id, job_id and team where known (core/logs.py).",
    )
    api: ApiSettings = ApiSettings()
    auth: AuthSettings = AuthSettings()
    database: DatabaseSettings = DatabaseSettings()
    storage: StorageSettings = StorageSettings()
    broker: BrokerSettings = BrokerSettings()
    worker: WorkerSettings = WorkerSettings()
    pipeline: PipelineSettings = PipelineSettings()
    cache: CacheSettings = CacheSettings()
    metrics: MetricsSettings = MetricsSettings()
    webhooks: WebhooksSettings = WebhooksSettings()
    quotas: QuotasSettings = QuotasSettings()
    retention: RetentionSettings = RetentionSettings()
    tracing: TracingSettings = TracingSettings()

    @field_validator("storage")
    @classmethod
    def _absolute_data_dir(cls, storage: StorageSettings) -> StorageSettings:
        # API and workers run from different working directories; a relative path would split the store.
        scratch = storage.scratch_dir.expanduser().resolve() if storage.scratch_dir is not None else None
        return storage.model_copy(update={"data_dir": storage.data_dir.expanduser().resolve(), "scratch_dir": scratch})

    @model_validator(mode="after")
    def _safe(self) -> Settings:
        if self.broker.visibility_timeout <= self.worker.task_time_limit:
            raise ValueError(
                "broker.visibility_timeout must exceed worker.task_time_limit, or Redis redelivers "
                "running tasks (security.md T18)"
            )
        if self.environment == "production" and (self.broker.url is None or self.database.url is None):
            raise ValueError(
                "environment=production needs ONNXFORGE_BROKER__URL and ONNXFORGE_DATABASE__URL: the "
                "embedded filesystem queue and SQLite file do not work across hosts"
            )
        if self.auth.open_mode and not self.binds_loopback_only:
            raise ValueError(
                f"auth.open_mode=true serves every caller without a token; refused with api.host={self.api.host}, "
                "which is not a loopback address: configure API keys instead (security.md T13)"
            )
        if self.auth.open_mode and self.auth.configured:
            raise ValueError("auth.open_mode=true contradicts the API keys configured; unset one of them")
        if self.auth.open_mode and self.environment == "production":
            raise ValueError("environment=production needs API keys; auth.open_mode=true is refused")
        if self.worker.child_wall_seconds >= self.worker.task_time_limit:
            raise ValueError("worker.child_wall_seconds must be below worker.task_time_limit")
        return self

    @property
    def embedded(self) -> bool:
        return self.broker.url is None

    @property
    def database_url(self) -> str:
        return self.database.url or f"sqlite:///{self.storage.data_dir / 'onnxforge.db'}"

    @property
    def binds_loopback_only(self) -> bool:
        if self.api.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.api.host).is_loopback
        except ValueError:
            return False


@lru_cache
def get_settings() -> Settings:
    return Settings()


def settings_catalogue() -> list[tuple[str, str, str]]:
    """(environment variable, default, description) for every setting, in declaration order."""
    rows: list[tuple[str, str, str]] = []
    for name, field in Settings.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            for sub_name, sub_field in annotation.model_fields.items():
                default = sub_field.get_default(call_default_factory=True)
                rows.append(
                    (
                        f"ONNXFORGE_{name.upper()}__{sub_name.upper()}",
                        _env_value(default),
                        sub_field.description or "",
                    )
                )
        else:
            rows.append((f"ONNXFORGE_{name.upper()}", _env_value(field.default), field.description or ""))
    return rows


def _env_value(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        import json

        return json.dumps(value)
    return str(value)


def render_env_example() -> str:
    lines = ["# Every onnxforge setting, with its default. Generated by `python -m core.settings --env`."]
    for env, default, description in settings_catalogue():
        lines += [f"# {description}", f"{env}={default}"]
    return "\n".join(lines) + "\n"


def render_markdown_table() -> str:
    lines = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    for env, default, description in settings_catalogue():
        lines.append(
            f"| `{env}` | `{default}` | {description.replace('|', '/')} |"
            if default
            else f"| `{env}` | | {description.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    print(render_markdown_table() if "--markdown" in sys.argv else render_env_example(), end="")
