"""tool-runner entry point.

Consumes: tool calls (``Keys.tools``, group ``tool-runners``), built-in tools
and Asset Directory (MCP) servers' tools alike, probes of MCP servers, and
workspace checkpoint/restore requests; turn-end reap requests
(``Keys.tools_reap``), after which the task's workspace is archived.
Produces: each call's outcome in ``tool_results`` (PostgreSQL) and on the
waiting loop-worker's inbox; a probe's tools on the gateway's reply list;
files in the task's workspace (one size-capped filesystem per tenant and
task, removed with the task), archived off this disk (``checkpoints.py``).
Guarantees: every process a tool starts runs in the sandbox (bubblewrap +
seccomp + landlock + limits) or not at all — an MCP stdio server too; a call
runs at most once, and a redelivered call gets the stored outcome; an MCP
server's credentials never leave this process except to that server;
SIGTERM stops taking calls and lets running ones finish; a tool call runs
in the workspace's last archived state when this disk lacks it (restored first).
"""

from __future__ import annotations

import asyncio
import json
import logging

from holdfast_shared import liveness, runtime
from holdfast_shared.assets import Vault, VaultError, vault_from_settings
from holdfast_shared.background import Background, every
from holdfast_shared.db import autocommit_session_factory, create_engine, session_factory
from holdfast_shared.keys import Keys
from holdfast_shared.liveness import Heartbeat
from holdfast_shared.observability.process import setup_process
from holdfast_shared.outbound import OutboundPolicy
from holdfast_shared.redisconn import connect
from holdfast_shared.settings import Settings, get_settings
from holdfast_shared.workspace_checkpoints import store_from_settings

from holdfast_tool_runner.checkpoints import WorkspaceCheckpoints
from holdfast_tool_runner.connectors import Connectors
from holdfast_tool_runner.consumer import ToolConsumer
from holdfast_tool_runner.diskusage import WorkspaceUsageReporter
from holdfast_tool_runner.executor import ToolExecutor
from holdfast_tool_runner.hibernation import hibernate_idle, sweep_interval
from holdfast_tool_runner.sandbox import launcher_pool, probe
from holdfast_tool_runner.skillfiles import CACHE_DIR, SkillFiles
from holdfast_tool_runner.workspace_sweep import sweep_once
from holdfast_tool_runner.workspaces import Workspaces

log = logging.getLogger(__name__)

# How often workspaces of deleted tasks whose removal job was lost are looked for.
_SWEEP_SECONDS = 600.0
# How often idle MCP sessions are looked for.
_MCP_SWEEP_SECONDS = 15.0


def _vault(settings: Settings) -> Vault | None:
    """The Asset Directory's key; without it MCP calls fail with the reason."""
    try:
        return vault_from_settings(settings)
    except VaultError as exc:
        log.warning("MCP servers unavailable on this runner: %s", exc)
        return None


