"""Learning service entry point: an arq worker, the learning centre.

Consumes: ``Keys.trajectories`` (announcements of finished turns'
trajectories, ``consumer.py``) in batches, and its own cron schedule.

Produces: long-term memory. Each trajectory becomes an episode, facts, the
social graph's entities and relations and a revised soul (``learner.py``,
extraction by ``HOLDFAST_LEARNING_MODEL`` in ``extract.py``). Cron jobs:
the sweep (every 10 s: retries due and announcements lost, ``missed_sweep.py``),
trajectory retention (hourly: archive then delete, ``trajectory_retention.py``) and
snapshot retention (every minute: expired ``channel_state_snapshots``).

Guarantees: every trajectory is learned once — at least once through the
stream, the claim of a dead learner's entries and the sweep; at most once
through the row lock and status check in one transaction with the writes.
With several learning processes on one Redis each cron run happens once
(arq's unique cron job ids, named under our key prefix). On a Redis Cluster
arq's keys share one slot and arq runs on that slot's master (``arqredis.py``);
when that master dies, arq's worker is built again on the new one while the
trajectory intake (on the cluster client) goes on. On SIGTERM/SIGINT arq
cancels what runs (an unfinished trajectory's transaction rolls back; it is
learned again later), closes its connections, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from arq.connections import ArqRedis, RedisSettings
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
from redis.exceptions import RedisError

from holdfast_learning.arqredis import arq_pool
from holdfast_learning.consumer import BatchSettings, TrajectoryConsumer
from holdfast_learning.extract import Extractor, Yielding
from holdfast_learning.learner import Learner
from holdfast_learning.missed_sweep import sweep
from holdfast_learning.retention import delete_expired_snapshots
from holdfast_learning.trajectory_retention import archive_trajectories, delete_old_archives

log = logging.getLogger("holdfast.learning")

# After a failover, before arq's worker starts again on the slot's new master.
_ARQ_RESTART_SECONDS = 1.0


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


@contextlib.asynccontextmanager
async def learning_centre(settings: Settings) -> AsyncIterator[dict[str, Any]]:
    """What the cron jobs and the trajectory intake share, for the process's life:
    an arq worker rebuilt after a failover (``serve``) finds it unchanged."""
    redis_url, database_url = settings.require_urls()
    engine = create_engine(database_url, pool_size=4, keep=settings.database_pool_size)
    keys = Keys(settings.redis_prefix)
    sessions = session_factory(engine)
    providers = ProviderRegistry.from_env(os.environ, settings.model)
    redis = connect(redis_url, max_connections=20)
    extractor = Extractor(
        providers,
        settings.learning_model,
        yielding=Yielding(
            redis,
            keys,
            concurrency=settings.learning_concurrency,
            at_most_seconds=settings.learning_yield_seconds,
        ),
    )
    embedder = embedders.from_settings(settings)
    intake: asyncio.Task[None] | None = None
    try:
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
        intake = asyncio.create_task(consumer.run(), name="trajectory-intake")
        log.info("learning centre started; extraction by %s", extractor.model)
        yield {"settings": settings, "sessions": sessions, "learner": learner}
    finally:
        await cancel_and_wait(intake)
        await providers.aclose()
        if embedder is not None:
            await embedder.aclose()
        await redis.aclose()
        await engine.dispose()


def build_worker(
    settings: Settings, ctx: dict[str, Any], redis_pool: ArqRedis | None = None
) -> Worker:
    """The arq worker with our cron jobs; call it inside the running event loop (arq
    binds to it). ``redis_pool``: arq's client on a cluster (``arqredis.py``)."""
    redis_url, _ = settings.require_urls()
    keys = Keys(settings.redis_prefix)
    cluster = settings.redis_cluster

    def job(name: str) -> str:
        return keys.learning_job(name, cluster=cluster)

    return Worker(
        cron_jobs=[
            cron(retention, name=job("retention"), run_at_startup=True),
            cron(
                learning_sweep,
                name=job("learning-sweep"),
                second={0, 10, 20, 30, 40, 50},
                run_at_startup=True,
            ),
            cron(
                trajectory_retention,
                name=job("trajectory-retention"),
                minute=7,
                run_at_startup=True,
            ),
        ],
        queue_name=keys.learning_queue(cluster=cluster),
        redis_settings=RedisSettings.from_dsn(redis_url),
        redis_pool=redis_pool,
        ctx=ctx,
        log_results=False,
        # serve() owns SIGTERM/SIGINT across workers (a cluster may need several).
        handle_signals=False,
    )


async def serve() -> None:
    settings = get_settings()
    stop = asyncio.Event()
    # Our handlers, for the whole run: arq's own (``handle_signals``) go with
    # each worker, and a signal that came between two workers (a cluster's
    # master lost, the next one still being looked for) was swallowed by a
    # worker already done, so the process ran on until SIGKILL.
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with learning_centre(settings) as ctx:
        while not stop.is_set():
            try:
                await _run_arq(settings, ctx, stop)
                break
            except RedisError as exc:
                if not settings.redis_cluster:
                    raise
                # The master of arq's slot died (or gave the slot up): arq's client
                # is bound to it, so a new worker goes to the slot's new master.
                log.warning("arq lost its Redis master (%s); restarting it on the new one", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _ARQ_RESTART_SECONDS)
    log.info("learning worker stopped")


async def _run_arq(settings: Settings, ctx: dict[str, Any], stop: asyncio.Event) -> None:
    """One arq worker until ``stop`` (it returns) or its Redis fails (RedisError)."""
    # Finding the slot's master can take a while (its old master dead, the cluster
    # not failed over yet): a SIGTERM meanwhile stops the search, not only the next step.
    finding = asyncio.create_task(arq_pool(settings))
    if not await _until_stopped(finding, stop):
        ended = finding.done() and not finding.cancelled() and finding.exception() is None
        if ended and (found := finding.result()) is not None:
            await found.aclose()  # found just as the stop came
        return
    pool = finding.result()
    try:
        worker = build_worker(settings, ctx, pool)
        running = asyncio.create_task(worker.async_run())
        try:
            if not await _until_stopped(running, stop, on_stop=worker.handle_sig):
                return
            running.result()  # arq returns only on failure (a RedisError is retried)
        finally:
            with contextlib.suppress(RedisError):
                await worker.close()
    finally:
        if pool is not None:
            await pool.aclose()


async def _until_stopped(
    work: asyncio.Task[Any],
    stop: asyncio.Event,
    *,
    on_stop: Callable[[signal.Signals], None] | None = None,
) -> bool:
    """Wait for ``work``; on ``stop`` first, end it (``on_stop``, arq's own way of
    stopping: its jobs and main task cancelled; then a cancel, again if one is
    lost) and return False once it has ended."""
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(stopped)
    if work.done() and not stop.is_set():
        return True
    if not work.done() and on_stop is not None:
        on_stop(signal.SIGTERM)
    with contextlib.suppress(RedisError):
        await cancel_and_wait(work)
    return False


def main() -> None:
    """Run the learning worker until SIGTERM/SIGINT."""
    settings = get_settings()
    setup_process(settings, "learning")
    quiet_arq(settings.log_level)
    asyncio.run(serve())


def quiet_arq(level: str) -> None:
    """arq logs two lines at INFO for every job it runs: with the sweep every 10 s,
    a dozen lines a minute on `holdfast up`'s terminal while nothing happens. Our
    jobs log at INFO what they did; arq keeps its warnings and job failures
    (logged at ERROR), and everything at DEBUG."""
    if logging.getLevelName(level.upper()) != logging.DEBUG:
        logging.getLogger("arq").setLevel(logging.WARNING)
