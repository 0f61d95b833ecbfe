"""tool-runner entry point.

Consumes: tool calls (``Keys.tools``, group ``tool-runners``); turn-end reap
requests (``Keys.tools_reap``).
Produces: each call's outcome in ``tool_results`` (PostgreSQL) and on the
waiting loop-worker's inbox; files in the task's workspace.
Guarantees: every process a tool starts runs in the sandbox (bubblewrap +
seccomp + landlock + limits) or not at all; a call runs at most once, and a
redelivered call gets the stored outcome; SIGTERM stops taking calls and
lets running ones finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket

from holdfast_shared import runners
from holdfast_shared.db import create_engine, session_factory
from holdfast_shared.keys import Keys
from holdfast_shared.logs import configure_logging
from holdfast_shared.redisconn import connect
from holdfast_shared.settings import Settings, get_settings
from redis.asyncio import Redis

from holdfast_tool_runner.consumer import ToolConsumer
from holdfast_tool_runner.executor import ToolExecutor
from holdfast_tool_runner.sandbox import SandboxProbe, launcher_pool, probe
from holdfast_tool_runner.workspaces import Workspaces

log = logging.getLogger(__name__)


async def _stay_alive(redis: Redis, keys: Keys, runner_id: str, sandbox: SandboxProbe) -> None:
    """Keep this runner's liveness key, so others can tell a dead runner's calls."""
    while True:
        try:
            await runners.announce(redis, keys, runner_id, sandbox.as_dict())
        except Exception:
            log.warning("could not refresh the liveness key; retrying", exc_info=True)
        await asyncio.sleep(runners.ALIVE_TTL_SECONDS / 3)


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
    workspaces = Workspaces(settings.workspaces)
    found = await probe()
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
    alive = asyncio.create_task(_stay_alive(redis, keys, runner_id, found))
    try:
        await consumer.run(stop)
    finally:
        if launchers is not None:
            await launchers.aclose()
        alive.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await alive
        await runners.withdraw(redis, keys, runner_id)
        await redis.aclose()
        await engine.dispose()
    log.info("tool-runner stopped")


def main() -> None:
    """Run the tool-runner until SIGTERM/SIGINT."""
    settings = get_settings()
    configure_logging(settings.log_level, "tool-runner")
    asyncio.run(serve(settings))