async def serve(settings: Settings, stop: asyncio.Event | None = None) -> None:
    redis_url, database_url = settings.require_urls()
    stop = runtime.stop_on_signals(stop)
    runner_id = runtime.process_name()
    redis = connect(redis_url, max_connections=50)
    engine = create_engine(database_url, pool_size=4, keep=settings.database_pool_size)
    sessions = session_factory(engine)
    keys = Keys(settings.redis_prefix)
    workspaces = await asyncio.to_thread(Workspaces.from_settings, settings)
    found = await probe(workspaces=workspaces.describe())
    # None when the host cannot sandbox: every call then fails closed with the reason.
    launchers = launcher_pool(spares=settings.sandbox_spares) if found.available else None
    # Workspace checkpoints and hibernation (checkpoints.py, hibernation.py).
    archiving = WorkspaceCheckpoints(
        workspaces,
        store_from_settings(settings.workspace_store, sessions),
        redis,
        keys,
        archive_on_turn_end=settings.workspace_archive_on_turn_end,
    )
    connectors = Connectors(
        sessions,
        _vault(settings),
        workspaces,
        launchers=launchers,
        stdio_paths=tuple(settings.asset_stdio_paths),
        idle_seconds=settings.asset_session_idle_seconds,
        stdio_idle_seconds=settings.asset_stdio_idle_seconds,
        connect_timeout=settings.asset_connect_timeout_seconds,
        outbound=OutboundPolicy.from_settings(settings),
        archiving=archiving,
    )
    consumer = ToolConsumer(
        redis,
        keys,
        ToolExecutor(
            redis,
            keys,
            # Its writes are one statement each (a call's row claimed, completed):
            # autocommit saves a BEGIN and a COMMIT round trip on every call.
            autocommit_session_factory(engine),
            workspaces,
            runner_id,
            launchers,
            skill_files=SkillFiles(workspaces.root / CACHE_DIR, sessions),
            connectors=connectors,
            archiving=archiving,
        ),
        workspaces,
        consumer_name=runner_id,
        concurrency=settings.tool_concurrency,
        claim_idle_ms=int(settings.tool_claim_idle_seconds * 1000),
        liveness_seconds=settings.liveness_seconds,
        archiving=archiving,
    )

    async def announce() -> None:
        await liveness.announce_runner(
            redis, keys, runner_id, found.as_dict(), ttl_seconds=settings.liveness_seconds
        )

    presence = runtime.Presence(
        Heartbeat(
            redis_url,
            keys.runner_alive(runner_id),
            json.dumps(found.as_dict()),
            ttl_seconds=settings.liveness_seconds,
        ),
        announce,
        lambda: liveness.withdraw_runner(redis, keys, runner_id),
        liveness_seconds=settings.liveness_seconds,
        what="refreshing the liveness key",
    )

    runtime.settle_heap()
    log.info(
        "tool-runner %s ready; workspaces in %s; sandbox: %s", runner_id, workspaces.root, found
    )
    if launchers is not None:
        launchers.start()
    try:
        async with Background() as background:
            await presence.start(background)  # before the first call is read
            background.start(
                every(
                    _SWEEP_SECONDS,
                    lambda: sweep_once(workspaces, sessions),
                    what="the sweep of deleted tasks' workspaces",
                ),
                name="workspace-sweep",
            )
            background.start(
                every(
                    _MCP_SWEEP_SECONDS,
                    connectors.sweep,
                    what="closing idle MCP sessions",
                ),
                name="mcp-session-sweep",
            )
            if settings.tenant_max_storage_bytes > 0:
                # For HOLDFAST_TENANT_MAX_STORAGE_BYTES (diskusage.py); without a cap
                # nobody reads the figure, so no runner walks its disk for it.
                usage = WorkspaceUsageReporter(
                    workspaces, redis, keys, interval_seconds=settings.storage_usage_refresh_seconds
                )
                background.start(
                    every(
                        settings.storage_usage_refresh_seconds,
                        usage.report,
                        what="reporting the workspaces' disk usage",
                    ),
                    name="workspace-usage",
                )
            hibernate_after = settings.workspace_hibernate_after_seconds
            if hibernate_after > 0:
                background.start(
                    every(
                        sweep_interval(hibernate_after),
                        lambda: hibernate_idle(archiving, hibernate_after),
                        what="hibernating idle workspaces",
                        wait_first=True,
                    ),
                    name="workspace-hibernation",
                )
            await consumer.run(stop)
    finally:
        await archiving.aclose()  # turn-end checkpoints under way finish first
        await connectors.aclose()
        if launchers is not None:
            await launchers.aclose()
        await presence.stop()
        await redis.aclose()
        await engine.dispose()
    log.info("tool-runner stopped")


def main() -> None:
    """Run the tool-runner until SIGTERM/SIGINT."""
    settings = get_settings()
    setup_process(settings, "tool-runner")
    # Their request lines name MCP servers' URLs, which may carry a key.
    for noisy in ("httpx", "httpx2", "mcp"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.root.level))
    runtime.run(serve(settings), settings.event_loop)
