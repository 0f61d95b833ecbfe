"""Metrics, traces and log context: what an operator sees of the engine.

``metrics`` (every Prometheus series, defined once), ``tracing``
(OpenTelemetry, on only with an OTLP endpoint), ``scopes`` (the one-line
hooks where requests, turns and tool calls start), ``process`` (a service's
start-up). The GenAI spans and model metrics of a turn's model calls are
made where the call is (``holdfast_shared.providers.calls``). The stream and
HITL gauges the gateway reads on scrape are the gateway's own
(``holdfast_gateway.queuegauges``). See docs/operations.md.

Nothing is imported here: the event log imports ``metrics`` and must not
pull in the rest.
"""
