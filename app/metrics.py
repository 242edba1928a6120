"""Prometheus metrics of the API, served at ``GET /metrics`` (app/api/metrics.py).

Several API processes and workers run at once, so each metric comes from where it is true for all of them:

* **From the job table, computed at scrape** (the same answer from every API replica; nothing is lost when
  a process restarts):
  - ``onnxforge_jobs{queue,state}``: jobs per state, one grouped ``count(*)``;
  - ``onnxforge_job_duration_seconds{queue,state}``: run time (start of the last attempt to the end) of
    jobs that finished within ``metrics.window_seconds`` (at most ``metrics.window_max_jobs`` of them,
    newest first, through the ``(state, updated_at)`` index);
  - ``onnxforge_pass_duration_seconds{pass}``: seconds per pass and job, from the ``pass_seconds`` that
    workers store in each succeeded job's summary, over the same window.
  The two duration metrics are *gauge histograms* (OpenMetrics): the distribution over a sliding window,
  which may go down as jobs leave it. ``histogram_quantile`` works on their buckets as usual; do not take
  ``rate()`` of them. Cached jobs are left out (they did not run).
* **From the broker, at scrape**: ``onnxforge_queue_depth{queue}``: messages waiting. Distributed: Redis
  ``LLEN`` of ``<broker.key_prefix><queue>`` (plus kombu's priority sub-lists); embedded: message files
  of that queue in ``<data_dir>/queue/messages``. Missing when the broker does not answer within 1 s.
* **Counters of this process** (classic Prometheus counters; a scraper sums them over replicas, and they
  restart from zero with the process): ``onnxforge_upload_bytes_total{field}`` (accepted uploads),
  ``onnxforge_cache_lookups_total{result}`` (hit or miss) and ``onnxforge_cache_hits_total``.

Each ``create_app`` has its own ``CollectorRegistry``, so apps in one process (tests) do not share counts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from core.errors import UnavailableError
from core.settings import Settings
from core.store import STATES, Job, JobStore

log = logging.getLogger("onnxforge.api")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JOB_BUCKETS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
PASS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_QUEUES = ("cpu", "gpu")
# kombu's Redis transport keeps priorities 1-9 (core/broker.py's priority_steps) in sub-lists
# "<queue>\x06\x16<priority>"; priority 0 is the queue's own list.
_PRIORITY_SUFFIXES = ("", *(f"\x06\x16{step}" for step in range(1, 10)))


def _buckets(values: Iterable[float], bounds: Sequence[float]) -> tuple[list[tuple[str, float]], float]:
    values = list(values)
    buckets = [(repr(float(b)), float(sum(1 for v in values if v <= b))) for b in bounds]
    buckets.append(("+Inf", float(len(values))))
    return buckets, float(sum(values))


class QueueDepth:
    """Messages waiting per queue; ``None`` when the broker cannot be read."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._redis: Any = None

    def read(self) -> dict[str, int] | None:
        try:
            return self._filesystem() if self.settings.embedded else self._redis_lengths()
        except Exception as exc:  # the broker being down must not fail the scrape
            log.warning("metrics: cannot read queue depth (%s)", type(exc).__name__)
            return None

    def _filesystem(self) -> dict[str, int]:
        from core.broker import queue_dirs  # deferred: pulls in Celery

        counts = dict.fromkeys(_QUEUES, 0)
        # kombu's filesystem transport names a message "<ms>_<uuid>.<queue>.msg".
        with os.scandir(queue_dirs(self.settings.storage.queue_dir)["messages"]) as entries:
            for entry in entries:
                queue, _, suffix = entry.name.partition(".")[2].rpartition(".")
                if suffix == "msg" and queue in counts:
                    counts[queue] += 1
        return counts

    def _redis_lengths(self) -> dict[str, int]:
        if self._redis is None:
            import redis

            assert self.settings.broker.url is not None
            self._redis = redis.Redis.from_url(self.settings.broker.url, socket_connect_timeout=1.0, socket_timeout=1.0)
        prefix = self.settings.broker.key_prefix
        pipe = self._redis.pipeline(transaction=False)
        for queue in _QUEUES:
            for suffix in _PRIORITY_SUFFIXES:
                pipe.llen(f"{prefix}{queue}{suffix}")
        lengths = pipe.execute()
        per = len(_PRIORITY_SUFFIXES)
        return {queue: int(sum(lengths[i * per : (i + 1) * per])) for i, queue in enumerate(_QUEUES)}

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()


