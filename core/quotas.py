"""Per-team quotas (jobs in flight, bytes per day) and the fair-share priority of a team's next job.

The limits come from the ``quotas`` settings, a team's entry in ``quotas.teams`` overriding them field by
field. The store checks them inside the transaction that inserts the job (core/store.py), so two
submissions of one team racing each other cannot both slip under a limit; the API also checks before it
reads an upload, so a team over its quota is refused before it sends gigabytes.

Fair share: Celery's Redis transport serves priority 0 before 1 before 9 on the same queue. A team's job
gets its team's base priority plus the number of jobs the team already has in flight, so a team that
floods a queue has its later jobs served after other teams' first ones, instead of ahead of them.
"""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from core.errors import ErrorKind, OnnxforgeError, TooLargeError

if TYPE_CHECKING:
    from core.settings import QuotasSettings

WINDOW = timedelta(days=1)
LOWEST_PRIORITY = 9


class QuotaExceededError(OnnxforgeError):
    """429 with Retry-After (``detail["retry_after"]``, seconds)."""

    code = "QUOTA_EXCEEDED"
    kind = ErrorKind.RATE_LIMITED


@dataclasses.dataclass(frozen=True)
class Quota:
    """One team's limits (0: none) and base priority."""

    max_concurrent_jobs: int = 0
    max_bytes_per_day: int = 0
    priority: int = 0
    retry_after_seconds: int = 30

    @classmethod
    def for_team(cls, settings: QuotasSettings, team: str) -> Quota:
        override = settings.teams.get(team)

        def pick(name: str) -> int:
            value = getattr(override, name, None) if override is not None else None
            return int(getattr(settings, name) if value is None else value)

        return cls(
            max_concurrent_jobs=pick("max_concurrent_jobs"),
            max_bytes_per_day=pick("max_bytes_per_day"),
            priority=pick("priority"),
            retry_after_seconds=settings.retry_after_seconds,
        )

    def fair_priority(self, in_flight: int) -> int:
        """The broker priority of the team's next job, given the jobs it already has queued or running."""
        return min(LOWEST_PRIORITY, self.priority + max(0, in_flight))

    def check(
        self, *, team: str, in_flight: int, uploads: list[tuple[datetime, int]], new_bytes: int, now: datetime
    ) -> None:
        """Raise QuotaExceededError when one more job of ``new_bytes`` would break a limit.

        ``uploads``: (created_at, bytes) of the team's jobs created within the last 24 hours, any order.
        """
        if self.max_concurrent_jobs and in_flight >= self.max_concurrent_jobs:
            raise QuotaExceededError(
                f"team {team} has {in_flight} jobs queued or running (limit {self.max_concurrent_jobs}); "
                "retry once one has finished",
                code="QUOTA_CONCURRENT_JOBS",
                detail={"limit": self.max_concurrent_jobs, "retry_after": self.retry_after_seconds},
            )
        if not self.max_bytes_per_day:
            return
        if new_bytes > self.max_bytes_per_day:
            raise TooLargeError(
                f"this upload ({new_bytes} bytes) alone exceeds team {team}'s {self.max_bytes_per_day} bytes per day",
                code="QUOTA_BYTES_PER_DAY",
                detail={"limit_bytes": self.max_bytes_per_day},
            )
        used = sum(size for _, size in uploads)
        if used + new_bytes <= self.max_bytes_per_day:
            return
        # Wait until the oldest uploads leave the 24-hour window and free enough room.
        excess = used + new_bytes - self.max_bytes_per_day
        freed, wait_until = 0, now
        for created_at, size in sorted(uploads):
            freed += size
            wait_until = created_at + WINDOW
            if freed >= excess:
                break
        retry_after = max(1, math.ceil((wait_until - now).total_seconds()))
        raise QuotaExceededError(
            f"team {team} uploaded {used} bytes in the last 24 hours; {new_bytes} more exceed its "
            f"{self.max_bytes_per_day} bytes per day",
            code="QUOTA_BYTES_PER_DAY",
            detail={"limit_bytes": self.max_bytes_per_day, "used_bytes": used, "retry_after": retry_after},
        )
