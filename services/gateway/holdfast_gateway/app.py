"""The gateway ASGI app: routes, error handlers, the body limit and the resource lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from holdfast_shared.assets import vault_from_settings
from holdfast_shared.background import Background
from holdfast_shared.db import create_engine, session_factory
from holdfast_shared.eventlog import EventLog
from holdfast_shared.keys import Keys
from holdfast_shared.memory import embedders
from holdfast_shared.memory.index import open_index
from holdfast_shared.redisconn import connect, is_cluster
from holdfast_shared.settings import Settings
from holdfast_shared.turnlock import TurnLock

from holdfast_gateway import errors, openapi
from holdfast_gateway.auth import KeyAuthenticator
from holdfast_gateway.bodylimit import BodyLimit
from holdfast_gateway.clock import SystemClock
from holdfast_gateway.deadline import ResponseDeadline
from holdfast_gateway.deps import JsonBody
from holdfast_gateway.fanout import Hub
from holdfast_gateway.fanout_cluster import ClusterHub
from holdfast_gateway.fastlane import ReplayFastLane
from holdfast_gateway.routes import (
    agents,
    assets,
    auth,
    cancel,
    console,
    execute,
    executions,
    files,
    health,
    hitl,
    learning,
    memory,
    metrics,
    replay,
    schedules,
    skills,
    tasks,
    webhooks,
)
from holdfast_gateway.schedules.scheduler import Scheduler
from holdfast_gateway.state import GatewayState
from holdfast_gateway.streamtokens import StreamTokens, secret_from_settings
from holdfast_gateway.webhooks import Deliverer


def create_app(settings: Settings) -> FastAPI:
    redis_url, database_url = settings.require_urls()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # First: a gateway that could not keep credentials encrypted does not start.
        vault = vault_from_settings(settings)
        redis = connect(redis_url, max_connections=1000)
        engine = create_engine(database_url, pool_size=8, keep=settings.database_pool_size)
        sessions = session_factory(engine)
        keys = Keys(settings.redis_prefix)
        hot_ttl = settings.channel_state_ttl_active
        eventlog = EventLog(redis, sessions, keys, hot_ttl_seconds=hot_ttl)
        reads, tail = eventlog, redis
        if is_cluster(redis) and settings.redis_wait_replicas > 0:
            # Appends wait for a replica: the streams read from the replicas, so no
            # client sees an event its master had not passed on before dying.
            tail = connect(redis_url, max_connections=1000, replica_reads=True)
            reads = EventLog(tail, sessions, keys, hot_ttl_seconds=hot_ttl)
        # A Redis Cluster cannot XREAD streams of several slots at once (fanout_cluster).
        hub = (ClusterHub if is_cluster(redis) else Hub)(
            tail,
            keys,
            reads,
            max_buffered_events=settings.sse_max_buffered_events,
            max_buffered_bytes=settings.sse_max_buffered_bytes,
        )
        embedder = embedders.from_settings(settings)
        app.state.gateway = GatewayState(
            settings=settings,
            redis=redis,
            engine=engine,
            sessions=sessions,
            keys=keys,
            eventlog=eventlog,
            reads=reads,
            hub=hub,
            lock=TurnLock(redis, keys, ttl_seconds=settings.turn_deadline_seconds),
            auth=KeyAuthenticator(
                sessions,
                failures_allowed=settings.auth_failures_allowed,
                failure_window_seconds=settings.auth_failure_window_seconds,
                ttl_seconds=settings.auth_cache_ttl_seconds,
            ),
            memory_index=await open_index(engine, embedder),
            vault=vault,
            stream_tokens=StreamTokens(
                secret_from_settings(settings), settings.stream_token_ttl_seconds
            ),
            clock=SystemClock(settings.schedule_clock_offset_seconds),
        )
        # Completion webhooks: this gateway's share of the outbox (webhooks/delivery.py).
        deliverer = Deliverer(sessions, vault, settings, listen_url=database_url)
        try:
            async with Background() as background:
                background.start(hub.run(), name="event-tailer")
                background.start(Scheduler(app.state.gateway).run(), name="scheduler")
                background.start(deliverer.run(), name="webhook-deliveries")
                yield
        finally:
            await deliverer.aclose()
            await hub.close()
            if embedder is not None:
                await embedder.aclose()
            if tail is not redis:
                await tail.aclose()
            await redis.aclose()
            await engine.dispose()

    app = FastAPI(
        title="Holdfast",
        summary="Durable agent execution engine",
        version="0.1.0",
        lifespan=lifespan,
        generate_unique_id_function=openapi.operation_id,
        docs_url=None,
        redoc_url=None,
    )
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(ResponseDeadline, seconds=settings.request_timeout_seconds)
    # Outside the body limit: it takes only requests without a body (fastlane.py).
    app.add_middleware(ReplayFastLane)
    openapi.install(app, docs=settings.docs_enabled)
    # Each route documents the errors it can answer (errors.responses); these
    # two routers are included with theirs.
    app.include_router(execute.router)
    app.include_router(replay.router)
    app.include_router(
        cancel.router,
        dependencies=[JsonBody],
        responses=errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY, 404, 409),
    )
    app.include_router(hitl.router)
    app.include_router(tasks.router, responses=errors.responses(*errors.AUTHENTICATED, 404))
    app.include_router(executions.router)
    app.include_router(schedules.router)
    app.include_router(files.router)
    app.include_router(agents.router)
    app.include_router(assets.router)
    app.include_router(skills.router)
    app.include_router(memory.router)
    app.include_router(learning.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(auth.router)
    app.include_router(console.router)
    app.include_router(webhooks.router)
    return app
