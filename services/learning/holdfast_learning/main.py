"""Learning service entry point: an arq worker.

Consumes: arq jobs on the queue ``<prefix>learning`` and its own cron schedule.
No job is enqueued by other services yet: turning trajectories into episodes,
knowledge and soul patterns arrives with the learning issue.

Produces: retention. Every minute (and once at start) it deletes the
``channel_state_snapshots`` rows whose ``expires_at`` has passed, and logs how
many.

Guarantees: with several learning processes on one Redis, each scheduled
retention run happens once (arq's unique cron job ids, named under our key
prefix so that engines sharing a Redis do not suppress each other's runs). A
failed run is logged and the next minute's run retries. On SIGTERM/SIGINT arq
cancels the job in flight (its current batch rolls back, earlier batches stay
committed), closes its connections, and the process exits with status 0.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from arq.connections import RedisSettings
from arq.cron import cron
from arq.worker import Worker
from holdfast_shared.db import create_engine, session_factory
from holdfast_shared.logs import configure_logging
from holdfast_shared.settings import Settings, get_settings

from holdfast_learning.retention import delete_expired_snapshots

log = logging.getLogger("holdfast.learning")


async def retention(ctx: dict[str, Any]) -> int:
    deleted = await delete_expired_snapshots(ctx["sessions"])
    # Logged at INFO only when there was something to delete: this runs every minute.
    log.log(
        logging.INFO if deleted else logging.DEBUG,
        "retention: deleted %d expired channel state snapshots",
        deleted,
    )
    return deleted


def build_worker(settings: Settings) -> Worker:
    """The arq worker with our jobs; call it inside the running event loop (arq binds to it)."""
    redis_url, database_url = settings.require_urls()
    engine = create_engine(database_url, pool_size=2)

    async def startup(ctx: dict[str, Any]) -> None:
        ctx["sessions"] = session_factory(engine)

    async def shutdown(ctx: dict[str, Any]) -> None:
        await engine.dispose()

    return Worker(
        # arq's cron job names become job ids, and job ids are global in Redis.
        cron_jobs=[cron(retention, name=f"{settings.redis_prefix}retention", run_at_startup=True)],
        queue_name=f"{settings.redis_prefix}learning",
        redis_settings=RedisSettings.from_dsn(redis_url),
        on_startup=startup,
        on_shutdown=shutdown,
        log_results=False,
    )


async def serve() -> None:
    worker = build_worker(get_settings())
    try:
        await worker.async_run()
    except asyncio.CancelledError:
        # arq's own SIGTERM/SIGINT handler stops the worker by cancelling its main task.
        pass
    finally:
        await worker.close()
    log.info("learning worker stopped")


def main() -> None:
    """Run the learning worker until SIGTERM/SIGINT."""
    configure_logging(get_settings().log_level, "learning")
    asyncio.run(serve())