class _JobTableCollector(Collector):
    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        store = self.metrics.store
        settings = self.metrics.settings
        if store is None:  # before the lifespan has built the store
            return
        try:
            counts: dict[tuple[str, str], int] | None = store.count_by_state()
            since = datetime.now(UTC) - timedelta(seconds=settings.metrics.window_seconds)
            recent = store.recently_finished(since, settings.metrics.window_max_jobs)
        except UnavailableError as exc:  # the database being down must not fail the whole scrape
            log.warning("metrics: the job table cannot be read (%s)", exc.message)
            counts, recent = None, []
        if counts is not None:
            jobs = GaugeMetricFamily(
                "onnxforge_jobs", "Jobs in the job table, by queue and state.", labels=["queue", "state"]
            )
            for queue in sorted({q for q, _ in counts} | set(_QUEUES)):
                for state in STATES:
                    jobs.add_metric([queue, state], counts.get((queue, state), 0))
            yield jobs

        depth = self.metrics.queue_depth.read()
        if depth is not None:
            gauge = GaugeMetricFamily(
                "onnxforge_queue_depth", "Messages waiting in the broker, by queue.", labels=["queue"]
            )
            for queue, n in depth.items():
                gauge.add_metric([queue], n)
            yield gauge

        finished = [j for j in recent if j.cached_from is None]
        yield self._job_durations(finished, settings.metrics.window_seconds)
        yield self._pass_durations(finished, settings.metrics.window_seconds)

    @staticmethod
    def _job_durations(finished: list[Job], seconds: int) -> Metric:
        family = GaugeHistogramMetricFamily(
            "onnxforge_job_duration_seconds",
            f"Run time of jobs finished in the last {seconds} s (start of the last attempt to the end), "
            "by queue and state; a window, not a cumulative histogram.",
            labels=["queue", "state"],
        )
        groups: dict[tuple[str, str], list[float]] = {}
        for job in finished:
            if job.started_at is not None and job.finished_at is not None:
                run = max((job.finished_at - job.started_at).total_seconds(), 0.0)
                groups.setdefault((job.queue, job.state), []).append(run)
        for (queue, state), values in sorted(groups.items()):
            buckets, total = _buckets(values, JOB_BUCKETS)
            family.add_metric([queue, state], buckets, total)
        return family

    @staticmethod
    def _pass_durations(finished: list[Job], seconds: int) -> Metric:
        family = GaugeHistogramMetricFamily(
            "onnxforge_pass_duration_seconds",
            f"Seconds per pass and job, over succeeded jobs finished in the last {seconds} s; a window, not a "
            "cumulative histogram.",
            labels=["pass"],
        )
        groups: dict[str, list[float]] = {}
        for job in finished:
            per_pass = (job.summary or {}).get("pass_seconds") if job.state == "succeeded" else None
            if isinstance(per_pass, dict):
                for name, value in per_pass.items():
                    if isinstance(value, int | float):
                        groups.setdefault(str(name), []).append(float(value))
        for name, values in sorted(groups.items()):
            buckets, total = _buckets(values, PASS_BUCKETS)
            family.add_metric([name], buckets, total)
        return family


class ServiceMetrics:
    """The API's registry: counters the services increment, and the collector reading the job table."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store: JobStore | None = None
        self.queue_depth = QueueDepth(settings)
        self.registry = CollectorRegistry(auto_describe=False)
        self.upload_bytes = Counter(
            "onnxforge_upload_bytes",
            "Bytes of accepted uploads received by this API process, by field (model, samples).",
            ["field"],
            registry=self.registry,
        )
        self.cache_lookups = Counter(
            "onnxforge_cache_lookups",
            "Result-cache lookups by this API process, by result (hit, miss).",
            ["result"],
            registry=self.registry,
        )
        self.cache_hits = Counter(
            "onnxforge_cache_hits",
            "Submissions answered from the result cache by this API process.",
            registry=self.registry,
        )
        for field in ("model", "samples"):
            self.upload_bytes.labels(field)
        for result in ("hit", "miss"):
            self.cache_lookups.labels(result)
        self.registry.register(_JobTableCollector(self))

    def bind(self, store: JobStore | None) -> None:
        self.store = store

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def close(self) -> None:
        self.queue_depth.close()
