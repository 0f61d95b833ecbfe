"""loop-worker entry point.

Consumes: turn jobs (``Keys.turns``, group ``loop-workers``).
Produces: the turn's events in the task's event log; assistant messages and
turn status in PostgreSQL; the archived copy of every event log (each worker
also runs an :class:`~holdfast_shared.eventlog.Archiver`).
Guarantees: a job is acknowledged only after its turn ended with a terminal
lifecycle event; SIGTERM stops taking jobs and lets running turns finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket

from holdfast_shared.db import create_engine, session_factory
from holdfast_shared.eventlog import Archiver, EventLog
from holdfast_shared.keys import Keys
from holdfast_shared.logs import configure_logging
from holdfast_shared.redisconn import connect
from holdfast_shared.settings import Settings, get_settings
from holdfast_shared.turnlock import TurnLock

from holdfast_loop_worker.consumer import TurnConsumer
from holdfast_loop_worker.providers import ProviderRegistry
from holdfast_loop_worker.turn import TurnContext

log = logging.getLogger(__name__)


async def serve(settings: Settings, stop: asyncio.Event | None = None) -> None:
    redis_url, database_url = settings.require_urls()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    redis = connect(redis_url)
    engine = create_engine(database_url, pool_size=settings.worker_concurrency // 4 + 2)
    sessions = session_factory(engine)
    keys = Keys(settings.redis_prefix)
    eventlog = EventLog(redis, sessions, keys, hot_ttl_seconds=settings.channel_state_ttl_active)
    providers = ProviderRegistry.default()
    ctx = TurnContext(
        sessions=sessions,
        eventlog=eventlog,
        providers=providers,
        default_model=settings.model,
        max_iterations=settings.max_iterations,
    )
    lock = TurnLock(redis, keys, ttl_seconds=settings.turn_deadline_seconds)
    consumer = TurnConsumer(
        redis,
        keys,
        ctx,
        lock,
        consumer_name=f"{socket.gethostname()}-{os.getpid()}",
        concurrency=settings.worker_concurrency,
    )
    archiver = Archiver(eventlog, settings.archive_interval_seconds)
    archiver.start()
    log.info(
        "loop-worker %s ready (default model: %s)",
        consumer.consumer_name,
        settings.model or "scripted",
    )
    try:
        await consumer.run(stop)
    finally:
        await archiver.stop()
        await redis.aclose()
        await engine.dispose()
    log.info("loop-worker stopped")


def main() -> None:
    settings = get_settings()
    configure_logging(settings.log_level, "loop-worker")
    asyncio.run(serve(settings))
