"""tool-runner entry point.

Consumes: tool calls (``Keys.tools``, group ``tool-runners``); turn-end reap
requests (``Keys.tools_reap``).
Produces: each call's outcome in ``tool_results`` (PostgreSQL) and on the
waiting loop-worker's inbox; files in the task's workspace (one size-capped
filesystem per tenant and task, removed with the task).
Guarantees: every process a tool starts runs in the sandbox (bubblewrap +
seccomp + landlock + limits) or not at all; a call runs at most once, and a
redelivered call gets the stored outcome; SIGTERM stops taking calls and
lets running ones finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket

from holdfast_shared import runners
from holdfast_shared.background import Background, every
from holdfast_shared.db import create_engine, session_factory
from holdfast_shared.keys import Keys
from holdfast_shared.logs import configure_logging
from holdfast_shared.redisconn import connect
from holdfast_shared.settings import Settings, get_settings

from holdfast_tool_runner.consumer import ToolConsumer
from holdfast_tool_runner.executor import ToolExecutor
from holdfast_tool_runner.sandbox import launcher_pool, probe
from holdfast_tool_runner.sweeper import sweep_once
from holdfast_tool_runner.workspaces import Workspaces

log = logging.getLogger(__name__)

# How often workspaces of deleted tasks whose removal job was lost are looked for.
_SWEEP_SECONDS = 600.0


async def serve(settings: Settings, stop: asyncio.Event | None = None) -> None:
    redis_url, database_url = settings.require_urls()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    runner_id = f"{socket.gethostname()}-{os.getpid()}"
    redis = connect(redis_url, max_connections=50)
    engine = create_engine(database_url, pool_size=4)
    sessions = session_factory(engine)
    keys = Keys(settings.redis_prefix)
    workspaces = await asyncio.to_thread(Workspaces.from_settings, settings)
    found = await probe(workspaces=workspaces.describe())
    # None when the host cannot sandbox: every call then fails closed with the reason.
    launchers = launcher_pool(spares=settings.sandbox_spares) if found.available else None
    consumer = ToolConsumer(
        redis,
        keys,
        ToolExecutor(redis, keys, sessions, workspaces, runner_id, launchers),
        workspaces,
        consumer_name=runner_id,
        concurrency=settings.tool_concurrency,
        claim_idle_ms=int(settings.tool_claim_idle_seconds * 1000),
    )
    log.info(
        "tool-runner %s ready; workspaces in %s; sandbox: %s", runner_id, workspaces.root, found
    )
    if launchers is not None:
        launchers.start()
    try:
        async with Background() as background:
            background.start(
                every(
                    runners.ALIVE_TTL_SECONDS / 3,
                    lambda: runners.announce(redis, keys, runner_id, found.as_dict()),
                    what="refreshing the liveness key",
                ),
                name="liveness",
            )
            background.start(
                every(
                    _SWEEP_SECONDS,
                    lambda: sweep_once(workspaces, sessions),
                    what="the sweep of deleted tasks' workspaces",
                ),
                name="workspace-sweep",
            )
            await consumer.run(stop)
    finally:
        if launchers is not None:
            await launchers.aclose()
        await runners.withdraw(redis, keys, runner_id)
        await redis.aclose()
        await engine.dispose()
    log.info("tool-runner stopped")


def main() -> None:
    """Run the tool-runner until SIGTERM/SIGINT."""
    settings = get_settings()
    configure_logging(settings.log_level, "tool-runner")
    asyncio.run(serve(settings))
