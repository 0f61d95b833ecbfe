"""loop-worker entry point.

Consumes: turn jobs (``Keys.turns``, group ``loop-workers``); replies to its
turns on its inbox (tool results); resume jobs for answered questions.
Produces: the turn's events in the task's event log; tool calls on
``Keys.tools``; assistant messages, tool results and turn status in
PostgreSQL; the archived copy of every event log (each worker also runs an
:class:`~holdfast_shared.eventlog.Archiver`); its providers in
``Keys.providers``, and its own registration in ``Keys.worker_alive`` (refreshed
while it lives, deleted when it stops cleanly).
Guarantees: a job is acknowledged once its turn ended (its terminal
lifecycle event is logged), parked on a question (snapshotted; no worker
holds it) or was handed back (snapshotted and queued again); a job left
unacknowledged by a dead worker is taken over once its liveness key lapses
(``HOLDFAST_LIVENESS_SECONDS``), or at the latest when its lease does. SIGTERM
stops taking jobs, lets running turns finish for ``HOLDFAST_DRAIN_SECONDS``
and hands the rest back. Its background loops (archiver, inbox, announcing
itself and its providers, question expiry, stale-turn sweep, the sweep that
starts messages a dead worker left waiting) run in one
``Background`` and stop with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

from holdfast_shared import liveness, runtime
from holdfast_shared.agents import builtin_agents
from holdfast_shared.background import Background, every
from holdfast_shared.db import autocommit_session_factory, create_engine, session_factory
from holdfast_shared.eventlog import Archiver, EventLog
from holdfast_shared.keys import Keys
from holdfast_shared.liveness import Heartbeat
from holdfast_shared.memory import embedders
from holdfast_shared.memory.index import open_index
from holdfast_shared.memory.search import Searcher
from holdfast_shared.observability.process import setup_process
from holdfast_shared.providers import ProviderRegistry
from holdfast_shared.redisconn import connect
from holdfast_shared.settings import Settings, get_settings
from holdfast_shared.turnlock import TurnLock
from holdfast_shared.turnqueue import promote_stranded
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncEngine

from holdfast_loop_worker.consumer import TurnConsumer
from holdfast_loop_worker.context.engine import ContextEngine, ContextSettings, unfit
from holdfast_loop_worker.context.memory import BrainMemory
from holdfast_loop_worker.context.working_memory import WorkingMemoryStore
from holdfast_loop_worker.hitl import HumanChannel
from holdfast_loop_worker.inbox import Inbox
from holdfast_loop_worker.lease import Leases
from holdfast_loop_worker.recovery import queue_resume, requeue_stale, requeue_unfinished
from holdfast_loop_worker.subagents import Subagents
from holdfast_loop_worker.toolcalls import ToolCaller
from holdfast_loop_worker.turn import TurnContext
from holdfast_loop_worker.turn_state import Snapshots

log = logging.getLogger(__name__)


async def _expire_questions(human: HumanChannel, redis: Redis, keys: Keys) -> None:
    """Resume turns whose question expired: the asked-for call fails with "expired"."""
    for tenant_id, task_id, turn_id in await human.expire_overdue():
        await queue_resume(redis, keys, tenant_id, task_id, turn_id)


def _checked_providers(
    settings: Settings,
) -> tuple[ProviderRegistry, ContextSettings, embedders.Embedder | None]:
    """The providers, context settings and embedder the worker serves with.

    Settings no turn could run with stop the worker here, not mid-turn; a
    model whose window is too small is not such a setting (:func:`unfit_models`).
    """
    providers = ProviderRegistry.from_env(os.environ, settings.model)
    for agent, spec in settings.agent_models.items():
        providers.resolve(spec)  # an agent's model no worker can run is a start-up error
        log.info("agent %s uses %s", agent, spec)
    context_settings = ContextSettings(
        window=settings.context_window,
        threshold=settings.compaction_threshold,
        compaction_model=settings.compaction_model,
        tool_result_chars=settings.tool_result_context_chars,
        max_output_tokens=settings.max_output_tokens,
        model_max_output_tokens=settings.model_max_output_tokens,
        agent_max_output_tokens=settings.agent_max_output_tokens,
    )
    try:
        if settings.compaction_model:
            providers.resolve(settings.compaction_model)
        embedder = embedders.from_settings(settings)
    except ValueError as exc:
        raise _InvalidSettings(providers, str(exc)) from None
    return providers, context_settings, embedder


def unfit_models(
    settings: Settings, providers: ProviderRegistry, context: ContextSettings
) -> dict[str, str]:
    """``provider:model`` → why, for the models (the default and the agents')
    whose window cannot hold a built-in agent even trimmed. The worker keeps
    running and says so (``liveness.announce_worker``): the gateway refuses
    turns for them (422 ``MODEL_UNAVAILABLE``) and ``/health`` is degraded,
    rather than a worker that exits and restarts while turns wait for it."""
    found: dict[str, str] = {}
    for spec in {None, *settings.agent_models.values()}:
        choice = providers.resolve(spec)
        named = f"{choice.provider.name}:{choice.model}"
        for builtin in builtin_agents().values():
            why = unfit(context, choice.model, builtin.system_prompt, builtin.tool_specs())
            if why is not None:
                log.error("loop-worker: %s cannot be served: %s", named, why)
                found[named] = why
                break
    return found


class _InvalidSettings(Exception):
    def __init__(self, providers: ProviderRegistry, message: str) -> None:
        super().__init__(message)
        self.providers = providers


async def _context_engine(
    settings: Settings,
    engine: AsyncEngine,
    redis: Redis,
    keys: Keys,
    providers: ProviderRegistry,
    context_settings: ContextSettings,
    embedder: embedders.Embedder | None,
) -> ContextEngine:
    sessions = session_factory(engine)
    reads = autocommit_session_factory(engine)
    index = await open_index(engine, embedder)
    return ContextEngine(
        sessions,
        providers,
        BrainMemory(
            sessions,
            Searcher(index),
            budget_tokens=settings.memory_context_tokens,
            index=index,
            reads=reads,
        ),
        WorkingMemoryStore(redis, keys, ttl_seconds=settings.working_memory_ttl),
        context_settings,
        reads=reads,
    )


def _turn_context(
    settings: Settings,
    engine: AsyncEngine,
    redis: Redis,
    keys: Keys,
    providers: ProviderRegistry,
    context: ContextEngine,
    inbox: Inbox,
    leases: Leases,
) -> TurnContext:
    sessions = session_factory(engine)
    # The per-turn look-ups (turn row, snapshot, steers, history, memories)
    # and the leases' one-statement updates.
    reads = autocommit_session_factory(engine)
    eventlog = EventLog(redis, sessions, keys, hot_ttl_seconds=settings.channel_state_ttl_active)
    lock = TurnLock(redis, keys, ttl_seconds=settings.turn_deadline_seconds + 600)
    return TurnContext(
        sessions=sessions,
        reads=reads,
        redis=redis,
        keys=keys,
        eventlog=eventlog,
        providers=providers,
        snapshots=Snapshots(
            sessions,
            reads=reads,
            active_ttl_seconds=settings.channel_state_ttl_active,
            hitl_ttl_seconds=settings.channel_state_ttl_hitl,
        ),
        leases=leases,
        lock=lock,
        human=HumanChannel(sessions, ttl_seconds=settings.channel_state_ttl_hitl),
        tools=ToolCaller(
            redis,
            keys,
            sessions,
            inbox,
            permission=settings.permission_override,
            network_agents=frozenset(settings.network_agents),
            timeout_seconds=settings.tool_timeout_seconds,
            retries=settings.tool_retries,
        ),
        context=context,
        max_iterations=settings.max_iterations,
        deadline_seconds=settings.turn_deadline_seconds,
        hitl_ttl_seconds=settings.channel_state_ttl_hitl,
        agent_models=settings.agent_models,
        subagents=Subagents(
            sessions, redis, keys, eventlog, lock, settings.tenant_max_running_turns
        ),
        max_subagents=settings.max_subagents_per_turn,
        max_subagent_depth=settings.max_subagent_depth,
    )


def _presence(
    settings: Settings,
    redis_url: str,
    redis: Redis,
    keys: Keys,
    worker_id: str,
    providers: ProviderRegistry,
    unavailable: dict[str, str],
) -> runtime.Presence:
    async def announce() -> None:
        await liveness.announce_worker(
            redis,
            keys,
            worker_id,
            providers.names,
            default_model=providers.default_model,
            ttl_seconds=settings.liveness_seconds,
            unavailable=unavailable,
        )

    return runtime.Presence(
        Heartbeat(
            redis_url,
            keys.worker_alive(worker_id),
            json.dumps({"providers": sorted(providers.names)}),
            ttl_seconds=settings.liveness_seconds,
        ),
        announce,
        lambda: liveness.withdraw_worker(redis, keys, worker_id),
        liveness_seconds=settings.liveness_seconds,
        what="announcing the worker and its providers",
    )


def _start_sweeps(background: Background, settings: Settings, ctx: TurnContext) -> None:
    """Question expiry, the stale-turn sweep and the waiting-message sweep."""
    sessions, redis, keys, eventlog = ctx.sessions, ctx.redis, ctx.keys, ctx.eventlog
    background.start(
        every(
            # A short TTL (a test's, a demo's) is acted on within a quarter of it.
            min(30.0, max(1.0, settings.channel_state_ttl_hitl / 4)),
            lambda: _expire_questions(ctx.human, redis, keys),
            what="expiring questions",
        ),
        name="expire-questions",
    )
    background.start(
        every(
            settings.lease_seconds,
            lambda: requeue_stale(
                sessions, redis, keys, ctx.lock, eventlog, settings.lease_seconds
            ),
            what="the stale-turn sweep",
            wait_first=True,
        ),
        name="stale-turns",
    )
    background.start(
        every(
            settings.lease_seconds,
            lambda: promote_stranded(sessions, redis, keys, ctx.lock, eventlog),
            what="the waiting-message sweep",
            wait_first=True,
        ),
        name="waiting-messages",
    )


def _consumer(settings: Settings, ctx: TurnContext, leases: Leases, worker_id: str) -> TurnConsumer:
    async def rebuild() -> None:
        # The turns group was created anew (Redis lost it): queue what was running.
        await requeue_unfinished(ctx.sessions, ctx.redis, ctx.keys)

    return TurnConsumer(
        ctx.redis,
        ctx.keys,
        ctx,
        leases,
        consumer_name=worker_id,
        concurrency=settings.worker_concurrency,
        lease_seconds=settings.lease_seconds,
        drain_seconds=settings.drain_seconds,
        on_group_created=rebuild,
        liveness_seconds=settings.liveness_seconds,
    )


async def serve(settings: Settings, stop: asyncio.Event | None = None) -> None:
    redis_url, database_url = settings.require_urls()
    try:
        providers, context_settings, embedder = _checked_providers(settings)
    except _InvalidSettings as exc:
        await exc.providers.aclose()
        raise SystemExit(f"loop-worker: invalid settings: {exc}") from None
    stop = runtime.stop_on_signals(stop)
    worker_id = runtime.process_name()
    redis = connect(redis_url)
    # Turns hold a connection only for short writes, so 8 (plus as many in
    # overflow) serve a hundred slots. Below that the pool keeps one per slot
    # and two for the archiver and the sweeps: a connection opened past the
    # pool is closed when it is returned, and at 4 slots a smaller pool opened
    # more than one PostgreSQL connection a turn (a backend forked each time).
    engine = create_engine(
        database_url,
        pool_size=min(8, settings.worker_concurrency + 2),
        keep=settings.database_pool_size,
    )
    keys = Keys(settings.redis_prefix)
    inbox = Inbox(redis, keys, worker_id)
    leases = Leases(
        autocommit_session_factory(engine), worker_id, lease_seconds=settings.lease_seconds
    )
    context = await _context_engine(
        settings, engine, redis, keys, providers, context_settings, embedder
    )
    ctx = _turn_context(settings, engine, redis, keys, providers, context, inbox, leases)

    consumer = _consumer(settings, ctx, leases, worker_id)
    unavailable = unfit_models(settings, providers, context_settings)
    presence = _presence(settings, redis_url, redis, keys, worker_id, providers, unavailable)
    archiver = Archiver(ctx.eventlog, settings.archive_interval_seconds)
    # Everything it serves with is imported now (the provider SDKs with the registry).
    runtime.settle_heap()
    log.info(
        "loop-worker %s ready; default model %s; providers: %s",
        worker_id,
        providers.default_model,
        ", ".join(providers.names),
    )
    try:
        async with Background() as background:
            background.start(archiver.run(), name="event-archiver")
            background.start(inbox.run(), name="inbox")
            await presence.start(background)  # before the first job is read
            _start_sweeps(background, settings, ctx)
            await consumer.run(stop)
        await archiver.flush()
        await inbox.close()
    finally:
        await presence.stop()
        await providers.aclose()
        if embedder is not None:
            await embedder.aclose()
        await redis.aclose()
        await engine.dispose()
    log.info("loop-worker stopped")


def main() -> None:
    settings = get_settings()
    setup_process(settings, "loop-worker")
    runtime.run(serve(settings), settings.event_loop)
