"""Learning service entry point: an arq worker, the learning centre.

Consumes: ``Keys.trajectories`` (announcements of finished turns'
trajectories, ``consumer.py``) in batches, and its own cron schedule.

Produces: long-term memory. Each trajectory becomes an episode, facts, the
social graph's entities and relations and a revised soul (``learner.py``,
extraction by ``HOLDFAST_LEARNING_MODEL`` in ``extract.py``). Cron jobs:
the sweep (every 10 s: retries due and announcements lost, ``sweep.py``),
trajectory retention (hourly: archive then delete, ``archive.py``) and
snapshot retention (every minute: expired ``channel_state_snapshots``).

Guarantees: every trajectory is learned once — at least once through the
stream, the claim of a dead learner's entries and the sweep; at most once
through the row lock and status check in one transaction with the writes.
With several learning processes on one Redis each cron run happens once
(arq's unique cron job ids, named under our key prefix). On SIGTERM/SIGINT
arq cancels what runs (an unfinished trajectory's transaction rolls back; it
is learned again later), closes its connections, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from datetime import UTC, datetime
from typing import Any

from arq.connections import RedisSettings
from arq.cron import cron
from arq.worker import Worker
from holdfast_shared.background import cancel_and_wait
from holdfast_shared.db import create_engine, session_factory
from holdfast_shared.keys import Keys
from holdfast_shared.memory import embedders
from holdfast_shared.memory.index import open_index
from holdfast_shared.observability.process import setup_process
from holdfast_shared.providers import ProviderRegistry
from holdfast_shared.redisconn import connect
from holdfast_shared.settings import Settings, get_settings

from holdfast_learning.archive import archive_trajectories, delete_old_archives
from holdfast_learning.consumer import BatchSettings, TrajectoryConsumer
from holdfast_learning.extract import Extractor
from holdfast_learning.learner import Learner
from holdfast_learning.retention import delete_expired_snapshots
from holdfast_learning.sweep import sweep

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


async def learning_sweep(ctx: dict[str, Any]) -> int:
    result = await sweep(ctx["sessions"], ctx["learner"], datetime.now(UTC))
    if result.learned or result.failed or result.dead:
        log.info(
            "sweep: learned %d, failed %d, dead %d", result.learned, result.failed, result.dead
        )
    return result.learned


async def trajectory_retention(ctx: dict[str, Any]) -> int:
    settings: Settings = ctx["settings"]
    now = datetime.now(UTC)
    moved = await archive_trajectories(
        ctx["sessions"],
        settings.trajectory_archive,
        retention_days=settings.trajectory_retention_days,
        now=now,
    )
    removed = await delete_old_archives(
        settings.trajectory_archive, archive_days=settings.trajectory_archive_days, now=now
    )
    if moved or removed:
        log.info("retention: archived %d trajectories, deleted %d day files", moved, removed)
    return moved


def build_worker(settings: Settings) -> Worker:
    """The arq worker with our jobs; call it inside the running event loop (arq binds to it)."""
    redis_url, database_url = settings.require_urls()
    engine = create_engine(database_url, pool_size=4)
    keys = Keys(settings.redis_prefix)

    async def startup(ctx: dict[str, Any]) -> None:
        sessions = session_factory(engine)
        providers = ProviderRegistry.from_env(os.environ, settings.model)
        extractor = Extractor(providers, settings.learning_model)
        redis = connect(redis_url, max_connections=20)
        embedder = embedders.from_settings(settings)
        learner = Learner(
            sessions,
            redis,
            keys,
            extractor,
            max_attempts=settings.learning_max_attempts,
            index=await open_index(engine, embedder),
        )
        consumer = TrajectoryConsumer(
            redis,
            keys,
            learner,
            BatchSettings(
                size=settings.learning_batch_size,
                window_seconds=settings.learning_batch_window_seconds,
                claim_idle_seconds=settings.learning_claim_idle_seconds,
            ),
            name=f"{socket.gethostname()}-{os.getpid()}",
        )
        ctx.update(
            settings=settings,
            sessions=sessions,
            providers=providers,
            learner=learner,
            own_redis=redis,
            embedder=embedder,
            intake=asyncio.create_task(consumer.run(), name="trajectory-intake"),
        )
        log.info("learning centre started; extraction by %s", extractor.model)

    async def shutdown(ctx: dict[str, Any]) -> None:
        await cancel_and_wait(ctx.get("intake"))
        if "providers" in ctx:
            await ctx["providers"].aclose()
        if ctx.get("embedder") is not None:
            await ctx["embedder"].aclose()
        if "own_redis" in ctx:
            await ctx["own_redis"].aclose()
        await engine.dispose()

    prefix = settings.redis_prefix
    return Worker(
        # arq's cron job names become job ids, and job ids are global in Redis.
        cron_jobs=[
            cron(retention, name=f"{prefix}retention", run_at_startup=True),
            cron(
                learning_sweep,
                name=f"{prefix}learning-sweep",
                second={0, 10, 20, 30, 40, 50},
                run_at_startup=True,
            ),
            cron(
                trajectory_retention,
                name=f"{prefix}trajectory-retention",
                minute=7,
                run_at_startup=True,
            ),
        ],
        queue_name=f"{prefix}learning",
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
    setup_process(get_settings(), "learning")
    asyncio.run(serve())
