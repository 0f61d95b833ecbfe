"""``GET /metrics``: the gateway's Prometheus series, and the engine's queues.

Unauthenticated, like ``/health``: scrapers do not hold API keys. It shows
counts by agent and model names, never a task, tenant or message; keep it
off the public side of a proxy if those names are private.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from holdfast_shared.observability import metrics
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from holdfast_gateway.deps import StateDep
from holdfast_gateway.queuegauges import QueueGauges

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(request: Request, state: StateDep) -> Response:
    stats = state.hub.stats
    metrics.SSE_CONNECTIONS.set(stats["subscribers"])
    metrics.SSE_TASKS.set(stats["tasks"])
    gauges: QueueGauges | None = getattr(request.app.state, "queue_gauges", None)
    if gauges is None:
        gauges = request.app.state.queue_gauges = QueueGauges(
            state.redis, state.keys, state.sessions
        )
    await gauges.refresh()
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
