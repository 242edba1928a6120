"""Optional OpenTelemetry traces across API -> queue -> worker (``tracing.enabled``; the ``otel`` extra).

One trace per submission: the API's request span (FastAPI instrumentation, app/main.py), the publish span
of the job's Celery message, and in the worker the task's run span, a child of the publish span because
the Celery instrumentation carries the trace context in the message's headers. Each process calls
``configure_tracing`` once with its kind (``api``, ``worker``), which also instruments Celery there: the
API side injects the context when it enqueues, the worker side extracts it when the task starts.

Off (the default), nothing of OpenTelemetry is imported: ``configure_tracing`` returns at once and
``set_attributes`` is a dict lookup. The SDK keeps one provider per process; a prefork worker configures
tracing in each pool child (workers/celery_app.py), since the exporter's thread does not survive a fork.

Exporters: ``otlp`` (OTLP over HTTP, batched) for a collector; ``file`` appends one JSON object per span to
``tracing.file``, each with a single ``O_APPEND`` write, so every process of a host can share one file
(debugging, and the test that follows a job across a real worker process).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.settings import Settings

_configured: dict[str, Any] = {}


def configure_tracing(settings: Settings, *, process: str) -> bool:
    """Install the tracer provider and the Celery instrumentation in this process; False when disabled.

    Idempotent per process (a forked child configures its own)."""
    tracing = settings.tracing
    if not tracing.enabled:
        return False
    if _configured.get("pid") == os.getpid():
        return True
    # Deferred: OpenTelemetry is an optional extra and costs nothing unless tracing is on.
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"{tracing.service_name}-{process}"}))
    if tracing.exporter == "file":
        assert tracing.file is not None
        # Synchronous: a span is on disk when it ends, even if the process is killed right after.
        provider.add_span_processor(SimpleSpanProcessor(_json_lines_exporter(tracing.file)))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=tracing.otlp_endpoint)))
    trace.set_tracer_provider(provider)
    instrumentor = CeleryInstrumentor()
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    instrumentor.instrument(tracer_provider=provider)
    _configured.update(pid=os.getpid(), provider=provider)
    return True


def shutdown_tracing() -> None:
    """Flush and stop this process's exporter (a worker child exiting, the API stopping)."""
    provider = _configured.pop("provider", None)
    _configured.pop("pid", None)
    if provider is not None:
        provider.shutdown()


def tracer_provider() -> Any:
    """This process's provider (for instrumenting the FastAPI app); None when tracing is off."""
    return _configured.get("provider") if enabled() else None


def enabled() -> bool:
    return _configured.get("pid") == os.getpid()


def set_attributes(**attributes: str) -> None:
    """Name things on the current span (the job id on the request's and the task's), when tracing is on."""
    if not enabled():
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    for name, value in attributes.items():
        span.set_attribute(f"onnxforge.{name}", value)


def _json_lines_exporter(path: os.PathLike[str]) -> Any:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class JsonLinesExporter(SpanExporter):
        def __init__(self) -> None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
            self._fd: int | None = os.open(path, flags, 0o600)

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            if self._fd is None:
                return SpanExportResult.FAILURE
            for span in spans:
                os.write(self._fd, (span.to_json(indent=None) + "\n").encode())
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    return JsonLinesExporter()
