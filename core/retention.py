"""Retention: how long each kind of a finished job's files (and its row) are kept, and the purge that enforces it.

Kinds and their settings (``retention.*_days``, per team in ``retention.teams``; 0 keeps forever), counted
from when the job finished; queued and running jobs are never touched:

* ``uploads``: the model and samples; ``artifacts``: the optimized model; ``reports``: JSON and HTML;
* ``jobs``: the row itself, and with it every file of the job.

``purge`` first records in the job table what goes (so downloads answer 404 *_EXPIRED and the result
cache stops reusing the job), then deletes each file that no remaining job still names: blobs are
content-addressed and shared (the same model uploaded twice, a cache hit reusing an earlier artifact).
A file written or re-uploaded within ``retention.blob_grace_seconds`` is left for the next purge, so an
upload in flight that shares it keeps it. ``sweep=True`` also deletes every older blob that no row names
at all (left by a DELETE of a running job, or by a crash between the two steps).

``onnxforge purge`` runs it; DELETE /v1/jobs/{id} removes one job through ``drop_unreferenced``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from core.errors import NotFoundError
from core.store_retention import KINDS, job_blobs

if TYPE_CHECKING:
    from core.settings import RetentionSettings
    from core.storage import BlobStore
    from core.store import Job, JobStore

log = logging.getLogger("onnxforge.retention")

_BATCH = 500


@dataclasses.dataclass(frozen=True)
class Policy:
    """One team's time to live per kind; None keeps forever."""

    uploads: timedelta | None
    artifacts: timedelta | None
    reports: timedelta | None
    jobs: timedelta | None

    @classmethod
    def for_team(cls, settings: RetentionSettings, team: str) -> Policy:
        override = settings.teams.get(team)

        def ttl(kind: str) -> timedelta | None:
            value = getattr(override, f"{kind}_days", None) if override is not None else None
            days = float(getattr(settings, f"{kind}_days") if value is None else value)
            return timedelta(days=days) if days > 0 else None

        return cls(uploads=ttl("uploads"), artifacts=ttl("artifacts"), reports=ttl("reports"), jobs=ttl("jobs"))

    def shortest(self) -> timedelta | None:
        ttls = [t for t in (self.uploads, self.artifacts, self.reports, self.jobs) if t is not None]
        return min(ttls) if ttls else None

    def expired_kinds(self, job: Job, now: datetime) -> list[str]:
        """The kinds of ``job``'s files whose time is up and that are not recorded as removed yet."""
        assert job.finished_at is not None
        age = now - job.finished_at
        return [
            kind
            for kind in KINDS
            if (ttl := getattr(self, kind)) is not None
            and age >= ttl
            and getattr(job, KINDS[kind][1]) is None
            and job_blobs(job, [kind])
        ]


@dataclasses.dataclass
class PurgeStats:
    jobs_deleted: int = 0
    files_expired: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    blobs_deleted: int = 0
    bytes_freed: int = 0
    blobs_kept_in_grace: int = 0

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def drop_unreferenced(
    store: JobStore, blobs: BlobStore, shas: Iterable[str], *, grace_seconds: float, stats: PurgeStats | None = None
) -> PurgeStats:
    """Delete those of ``shas`` that no remaining job names and that are older than the grace period."""
    stats = stats or PurgeStats()
    candidates = set(shas)
    for sha in sorted(candidates - store.referenced(candidates)):
        age = blobs.age_seconds(sha)
        if age is None:
            continue
        if age < grace_seconds:
            stats.blobs_kept_in_grace += 1
            continue
        size = _size(blobs, sha)
        if blobs.delete(sha):
            stats.blobs_deleted += 1
            stats.bytes_freed += size
    return stats


def purge(
    store: JobStore,
    blobs: BlobStore,
    settings: RetentionSettings,
    *,
    now: datetime | None = None,
    sweep: bool = False,
) -> PurgeStats:
    """Apply every team's retention once (see the module docstring); returns what went."""
    now = now or datetime.now(UTC)
    stats = PurgeStats()
    policies: dict[str, Policy] = {}
    # "" stands for every team without an entry of its own: the section's defaults.
    ttls = [t for team in ["", *settings.teams] if (t := Policy.for_team(settings, team).shortest()) is not None]
    # Jobs finished before now - (shortest TTL of any team) may have something due; DELETEd ones always do.
    finished_before = now - min(ttls) if ttls else None
    released: set[str] = set()
    after: tuple[datetime, str] | None = None
    while batch := store.purge_candidates(finished_before, _BATCH, after):
        for job in batch:
            assert job.finished_at is not None
            policy = policies.setdefault(job.tenant, Policy.for_team(settings, job.tenant))
            if job.delete_requested or (policy.jobs is not None and now - job.finished_at >= policy.jobs):
                if store.delete_finished(job.id) is not None:
                    stats.jobs_deleted += 1
                    released |= job_blobs(job)
                continue
            kinds = policy.expired_kinds(job, now)
            if kinds:
                store.expire(job.id, kinds)
                for kind in kinds:
                    stats.files_expired[kind] += 1
                released |= job_blobs(job, kinds)
        last = batch[-1]
        assert last.finished_at is not None
        after = (last.finished_at, last.id)
    drop_unreferenced(store, blobs, released, grace_seconds=settings.blob_grace_seconds, stats=stats)
    if sweep:
        drop_unreferenced(store, blobs, blobs.iter_shas(), grace_seconds=settings.blob_grace_seconds, stats=stats)
    log.info(
        "purge: %d jobs deleted, files expired %s, %d files (%d bytes) deleted, %d kept in their grace period",
        stats.jobs_deleted,
        stats.files_expired,
        stats.blobs_deleted,
        stats.bytes_freed,
        stats.blobs_kept_in_grace,
    )
    return stats


def _size(blobs: BlobStore, sha: str) -> int:
    try:
        return blobs.path(sha).stat().st_size
    except (OSError, NotFoundError):
        return 0
