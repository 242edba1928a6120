"""The job store's queries for the result cache, the metrics and webhook delivery (a mixin of JobStore).

Split from core/store.py, which keeps the job lifecycle (submit, claim, heartbeat, finish, cancel); these
read finished jobs or touch only their cache and webhook columns.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import Table, func, or_, select, update
from sqlalchemy.exc import IntegrityError

from core.errors import ConflictError
from core.jobtable import TERMINAL_STATES, Intake, Job, to_json

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection


class ResultQueries:
    """Needs ``table``, ``_clock`` and ``_tx`` from JobStore."""

    table: Table
    _clock: Callable[[], datetime]

    if TYPE_CHECKING:

        def _tx(self, *, write: bool = True) -> AbstractContextManager[Connection]: ...

    # ------------------------------------------------------------------------------------------ result cache

    def find_cached(
        self,
        cache_key: str,
        *,
        tenant: str | None,
        queue: str,
        max_age_seconds: int,
        hardware_sample_jobs: int,
    ) -> Job | None:
        """The newest succeeded, non-cached job with ``cache_key`` whose result may be reused, or None.

        Reusable: of ``tenant`` (None: any tenant), finished within ``max_age_seconds`` (0: any age), and run
        on a hardware class that is among those of the last ``hardware_sample_jobs`` jobs that ran on
        ``queue``, i.e. a class of worker that still serves the queue (see app/services/cache.py).
        """
        c = self.table.c
        now = self._clock()
        where = [c.cache_key == cache_key, c.state == "succeeded", c.cached_from.is_(None)]
        # A result whose files retention removed, or whose job is being deleted, is not reused.
        where += [c.artifact_expired_at.is_(None), c.reports_expired_at.is_(None), c.delete_requested.is_not(True)]
        if tenant is not None:
            where.append(c.tenant == tenant)
        if max_age_seconds:
            where.append(c.finished_at >= now - timedelta(seconds=max_age_seconds))
        recent = (
            select(c.hardware_class)
            .where(c.state == "succeeded", c.queue == queue, c.cached_from.is_(None), c.hardware_class.is_not(None))
            .order_by(c.updated_at.desc())
            .limit(hardware_sample_jobs)
        )
        with self._tx(write=False) as conn:
            live = {row[0] for row in conn.execute(recent).all()}
            if not live:
                return None
            where.append(c.hardware_class.in_(sorted(live)))
            row = conn.execute(select(self.table).where(*where).order_by(c.finished_at.desc()).limit(1)).one_or_none()
        return None if row is None else Job.from_row(row)

    def create_cached(
        self,
        earlier: Job,
        *,
        tenant: str,
        model_filename: str,
        config: dict[str, Any],
        webhook: bool = False,
        intake: Intake | None = None,
    ) -> Job:
        """A new job, succeeded at once, sharing ``earlier``'s artifact and reports (``cached_from``)."""
        now = self._clock()
        summary = {**(earlier.summary or {}), "cached": True}
        values = {
            "id": str(uuid.uuid4()),
            "tenant": tenant,
            "state": "succeeded",
            "stage": None,
            "progress": 1.0,
            "created_at": now,
            "started_at": now,
            "finished_at": now,
            "updated_at": now,
            "model_sha256": earlier.model_sha256,
            "model_filename": model_filename,
            "model_format": earlier.model_format,
            "model_size": earlier.model_size,
            "samples_sha256": earlier.samples_sha256,
            "config": to_json(config),
            "queue": earlier.queue,
            "attempts": 0,
            "cancel_requested": False,
            "artifact_sha256": earlier.artifact_sha256,
            "artifact_format": earlier.artifact_format,
            "report_sha256": earlier.report_sha256,
            "report_html_sha256": earlier.report_html_sha256,
            "summary": to_json(summary),
            "timings": to_json({}),
            "cache_key": earlier.cache_key,
            "cached_from": earlier.id,
            "hardware_class": earlier.hardware_class,
            "webhook_state": "pending" if webhook else None,
            "webhook_attempts": 0 if webhook else None,
            **(intake.values() if intake is not None else {}),
        }
        try:
            with self._tx() as conn:
                row = conn.execute(self.table.insert().values(values).returning(*self.table.c)).one()
        except IntegrityError as exc:  # the unique (tenant, idempotency_key): a concurrent retry won
            raise ConflictError(
                "another request with this Idempotency-Key is being submitted", code="IDEMPOTENCY_KEY_IN_USE"
            ) from exc
        return Job.from_row(row)

    # ------------------------------------------------------------------------------------------------ metrics

    def count_by_state(self) -> dict[tuple[str, str], int]:
        """{(queue, state): jobs}; one grouped count."""
        c = self.table.c
        with self._tx(write=False) as conn:
            rows = conn.execute(select(c.queue, c.state, func.count()).group_by(c.queue, c.state)).all()
        return {(str(q), str(s)): int(n) for q, s, n in rows}

    def recently_finished(self, since: datetime, limit: int) -> list[Job]:
        """Terminal jobs updated since ``since`` (for terminal jobs, when they finished), newest first."""
        c = self.table.c
        query = (
            select(self.table)
            .where(c.state.in_(sorted(TERMINAL_STATES)), c.updated_at >= since)
            .order_by(c.updated_at.desc())
            .limit(limit)
        )
        with self._tx(write=False) as conn:
            return [Job.from_row(r) for r in conn.execute(query).all()]

    # ---------------------------------------------------------------------------------------------- webhooks

    def due_webhooks(self, now: datetime, limit: int) -> list[Job]:
        """Finished jobs whose webhook is pending and due (never tried, or its retry time has come)."""
        c = self.table.c
        query = (
            select(self.table)
            .where(
                c.webhook_state == "pending",
                c.state.in_(sorted(TERMINAL_STATES)),
                or_(c.webhook_next_at.is_(None), c.webhook_next_at <= now),
            )
            .order_by(c.updated_at)
            .limit(limit)
        )
        with self._tx(write=False) as conn:
            return [Job.from_row(r) for r in conn.execute(query).all()]

    def claim_webhook(self, job_id: str, attempts: int, lease_seconds: float) -> Job | None:
        """Take one delivery attempt (compare-and-set on ``webhook_attempts``); None when another worker did.

        The claim pushes ``webhook_next_at`` past the delivery's time budget, so a worker that dies while
        delivering leaves the webhook due again afterwards, for another worker to retry.
        """
        now = self._clock()
        c = self.table.c
        with self._tx() as conn:
            row = conn.execute(
                update(self.table)
                .where(
                    c.id == job_id,
                    c.webhook_state == "pending",
                    func.coalesce(c.webhook_attempts, 0) == attempts,
                    or_(c.webhook_next_at.is_(None), c.webhook_next_at <= now),
                )
                .values(webhook_attempts=attempts + 1, webhook_next_at=now + timedelta(seconds=lease_seconds))
                .returning(*c)
            ).one_or_none()
        return None if row is None else Job.from_row(row)

    def finish_webhook(
        self, job_id: str, attempt: int, *, delivered: bool, error: str | None, retry_in_seconds: float | None
    ) -> None:
        """Record one attempt: delivered, retried after ``retry_in_seconds``, or given up (None)."""
        c = self.table.c
        if delivered:
            values: dict[str, Any] = {"webhook_state": "delivered", "webhook_next_at": None, "webhook_error": None}
        elif retry_in_seconds is None:
            values = {"webhook_state": "failed", "webhook_next_at": None, "webhook_error": (error or "")[:1000]}
        else:
            values = {
                "webhook_next_at": self._clock() + timedelta(seconds=retry_in_seconds),
                "webhook_error": (error or "")[:1000],
            }
        with self._tx() as conn:
            conn.execute(
                update(self.table)
                .where(c.id == job_id, c.webhook_state == "pending", c.webhook_attempts == attempt)
                .values(values)
            )
