"""gateway entry point.

Consumes: HTTP requests (``/execute``, ``/execute/replay``, ``/health``).
Produces: tasks, turns and user messages in PostgreSQL; each turn's
``started`` event; turn jobs on ``Keys.turns``; SSE streams tailed from the
task event logs.
Guarantees: a refused request writes nothing; an accepted message is stored
before the turn is queued; a stream delivers every seq after its cursor once,
in order.
"""

from __future__ import annotations

import uvicorn
from holdfast_shared.logs import configure_logging
from holdfast_shared.settings import get_settings

from holdfast_gateway.app import create_app


def main() -> None:
    settings = get_settings()
    configure_logging(settings.log_level, "gateway")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
    )
