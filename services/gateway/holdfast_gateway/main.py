"""gateway entry point.

Serves: ``POST /execute`` (a turn, streamed), ``GET /execute/replay``,
``POST /execute/cancel``, ``GET /hitl/pending``, ``POST /hitl/respond``,
``DELETE /tasks/{task_id}``, ``/agents``, ``/skills``, ``/assets`` (the Asset
Directory's MCP servers, their OAuth connect and callback), ``/schedules``,
``GET /health``,
``/openapi.json`` and (unless ``HOLDFAST_DOCS_ENABLED=false``) ``/docs`` with
its assets from the package.
Produces: tasks, turns and user messages in PostgreSQL; each turn's
``started`` event; turn jobs and resume jobs on ``Keys.turns``; cancel
nudges on ``Keys.cancels``; workspace removals and MCP server probes on
``Keys.tools``; Asset Directory servers with their credentials sealed; SSE streams
tailed from the task event logs (one tailer per process, ``fanout.py``);
schedules' turns at their due times (one scheduler per process, ``schedules/``).
Guarantees: a refused request writes nothing and gets a JSON error (4xx, or
503 while a store is down; never a plain-text 500); bodies are capped before
they are read whole; an accepted message is stored before the turn is
queued; a stream delivers every seq after its cursor once, in order; task
names are per tenant; each due time of a schedule fires once across gateways.
"""

from __future__ import annotations

import sys

import uvicorn
from holdfast_shared import runtime
from holdfast_shared.assets import VaultError, vault_from_settings
from holdfast_shared.observability.process import setup_process
from holdfast_shared.settings import get_settings

from holdfast_gateway.app import create_app


def main() -> None:
    settings = get_settings()
    setup_process(settings, "gateway", serve=False)  # /metrics is a route of the app
    try:
        vault_from_settings(settings)
    except VaultError as exc:
        # Refused before serving anything: credentials could not be kept encrypted.
        sys.exit(f"gateway: not starting: {exc}")
    app = create_app(settings)
    runtime.settle_heap()  # see there: no full-collection pauses over start-up objects
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        # None: uvicorn's records go through ours (HOLDFAST_LOG_FORMAT) like the rest.
        log_config=None,
        timeout_graceful_shutdown=5,
        # uvicorn believes X-Forwarded-For from 127.0.0.1 unless told otherwise: any
        # local client could then be whoever it liked to the key-failure limit.
        proxy_headers=bool(settings.trusted_proxy_list),
        forwarded_allow_ips=settings.trusted_proxy_list or None,
    )
