"""OpenTelemetry tracing: one trace per turn, gateway → loop-worker → tool-runner.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``…_TRACES_ENDPOINT``) is set:
then :func:`configure_tracing` installs the SDK with a batching OTLP/HTTP
exporter (the standard ``OTEL_*`` variables apply: headers, sampler,
``OTEL_SERVICE_NAME``, ``OTEL_BSP_SCHEDULE_DELAY``…). When off, every helper
here returns before touching OpenTelemetry: no spans, no context, and jobs
carry no trace context.

The trace context crosses processes in the job payloads (``traceparent``,
W3C format, on :class:`~holdfast_shared.jobs.TurnJob` and
:class:`~holdfast_shared.jobs.ToolCallJob`), not in Redis stream metadata:
a job taken over by another worker still continues its trace.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
INSTRUMENTATION = "holdfast"

_propagator = TraceContextTextMapPropagator()
_tracer: Tracer | None = None
_provider: TracerProvider | None = None


def configure_tracing(service: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Install the SDK with the OTLP/HTTP exporter if an endpoint is configured;
    whether tracing is now on. ``service`` names the process (``holdfast-<service>``)
    unless ``OTEL_SERVICE_NAME`` does."""
    if not any(environ.get(name) for name in ENDPOINT_VARIABLES):
        return False
    # Imported only when used: a process without tracing never loads the SDK,
    # and the exporter pulls in protobuf and requests.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {"service.name": f"holdfast-{service}"}
    # shutdown_on_exit (the default): the batch is flushed when the process exits.
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    install(provider)
    return True


def install(provider: TracerProvider) -> None:
    """Trace through ``provider`` (tests hand in one with an in-memory exporter)."""
    global _tracer, _provider
    _provider = provider
    _tracer = provider.get_tracer(INSTRUMENTATION)


def uninstall() -> None:
    """Back to no tracing (what a process without an endpoint has)."""
    global _tracer, _provider
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def tracer() -> Tracer | None:
    return _tracer


def _parent(traceparent: str | None) -> Context | None:
    """The context a ``traceparent`` carries; None (the current one) without it."""
    if not traceparent:
        return None
    return _propagator.extract({"traceparent": traceparent})


@contextlib.contextmanager
def span(
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    traceparent: str | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Span | None]:
    """A span, current inside the block (None when tracing is off). ``traceparent``
    makes it the child of a span in another process. An exception escaping the
    block marks it as an error."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(
        name, context=_parent(traceparent), kind=kind, attributes=dict(attributes or {})
    ) as current:
        yield current


def start_span(
    name: str, *, kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping[str, Any] | None = None
) -> Span | None:
    """A span that is not made current (for async generators, whose code runs in
    the consumer's context piece by piece); the caller ends it."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, kind=kind, attributes=dict(attributes or {}))


def end_span(current: Span | None, *, error: BaseException | str | None = None) -> None:
    if current is None:
        return
    if isinstance(error, BaseException):
        current.record_exception(error)
        current.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    elif error is not None:
        current.set_status(Status(StatusCode.ERROR, error))
    current.end()


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span, for a job payload; None when
    tracing is off or no span is current."""
    if _tracer is None:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent")


def annotate(**attributes: Any) -> None:
    """Set attributes on the current span (nothing when tracing is off)."""
    if _tracer is None:
        return
    current = trace.get_current_span()
    for key, value in attributes.items():
        if value is not None:
            current.set_attribute(key, value)


def turn_traceparent(task_id: str, turn_id: str) -> str | None:
    """Name the turn on the current (the request's) span; its ``traceparent`` for the job."""
    annotate(**{"holdfast.task_id": task_id, "holdfast.turn_id": turn_id})
    return current_traceparent()


def force_flush(timeout_millis: int = 5000) -> None:
    """Export what is batched now (tests; a process exiting does it by itself)."""
    if _provider is not None:
        _provider.force_flush(timeout_millis)
