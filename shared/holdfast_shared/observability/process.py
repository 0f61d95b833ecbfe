"""What every service does first: its log format, tracing, and its metrics endpoint."""

from __future__ import annotations

import os
from collections.abc import Mapping

from holdfast_shared.logs import configure_logging
from holdfast_shared.observability.metrics import serve_metrics
from holdfast_shared.observability.tracing import configure_tracing
from holdfast_shared.settings import Settings


def setup_process(
    settings: Settings,
    service: str,
    *,
    serve: bool = True,
    environ: Mapping[str, str] = os.environ,
) -> int | None:
    """Logging (``HOLDFAST_LOG_FORMAT``), tracing (``OTEL_EXPORTER_OTLP_ENDPOINT``) and,
    with ``serve``, ``/metrics`` on ``HOLDFAST_METRICS_PORT``; that port if served.
    The gateway passes ``serve=False``: it has its own ``/metrics`` route."""
    configure_logging(settings.log_level, service, settings.log_format)
    configure_tracing(service, environ)
    return serve_metrics(settings.host, settings.metrics_port) if serve else None


def metrics_ports(settings: Settings, children: list[str]) -> dict[str, int]:
    """The ``/metrics`` port of each of ``holdfast up``'s non-gateway children, so that
    processes on one host never collide: ``HOLDFAST_METRICS_PORT`` + n (unset:
    ``HOLDFAST_PORT`` + 1 + n); none at all when it is 0."""
    if settings.metrics_port == 0:
        return {}
    base = settings.metrics_port if settings.metrics_port is not None else settings.port + 1
    return {name: base + n for n, name in enumerate(children)}
