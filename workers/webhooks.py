"""Deliver webhooks of finished jobs, from the job table (a transactional outbox), with retries.

A job submitted with a ``callback_url`` gets ``webhook_state = pending`` in its row. Once the job is
terminal (whoever made it so: a worker, a cancel in the API, a cache hit, the WORKER_LOST cap), every
worker's main process finds it here: ``webhook_loop`` polls ``store.due_webhooks`` every
``webhooks.poll_seconds``, takes an attempt with ``store.claim_webhook`` (compare-and-set, so exactly one
worker sends each attempt), POSTs it (core/webhooks.py: destination checks, HMAC signature), and
records the outcome: delivered; or retried after ``retry_base_seconds * 2**(attempt-1)``; or, after
``webhooks.max_attempts``, failed with the last error.

Why the table and not a Celery task: the table survives restarts of every process and the loss of broker
messages (the embedded filesystem queue cannot redeliver after SIGKILL), needs no extra queue for workers to
consume, and is not stuck behind hour-long jobs in a worker pool of one. A worker that dies mid-delivery
leaves the claim to expire (``webhook_next_at``), and another worker retries. Receivers may therefore see
a notice more than once; ``X-Onnxforge-Delivery`` (the job id) lets them deduplicate.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from core.webhooks import deliver

if TYPE_CHECKING:
    from core.settings import Settings
    from core.store import JobStore

log = logging.getLogger(__name__)

BATCH = 20


def retry_delay(settings: Settings, attempt: int) -> float:
    """Seconds before the attempt after ``attempt`` (1-based): base, 2x base, 4x base, ..."""
    return float(settings.webhooks.retry_base_seconds * (2 ** (attempt - 1)))


def deliver_due(store: JobStore, settings: Settings, secrets: dict[str, str]) -> int:
    """One round: try every due webhook once; returns how many attempts were made."""
    policy = settings.webhooks
    # The claim must outlast one attempt (connect + read timeouts, and some slack) so no one else retries it.
    lease = 3 * policy.timeout_seconds + 5
    made = 0
    for job in store.due_webhooks(datetime.now(UTC), BATCH):
        attempts = job.webhook_attempts or 0
        claimed = store.claim_webhook(job.id, attempts, lease)
        if claimed is None:
            continue
        attempt = attempts + 1
        secret = secrets.get(claimed.tenant)
        if secret is None:
            outcome_error: str | None = f"no webhook secret for tenant {claimed.tenant!r}"
            delivered = False
        else:
            outcome = deliver(claimed, secret, policy)
            delivered, outcome_error = outcome.delivered, outcome.error
        made += 1
        if delivered:
            log.info("webhook of job %s delivered (attempt %d)", job.id, attempt)
            store.finish_webhook(job.id, attempt, delivered=True, error=None, retry_in_seconds=None)
            continue
        retry = retry_delay(settings, attempt) if attempt < policy.max_attempts else None
        log.warning(
            "webhook of job %s attempt %d/%d failed: %s%s",
            job.id,
            attempt,
            policy.max_attempts,
            outcome_error,
            f"; retrying in {retry:.1f} s" if retry is not None else "; giving up",
        )
        store.finish_webhook(job.id, attempt, delivered=False, error=outcome_error, retry_in_seconds=retry)
    return made


def start_webhook_thread(
    store: JobStore, settings: Settings, stop: threading.Event | None = None
) -> threading.Thread | None:
    """Run ``deliver_due`` every ``webhooks.poll_seconds`` in a daemon thread; None when webhooks are off."""
    if not settings.webhooks.allowed_hosts:
        return None
    try:
        secrets = settings.webhooks.tenant_secrets()
    except ValueError as exc:
        log.error("webhooks disabled in this worker: %s", exc)
        return None
    stop = stop or threading.Event()

    def loop() -> None:
        while not stop.wait(settings.webhooks.poll_seconds):
            try:
                deliver_due(store, settings, secrets)
            except Exception:  # a database outage must not kill the thread; try again next round
                log.warning("webhook round failed", exc_info=True)

    thread = threading.Thread(target=loop, name="onnxforge-webhooks", daemon=True)
    thread.stop_event = stop  # type: ignore[attr-defined]
    thread.start()
    return thread
