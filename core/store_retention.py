"""The job store's deletions: DELETE /v1/jobs/{id}, and what retention (core/retention.py) expires or removes.

A mixin of JobStore. Removing a job's row or marking a kind of its files expired happens here, in one
transaction per job; deleting the files themselves is core/retention.py's, and only once no remaining row
still names them (``referenced``): blobs are content-addressed, so two jobs (or a job and a cache hit made
from it) can share one file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Table, and_, delete, or_, select, update

from core.errors import NotFoundError
from core.jobtable import TERMINAL_STATES, Job

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

# Each kind of file, the columns naming its blobs, and the column recording that retention removed it.
KINDS: dict[str, tuple[tuple[str, ...], str]] = {
    "uploads": (("model_sha256", "samples_sha256"), "uploads_expired_at"),
    "artifacts": (("artifact_sha256",), "artifact_expired_at"),
    "reports": (("report_sha256", "report_html_sha256"), "reports_expired_at"),
}


def job_blobs(job: Job, kinds: Iterable[str] = KINDS) -> set[str]:
    """The blob digests a job names, for the given kinds of file."""
    shas: set[str] = set()
    for kind in kinds:
        for column in KINDS[kind][0]:
            value = getattr(job, column)
            if value:
                shas.add(value)
    return shas


class RetentionQueries:
    """Needs ``table``, ``_clock`` and ``_tx`` from JobStore."""

    table: Table
    _clock: Callable[[], datetime]

    if TYPE_CHECKING:

        def _tx(self, *, write: bool = True) -> AbstractContextManager[Connection]: ...

    def remove(self, job_id: str, tenant: str | None) -> tuple[Job, bool]:
        """DELETE: a queued or finished job's row goes at once (True); a running job is asked to cancel and
        marked ``delete_requested`` (False): its worker removes the row when it stops (``mark_canceled``),
        or the next purge does. Another tenant's job is not found (security.md T13)."""
        c = self.table.c
        match = [c.id == job_id] + ([c.tenant == tenant] if tenant is not None else [])
        with self._tx() as conn:
            row = conn.execute(delete(self.table).where(*match, c.state != "running").returning(*c)).one_or_none()
            if row is not None:
                return Job.from_row(row), True
            row = conn.execute(
                update(self.table)
                .where(*match, c.state == "running")
                .values(cancel_requested=True, delete_requested=True, updated_at=self._clock())
                .returning(*c)
            ).one_or_none()
        if row is None:
            raise NotFoundError(f"no job {job_id!r}", code="JOB_NOT_FOUND")
        return Job.from_row(row), False

    def purge_candidates(
        self, finished_before: datetime | None, limit: int, after: tuple[datetime, str] | None = None
    ) -> list[Job]:
        """Finished jobs that DELETE asked to remove, and (``finished_before`` given) those finished earlier
        than it: the jobs retention may have something to do for. Ordered by (finished_at, id); ``after``
        continues from the last one of the previous page."""
        c = self.table.c
        due = [c.delete_requested.is_(True)]
        if finished_before is not None:
            due.append(c.finished_at < finished_before)
        where = [c.state.in_(sorted(TERMINAL_STATES)), or_(*due)]
        if after is not None:
            where.append(or_(c.finished_at > after[0], and_(c.finished_at == after[0], c.id > after[1])))
        query = select(self.table).where(*where).order_by(c.finished_at, c.id).limit(limit)
        with self._tx(write=False) as conn:
            return [Job.from_row(r) for r in conn.execute(query).all()]

    def expire(self, job_id: str, kinds: Iterable[str]) -> None:
        """Record that retention removed these kinds of the job's files (downloads then answer 404 *_EXPIRED,
        and the result cache no longer reuses the job)."""
        now = self._clock()
        values: dict[str, Any] = {KINDS[kind][1]: now for kind in kinds}
        if values:
            with self._tx() as conn:
                conn.execute(update(self.table).where(self.table.c.id == job_id).values(values))

    def delete_finished(self, job_id: str) -> Job | None:
        """Remove a finished job's row; None when it is gone already or not finished."""
        c = self.table.c
        with self._tx() as conn:
            row = conn.execute(
                delete(self.table).where(c.id == job_id, c.state.in_(sorted(TERMINAL_STATES))).returning(*c)
            ).one_or_none()
        return None if row is None else Job.from_row(row)

    def referenced(self, shas: Iterable[str]) -> set[str]:
        """Those of ``shas`` that a remaining job still needs: named by a column whose kind has not expired."""
        wanted = sorted(set(shas))
        found: set[str] = set()
        c = self.table.c
        with self._tx(write=False) as conn:
            for start in range(0, len(wanted), 500):
                batch = wanted[start : start + 500]
                for columns, expired in KINDS.values():
                    for column in columns:
                        rows = conn.execute(
                            select(c[column]).where(and_(c[column].in_(batch), c[expired].is_(None))).distinct()
                        ).all()
                        found.update(r[0] for r in rows)
        return found
